"""Which MoE layers need their experts: the sensitivity of a static decode pool, layer by layer.

For each MoE layer i: next-token KL(full || plan) when only layer i is pruned to the pool size
(the others full), and when every layer but i is pruned; the same scorer as `moetailor plan
--layers search` (eval.search_k: first half of each window prefilled by the full model, KL over
the decode half under the plan), on calibration windows of DATA at a seed the search does not use.

    .venv/bin/python scripts/pool_sensitivity.py build/ref-stats-tasks.safetensors --model reference \
        --criterion reap --keep-experts 32 --data tasks --tokens 8192
"""
import argparse
import time

from moetailor.calibration import ExpertStats
from moetailor.calibration.data import default_data_spec
from moetailor.eval.metrics import HeldoutScorer
from moetailor.eval.search_k import calibration_windows
from moetailor.models import load_model, load_tokenizer
from moetailor.plans.criteria import make_plan
from moetailor.plans.techniques import Shape


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stats", help="statistics file from `moetailor calibrate`")
    ap.add_argument("--model", required=True, help="the model the statistics were made on")
    ap.add_argument("--criterion", default="reap")
    ap.add_argument("--keep-experts", type=int, required=True, help="pool size of a pruned layer")
    ap.add_argument("--data", default=None, help="text to score on (default for 'reference': tasks)")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1, help="window seed (the search uses 0)")
    args = ap.parse_args()

    t0 = time.time()
    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    stats = ExpertStats.load(args.stats)
    stats.check_model(model)
    data = default_data_spec(args.model, args.data, "--data")
    windows = calibration_windows(tokenizer, data, args.tokens, args.window, seed=args.seed)
    scorer = HeldoutScorer(model, windows)
    layers, m = Shape.of(model).layers, args.keep_experts
    full = stats.model["num_experts"]

    def kl(sizes: list[int]) -> float:
        plan = make_plan(stats, model, args.criterion, layers=dict(zip(layers, sizes)), phase="decode")
        return scorer.score(None, plan.decode).kl

    print(f"{len(windows)} windows x {args.window} tokens of {data} (seed {args.seed}); {args.criterion}, "
          f"pool of {m} of {full}")
    print(f"every layer at {m}: KL {kl([m] * len(layers)):.4f}")
    print("MoE layer | only this layer pruned | every layer but this one pruned")
    for pos, layer in enumerate(layers):
        only = kl([m if j == pos else full for j in range(len(layers))])
        but = kl([full if j == pos else m for j in range(len(layers))])
        print(f"{pos} (decoder layer {layer}) | {only:.4f} | {but:.4f}", flush=True)
    print(f"{time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
