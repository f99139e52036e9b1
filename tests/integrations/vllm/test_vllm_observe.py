"""Calibration from live traffic inside vLLM (``additional_config`` ``moetailor_observe``): observing N
prompts through vLLM (default compiled mode) writes the statistics `calibrate` computes on the same
tokens, to float tolerance, in the file `moetailor plan` reads."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest
import torch
from vllm_helpers import SKIP_REASON, vllm_engine

pytest.importorskip("vllm", reason=SKIP_REASON)

from moetailor.calibration import ExpertStats, calibrate_batches  # noqa: E402
from moetailor.models.loading import load_model, resolve_model_path  # noqa: E402

PROMPTS = [[11, 42, 7, 99, 5], [3, 250, 18, 61, 77, 140, 9, 23, 31], [400, 2, 8], list(range(100, 112))]
MAX_TOKENS = 7
ROUTER = ("frequency", "mass", "coselect", "beta_hist")


def observe(path, max_num_seqs: int, experts_kernel: bool, every: int = 0, mid_run=None, decode_plan=None,
            budgets=None):
    """Serve PROMPTS greedily on vLLM with the plugin observing into ``path`` (under ``decode_plan`` and
    per-request ``expert_top_k`` ``budgets`` when given); the token ids each request ran (its prompt
    and every completion token but the last)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from moetailor.integrations.vllm.launch import engine_kwargs

    kwargs = engine_kwargs("reference", decode_plan=decode_plan, kv_cache_mib=64, experts_kernel=experts_kernel,
                           observe=path, observe_every=every, max_num_seqs=max_num_seqs, enable_prefix_caching=False)
    extra = [None if budgets is None else {"expert_top_k": budgets[i % len(budgets)]} for i in range(len(PROMPTS))]
    with vllm_engine(**kwargs) as llm:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                            [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, extra_args=e)
                             for e in extra], use_tqdm=False)
        if mid_run is not None:
            mid_run(llm)
    return [p + list(o.outputs[0].token_ids)[:-1] for p, o in zip(PROMPTS, outs)]


def calibrated(runs):
    """`calibrate` on the same tokens: each request's tokens one batch, the model loaded by moetailor."""
    digest = hashlib.sha256()
    batches = [torch.tensor([r]) for r in runs]
    for b in batches:
        digest.update(b.numpy().astype("<i8").tobytes())
    stats = calibrate_batches(load_model("reference", dtype=torch.float32), batches, progress=False)
    stats.meta["data_sha256"] = digest.hexdigest()[:16]
    return stats


def assert_same(observed: ExpertStats, offline: ExpertStats, names, layers=None) -> None:
    assert observed.meta["tokens"] == offline.meta["tokens"]
    assert observed.model == offline.model
    assert observed.layers.keys() == offline.layers.keys()
    for i, layer in offline.layers.items():
        if layers is not None and i not in layers:
            continue
        got, want = observed.layers[i].tensors(), layer.tensors()
        for name in names:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-4, msg=f"layer {i} {name}")


def test_observed_on_moetailor_kernel_equals_calibrate(tmp_path):
    """One request at a time, moetailor's experts kernel: every tensor calibrate writes (EAN, REAP and
    the output statistics included), the token count, the phases and the traffic hash; written on
    demand through collective_rpc, then again at shutdown."""
    from moetailor.integrations.vllm.rpc import call, save_observed

    path = tmp_path / "observed.safetensors"
    on_demand = tmp_path / "on-demand.safetensors"
    saved = []
    runs = observe(path, 1, True, mid_run=lambda llm: saved.extend(call(llm, save_observed, str(on_demand))))
    offline = calibrated(runs)
    observed = ExpertStats.load(path)      # written at shutdown
    assert_same(observed, offline, list(offline.layers[min(offline.layers)].tensors()))
    decode = len(PROMPTS) * (MAX_TOKENS - 1)
    assert observed.meta["observed"]["decode_tokens"] == decode
    assert observed.meta["observed"]["prefill_tokens"] == sum(map(len, PROMPTS))
    assert observed.meta["data"] == "served traffic" and observed.meta["observed"]["engine"] == "vllm"
    assert observed.meta["data_sha256"] == offline.meta["data_sha256"]
    assert observed.has_expert_norms
    assert saved and saved[0]["tokens"] == offline.meta["tokens"]
    assert_same(ExpertStats.load(on_demand), offline, ROUTER + ("ean", "weighted_ean"))


