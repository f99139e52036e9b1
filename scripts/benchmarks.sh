#!/usr/bin/env bash
# The speed benchmarks of docs/benchmarks.md in one run, back to back, each with the load average before it,
# so the numbers share one machine state; then the page's generated block is rewritten from the run's results
# (python -m moetailor.bench.page: every table with its command and this machine). Run it on an idle machine:
#     flock /tmp/moetailor-heavy.lock bash scripts/benchmarks.sh [OUT_DIR]
# Steps whose environment is missing (.venv-llamacpp: make setup-llamacpp; .venv-vllm: make setup-vllm) are left out.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/bench-$(date -u +%Y%m%d-%H%M)}
mkdir -p "$out"
: > "$out/index.jsonl"
py=.venv/bin/python
# run NAME RESULT COMMAND...: RESULT is the file or folder (relative to OUT_DIR) the command writes its tables to
run() {
  local name=$1 result=$2; shift 2
  local cmd="$*" rc
  echo "== $name start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/index.txt"
  "$@" > "$out/$name.txt" 2>&1
  rc=$?
  echo "== $name exit $rc end $(date -u +%T)" | tee -a "$out/index.txt"
  cmd=${cmd//\\/\\\\}
  printf '{"name": "%s", "result": "%s", "command": "%s", "exit": %d}\n' "$name" "$result" "${cmd//\"/\\\"}" "$rc" \
    >> "$out/index.jsonl"
}
lscpu | grep -E "Model name|^CPU\(s\)|L3" > "$out/machine.txt"
$py -m moetailor.bench.page machine "$out/machine.json"
run engine_vs_hf engine_vs_hf/results.json \
    $py scripts/engine_vs_hf.py --batch 1 8 32 --out "$out/engine_vs_hf"
run engine_vs_hf_1thread engine_vs_hf_1thread/results.json \
    $py scripts/engine_vs_hf.py --batch 1 8 32 --threads 1 --no-vllm --out "$out/engine_vs_hf_1thread"
run native_kernels native_kernels.json $py scripts/native_kernels.py --out "$out/native_kernels.json"
run split_decode split_decode.json $py scripts/split_decode.py --parts 4 --steps 32 --repeats 3 \
    --out "$out/split_decode.json"
run decode_floor decode_floor.json \
    $py scripts/decode_floor.py --batches 1 8 --layers 1 --experts 32 --out "$out/decode_floor.json"
run decode_floor_1thread decode_floor_1thread.json \
    $py scripts/decode_floor.py --batches 1 8 --layers 1 --experts 32 --threads 1 --out "$out/decode_floor_1thread.json"
run bench_decode decode .venv/bin/moetailor bench decode --model both --batches 1,8,32,64 --steps 4 --out "$out/decode"
run bench_slo slo .venv/bin/moetailor bench slo --model both --steps 4 --out "$out/slo"
run bench_prefill prefill .venv/bin/moetailor bench prefill --model both --out "$out/prefill"
# llama.cpp on the same weights (f32 GGUF), when its environment exists (make setup-llamacpp)
if [ -x .venv-llamacpp/bin/python ]; then
  run llamacpp_vs_engine llamacpp/results.json .venv-llamacpp/bin/python scripts/llamacpp_vs_engine.py \
      --batch 1 8 32 --repeats 5 --plan src/moetailor/assets/plans/reference-reap-50.json --out "$out/llamacpp"
fi
# the same on a real-size bf16 checkpoint (4 OLMoE-1B-7B layers, 3.5 GiB, written once) against llama.cpp and the floor
[ -f build/olmoe4/config.json ] || run synth_olmoe4 "" .venv/bin/moetailor synth olmoe-1b-7b --layers 4 --out build/olmoe4
if [ -x .venv-llamacpp/bin/python ]; then
  run llamacpp_vs_engine_olmoe4 llamacpp_olmoe4/results.json .venv-llamacpp/bin/python scripts/llamacpp_vs_engine.py \
      --model build/olmoe4 --dtype bf16 --prompt-len 32 --new-tokens 16 --batch 1 8 32 --repeats 5 \
      --out "$out/llamacpp_olmoe4"
fi
run olmoe4_floor olmoe4-decode.json $py scripts/scale.py decode-one --kind full --model build/olmoe4 \
    --pruned build/olmoe4 --batches 1 8 32 64 --out "$out/olmoe4-decode.json"
# vLLM's CPU build (docs/vllm.md), when its environment exists (make setup-vllm): stock, every technique and
# the pair's pruned decode instance on moetailor's experts kernel, every instance's worker bound to the same CPUs
# (the method of "Colocated vs the pair"); then FIFO against the k-aware scheduler on a split checkpoint
if [ -x .venv-vllm/bin/moetailor ]; then
  run bench_vllm vllm .venv-vllm/bin/moetailor bench vllm --model synthetic --dtype float32 \
      --only stock,experts-kernel,disaggregated-kernel --batches 8,32 --new-tokens 32 --repeats 2 \
      --out "$out/vllm" --overwrite
  run bench_vllm_k vllm-k .venv-vllm/bin/moetailor bench vllm-k --model synthetic --dtype float32 --experts-kernel \
      --requests 32,64 --max-num-seqs 16 --budgets 2,16 --new-tokens 32 --schedule tiers --slo 4 \
      --out "$out/vllm-k" --overwrite
  # what observing served traffic costs per MoE layer (docs/vllm.md, "Calibration from live traffic")
  run observe_cost observe_cost .venv-vllm/bin/python scripts/observe_cost.py layer
fi
echo "done $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$out/index.txt"
$py -m moetailor.bench.page render "$out" --page docs/benchmarks.md
