"""`make gpu-check`: the offline verbs, the engine's CUDA tests, the routing op in a captured CUDA
graph and one real-shaped MoE decode step against the HBM floor, on one GPU.

    python scripts/gpu_check.py [--device cuda] [--models reference,reference-qwen3] [--small] [--out gpu_check.json]

Each verb (calibrate, a small eval, a few distill steps, split) runs on --device and on the CPU
through the same CLI code and the two results are compared to a stated tolerance. ``--device cpu``
is the dry run (the comparisons then hold exactly; the CUDA-only checks report "skipped"): a CPU
test runs it with --small on a tiny checkpoint. Prints a table (check | passed | numbers) and
writes the same rows as JSON. Exit 0 when no check failed.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# nominal HBM bandwidth (bytes/s) by the name torch reports
BANDWIDTH = {"H200": 4.8e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.04e12,
             "A100 80GB PCIe": 1.94e12, "A100": 1.56e12, "L40S": 0.864e12}
# tolerances of device vs CPU (fp32 everywhere; GPU matmuls reorder sums, so near-tied routes may flip)
TOL = {"calibrate_freq": 0.01,    # share of routed (token, expert) counts that may move to another expert
       "calibrate_mass": 0.01,    # relative L1 difference of routing mass
       "eval_acc": 0.125,         # accuracy (one prompt in eight)
       "eval_kl": 1e-3,           # absolute held-out KL difference (nats/token)
       "distill_loss": 1e-3,      # relative difference of the first step's loss
       "split_objective": 1e-2}   # relative difference of the co-activation objective per layer


def cli(*args: str) -> int:
    from moetailor.cli.main import main
    return main([str(a) for a in args])


def sizes(small: bool) -> dict:
    return dict(tokens=256 if small else 8192, n=2 if small else 8, steps=2 if small else 4,
                seq=16 if small else 64, split_tokens=128 if small else 2048, anneal=20 if small else 400)


def check_calibrate(model: str, device: str, work: Path, z: dict) -> tuple[bool, str, dict]:
    from moetailor.calibration.stats import ExpertStats

    stats = {}
    for where in ("cpu", device):
        for stream in ("off", "on"):
            out = work / f"stats-{where}-{stream}.safetensors"
            t0 = time.time()
            assert cli("calibrate", model, "--data", "tasks", "--tokens", z["tokens"], "--stream", stream,
                       "--device", where, "--overwrite", "--out", out) == 0
            stats[where, stream] = (ExpertStats.load(out), time.time() - t0)
    ref = stats["cpu", "off"][0]
    worst_f = worst_m = 0.0
    for key, (s, _) in stats.items():
        for i, layer in ref.layers.items():
            other = s.layers[i]
            worst_f = max(worst_f, float((other.frequency - layer.frequency).abs().sum() / 2 / layer.frequency.sum()))
            worst_m = max(worst_m, float((other.mass - layer.mass).abs().sum() / layer.mass.abs().sum()))
    streamed = stats[device, "on"][0].meta
    ok = worst_f <= TOL["calibrate_freq"] and worst_m <= TOL["calibrate_mass"]
    return ok, (f"moved routes {worst_f:.4f} (tol {TOL['calibrate_freq']}), mass L1 {worst_m:.2e}; "
                f"{device} {stats[device, 'off'][1]:.1f}s vs cpu {stats['cpu', 'off'][1]:.1f}s; streamed peak on "
                f"{device} {streamed.get('peak_device_bytes', 0) / 2**20:.1f} MiB"), \
        {"moved_routes": worst_f, "mass_l1": worst_m, "streamed_peak_device_bytes": streamed.get("peak_device_bytes"),
         "seconds": {f"{w}-{s}": round(t, 2) for (w, s), (_, t) in stats.items()}}


def check_eval(model: str, device: str, work: Path, z: dict) -> tuple[bool, str, dict]:
    from moetailor.plans import Plan

    stats = work / "stats-cpu-off.safetensors"
    plan = work / "plan.json"
    assert cli("plan", stats, "--criterion", "frequency", "--keep", "0.5", "--out", plan, "--overwrite") == 0
    Plan.load(plan)
    acc, kl = {}, {}
    for where in ("cpu", device):
        out = work / f"eval-{where}"
        assert cli("eval", model, "--configs", "baseline", "--tasks", "addition", "--n", z["n"], "--seeds", "1",
                   "--max-tokens", "8", "--kl-docs", "1", "--kl-window", "64", "--device", where, "--overwrite",
                   "--out", out) == 0
        rows = json.loads((out / "results.json").read_text())["rows"]
        acc[where] = next(r["accuracy"] for r in rows if r["task"] == "all")
        out = work / f"evalkl-{where}"
        assert cli("eval", model, "--metric", "kl", "--plan", plan, "--kl-docs", "1", "--kl-window", "64",
                   "--device", where, "--overwrite", "--out", out) == 0
        kl[where] = json.loads((out / "kl.json").read_text())["kl"]
    d_acc, d_kl = abs(acc[device] - acc["cpu"]), abs(kl[device] - kl["cpu"])
    ok = d_acc <= TOL["eval_acc"] and d_kl <= TOL["eval_kl"]
    return ok, (f"accuracy {acc[device]:.3f} vs cpu {acc['cpu']:.3f} (tol {TOL['eval_acc']}); streamed KL "
                f"{kl[device]:.5f} vs {kl['cpu']:.5f} (tol {TOL['eval_kl']})"), {"accuracy": acc, "kl": kl}


def check_distill(model: str, device: str, work: Path, z: dict) -> tuple[bool, str, dict]:
    plan = work / "plan.json"
    loss = {}
    for where in ("cpu", device):
        out = work / f"distill-{where}"
        t0 = time.time()
        assert cli("distill", model, plan, "--data", "tasks", "--steps", z["steps"], "--batch-size", "2",
                   "--seq-len", z["seq"], "--device", where, "--overwrite", "--out", out) == 0
        log = json.loads((out / "train_log.json").read_text())
        loss[where] = {"first": log[0]["loss"], "last": log[-1]["loss"], "seconds": round(time.time() - t0, 2)}
    rel = abs(loss[device]["first"] - loss["cpu"]["first"]) / max(abs(loss["cpu"]["first"]), 1e-12)
    return rel <= TOL["distill_loss"], (f"first-step loss {loss[device]['first']:.5f} vs cpu {loss['cpu']['first']:.5f} "
                                        f"(rel {rel:.1e}, tol {TOL['distill_loss']}); last {loss[device]['last']:.5f}"), loss


def check_split(model: str, device: str, work: Path, z: dict) -> tuple[bool, str, dict]:
    from moetailor.transforms.split import read_split_sidecar

    objective = {}
    for where in ("cpu", device):
        out = work / f"split-{where}"
        assert cli("split", model, "--parts", "2", "--data", "tasks", "--tokens", z["split_tokens"], "--seq-len",
                   z["seq"], "--anneal-steps", z["anneal"], "--device", where, "--overwrite", "--out", out) == 0
        objective[where] = {i: o["objective"] for i, o in read_split_sidecar(out)["meta"]["objective"].items()}
    rel = max(abs(objective[device][i] - v) / max(abs(v), 1e-12) for i, v in objective["cpu"].items())
    return rel <= TOL["split_objective"], f"co-activation objective max rel diff {rel:.1e} (tol {TOL['split_objective']})", \
        {"objective": objective, "max_rel": rel}


def check_cuda_tests(device: str) -> tuple[bool | None, str, dict]:
    if not device.startswith("cuda"):
        return None, "skipped (no CUDA device)", {}
    root = Path(__file__).resolve().parents[1]
    t0 = time.time()
    run = subprocess.run([sys.executable, "-m", "pytest", str(root / "tests" / "cuda"), "-q", "-p", "no:cacheprovider"],
                         capture_output=True, text=True, cwd=root, timeout=240)
    tail = (run.stdout.strip().splitlines() or [""])[-1]
    return run.returncode == 0, f"{tail} ({time.time() - t0:.0f} s)", {"rc": run.returncode, "summary": tail}


def check_graph_routing(device: str) -> tuple[bool | None, str, dict]:
    """The plugin's routing op captured once in a CUDA graph, replayed on other steps' buffers: each
    replay equals eager routing of that step (the op reads per-step tensors, never Python values)."""
    from moetailor.integrations.vllm.routing import step_routes
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "cuda"))
    from test_engine_on_cuda import POLICIES, dense, routing, step_inputs

    if not device.startswith("cuda"):
        for name in sorted(POLICIES):                    # dry run: the same op, eagerly on the CPU
            logits, *rest = step_inputs(0)
            dense(*step_routes(logits, routing(POLICIES[name], "cpu"), *rest))
        return None, f"skipped capture (no CUDA); the op ran eagerly for {len(POLICIES)} policies", {}
    worst = 0.0
    for name in sorted(POLICIES):
        lr = routing(POLICIES[name], device)
        buffers = [x.to(device) for x in step_inputs(0)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step_routes(buffers[0], lr, *buffers[1:])
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_w, out_i = step_routes(buffers[0], lr, *buffers[1:])
        for seed in range(1, 6):
            step = step_inputs(seed)
            for buf, value in zip(buffers, step):
                buf.copy_(value)
            graph.replay()
            want = step_routes(step[0].to(device), lr, *[x.to(device) for x in step[1:]])
            worst = max(worst, float((dense(out_w, out_i) - dense(*want)).abs().max()))
    return worst <= 1e-5, f"{len(POLICIES)} policies x 5 replays, max |replay - eager| {worst:.1e} (tol 1e-5)", \
        {"max_abs": worst}


def check_hbm_floor(device: str, small: bool) -> tuple[bool | None, str, dict]:
    """One Qwen3-30B-A3B-shaped MoE layer (H 2048, 128 experts of width 768, top-8, bf16) decoding
    a batch of 1 and 8 tokens: expert bytes read / step time against the GPU's nominal bandwidth."""
    from moetailor.models import moe_layers
    from moetailor.models.tiny import tiny_model
    from moetailor.routing import RoutingController

    H, E, K, I = (64, 16, 4, 32) if small else (2048, 128, 8, 768)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = tiny_model("qwen3_moe", num_experts=E, top_k=K, layers=1, hidden=H, expert_width=I, vocab=128)
    model = model.to(device=device, dtype=dtype)
    RoutingController.of(model)
    block = model.model.layers[0].mlp
    layer = moe_layers(model)[0]
    expert_bytes = 3 * H * I * dtype.itemsize
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    bandwidth = next((bw for key, bw in BANDWIDTH.items() if key in name), None)
    rows = {}
    for batch in (1, 8):
        x = torch.randn(batch, 1, H, device=device, dtype=dtype)
        with torch.no_grad():
            index = layer.router_logits(x.view(-1, H)).topk(K, dim=-1).indices
            distinct = int(torch.unique(index).numel())
            for _ in range(5):
                block(x)
            reps = 20 if small else 200
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                block(x)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            step = (time.perf_counter() - t0) / reps
        read = distinct * expert_bytes + E * H * dtype.itemsize
        floor = read / bandwidth if bandwidth else None
        rows[batch] = {"experts_read": distinct, "bytes": read, "step_us": step * 1e6,
                       "floor_us": floor * 1e6 if floor else None, "share_of_floor": floor / step if floor else None}
    text = "; ".join(f"batch {b}: {r['experts_read']} experts, {r['bytes'] / 2**20:.1f} MiB, {r['step_us']:.0f} us"
                     + (f" (floor {r['floor_us']:.0f} us, {100 * r['share_of_floor']:.0f}% of HBM)" if r["floor_us"]
                        else "") for b, r in rows.items())
    return None, f"{name}: {text}", {"gpu": name, "bandwidth": bandwidth, "shape": [H, E, K, I], "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="device to check against the CPU (cpu: the dry run)")
    p.add_argument("--models", default="reference,reference-qwen3", help="comma-separated models (bundled names or "
                   "checkpoint folders)")
    p.add_argument("--small", action="store_true", help="small sizes (the CPU test)")
    p.add_argument("--out", default="gpu_check.json", help="JSON with every row")
    p.add_argument("--skip", default="", help="comma-separated checks to leave out")
    args = p.parse_args(argv)
    os.environ.setdefault("MOETAILOR_NATIVE", "0")   # the CPU side without a C++ build: the same torch code path
    from moetailor.device import resolve_device
    device = str(resolve_device(args.device))
    z = sizes(args.small)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    results = []
    t_all = time.time()

    def record(name: str, fn, *a):
        if name.split(" ")[0] in skip:
            return
        t0 = time.time()
        try:
            passed, numbers, data = fn(*a)
        except Exception as e:   # a failing check is a row, not the end of the run
            passed, numbers, data = False, f"{type(e).__name__}: {' '.join(str(e).split())[:300]}", {}
        results.append({"check": name, "passed": passed, "numbers": numbers, "seconds": round(time.time() - t0, 1),
                        **data})
        print(f"[{time.time() - t_all:6.0f}s] {name}: {passed} {numbers}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="moetailor-gpu-check-") as tmp:
        for model in [m.strip() for m in args.models.split(",") if m.strip()]:
            work = Path(tmp) / Path(model).name
            work.mkdir()
            for name, fn in (("calibrate", check_calibrate), ("eval", check_eval), ("distill", check_distill),
                             ("split", check_split)):
                record(f"{name} {Path(model).name}", fn, model, device, work, z)
        record("cuda-tests", check_cuda_tests, device)
        record("graph-routing", check_graph_routing, device)
        record("hbm-floor", check_hbm_floor, device, args.small)
    from moetailor.tables import print_table
    print_table(f"gpu check on {device} ({torch.cuda.get_device_name(device) if device.startswith('cuda') else 'cpu'}; "
                f"torch {torch.__version__}; {time.time() - t_all:.0f} s)", ["check", "passed", "numbers"],
                [(r["check"], {True: "yes", False: "NO", None: "-"}[r["passed"]], r["numbers"]) for r in results])
    import transformers
    Path(args.out).write_text(json.dumps({"device": device, "torch": torch.__version__,
                                          "transformers": transformers.__version__, "seconds": round(time.time() - t_all, 1),
                                          "checks": results}, indent=1, default=str))
    print(f"wrote {args.out}")
    return 1 if any(r["passed"] is False for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