def test_observed_batched_on_vllms_kernel_gives_the_router_statistics(tmp_path):
    """Four requests per step on vLLM's own fused-MoE: frequency, mass, co-selection and beta equal
    calibrate's; the file says it holds no expert output norms, and `plan --criterion reap` refuses
    it while `--criterion frequency` plans from it. Written every 3 steps while serving."""
    from moetailor.cli.main import main

    path = tmp_path / "batched.safetensors"
    during = []
    runs = observe(path, 4, False, every=3, mid_run=lambda llm: during.append(path.is_file()))
    assert during == [True]               # written by the steps, before the shutdown
    offline = calibrated(runs)
    observed = ExpertStats.load(path)
    assert_same(observed, offline, ROUTER)
    assert not observed.has_expert_norms
    assert observed.meta["observed"]["expert_outputs"].startswith("none")
    assert float(observed.layers[min(observed.layers)].ean.sum()) == 0.0
    assert main(["plan", str(path), "--criterion", "reap", "--keep", "0.5", "--out", str(tmp_path / "r.json")]) == 2
    assert main(["plan", str(path), "--criterion", "frequency", "--keep", "0.5", "--out",
                 str(tmp_path / "f.json")]) == 0
    plan = json.loads((tmp_path / "f.json").read_text())
    assert plan["meta"]["stats_data"] == "served traffic"


def test_observed_under_a_decode_plan_and_budgets_counts_the_full_router(tmp_path):
    """A decode plan (the bundled REAP 50% pool) and per-request budgets on moetailor's kernel change
    which experts the steps serve, not what is counted: the first MoE layer, whose input no plan
    changes, holds calibrate's statistics on the same tokens, EAN, REAP and the output statistics
    included (the full router's routes a step does not serve run as extra rows of its one experts pass)."""
    from moetailor.models.paths import ASSETS

    path = tmp_path / "planned.safetensors"
    runs = observe(path, 2, True, decode_plan=ASSETS / "plans" / "reference-reap-50.json", budgets=(3, 5))
    offline = calibrated(runs)
    observed = ExpertStats.load(path)
    first = min(offline.layers)
    assert_same(observed, offline, list(offline.layers[first].tensors()), layers={first})
    assert observed.meta["observed"]["decode_tokens"] == len(PROMPTS) * (MAX_TOKENS - 1)


START = """
if __name__ == "__main__":
    import sys
    from vllm import LLM
    from moetailor.models.loading import resolve_model_path
    LLM(str(resolve_model_path("reference")), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20,
        max_model_len=256, additional_config={"moetailor_observe": sys.argv[1]})
    print("STARTED")
"""


def test_an_unwritable_path_is_one_line_before_the_model_loads(tmp_path, capsys):
    """Through moetailor's launcher (`moetailor serve --backend vllm --observe`): one line, exit 2, no
    vLLM started; through vLLM directly: the start fails naming the problem before the weights load."""
    from moetailor.cli.main import main

    missing = tmp_path / "no-such-folder" / "stats.safetensors"
    assert main(["serve", "reference", "--backend", "vllm", "--observe", str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert "does not exist" in err and "create it or choose another" in err and len(err.splitlines()) == 1, err
    script = tmp_path / "start.py"
    script.write_text(START)
    r = subprocess.run([sys.executable, str(script), str(missing)], capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "STARTED" not in out
    assert "additional_config moetailor_observe" in out and "does not exist" in out, out[-3000:]
    assert "Loading weights took" not in out and "Model loading took" not in out, out[-3000:]
    assert resolve_model_path("reference").is_dir()
