#!/usr/bin/env bash
# The fidelity rows of docs/techniques.md, re-run on the second bundled model (reference-qwen3), with
# the same prompts (50 per task, seed 0, greedy) and the same plan recipe (task-calibrated REAP and
# EAN, 50% of the decode experts). Run from the repository root after `make train-reference-qwen3`
# (or with the bundled weights); everything heavy goes under the machine-wide lock.
#   scripts/reference_qwen3_fidelity.sh [OUT]     (default build/q3-fid)
set -euo pipefail
OUT=${1:-build/q3-fid}
M=reference-qwen3
MT=.venv/bin/moetailor
LOCK="flock /tmp/moetailor-heavy.lock"
mkdir -p "$OUT/plans"
$MT info $M
[ -f "$OUT/stats.safetensors" ] || $LOCK $MT calibrate $M --data tasks --tokens 50000 --fold --out "$OUT/stats.safetensors"
for c in reap ean; do
    [ -f "$OUT/plans/$c-0.5.json" ] || $MT plan "$OUT/stats.safetensors" --criterion $c --keep 0.5 --model $M \
        --out "$OUT/plans/$c-0.5.json"
done
$LOCK $MT eval $M --plan "$OUT/plans/reap-0.5.json" --configs baseline,pruned,phase-aware,plan+fold \
    --n 50 --seeds 1 --out "$OUT/eval-reap-50"
$LOCK $MT eval $M --plan "$OUT/plans/ean-0.5.json" --configs phase-aware,plan+fold --n 50 --seeds 1 \
    --out "$OUT/eval-ean-50"
