"""Train a small DeepSeek-V3-style model (grouped routing) on the bundled text, so the grouped-routing
comparisons (`scripts/grouped_selection.py --model DIR`) also run on a router whose choices follow the
data rather than random weights.

    .venv/bin/python scripts/train_tiny_grouped.py --out build/grouped-trained --minutes 10

Character-level LM (the tiny char tokenizer, 96 ids) on the bundled calibration documents
(`--data text`; evaluation uses the held-out split). Shape: ``models.tiny.GROUPED`` widened
(hidden 64, expert width 32): a dense first layer, 16 routed experts in 4 groups, top-4 from
topk_group=2 groups, one shared expert. Load balancing is DeepSeek-V3's auxiliary-loss-free rule:
after every step each layer's ``e_score_correction_bias`` moves by ``--bias-rate`` toward the mean
load (up for under-loaded experts, down for over-loaded ones). Plain AdamW, cosine schedule.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def main() -> int:
    from moetailor.calibration.data import iter_token_batches
    from moetailor.models.tiny import char_tokenizer, tiny_grouped_model
    from moetailor.routing import RoutingController

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="build/grouped-trained")
    ap.add_argument("--minutes", type=float, default=10.0, help="wall-clock training budget")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    tok = char_tokenizer()
    model = tiny_grouped_model(seed=args.seed, hidden=64, expert_width=32)
    model.train()
    ctl = RoutingController(model)  # no policy: the stock router; the observer counts expert loads
    model.set_experts_implementation("grouped_mm")  # transformers' own grouped GEMM trains faster than a loop
    loads: dict[int, torch.Tensor] = {}

    def count(layer, hidden, logits, weights, index):
        loads[layer.index] = loads.get(layer.index, 0) + torch.bincount(index.reshape(-1), minlength=layer.num_experts)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    budget = args.minutes * 60
    data = iter_token_batches(tok, "text", 10 ** 9, batch_tokens=args.batch * args.seq_len, seq_len=args.seq_len,
                              seed=args.seed)
    log, t0, step = [], time.time(), 0
    with ctl.observing(count):
        while time.time() - t0 < budget:
            ids = next(data)                                                     # [B, S]
            frac = (time.time() - t0) / budget
            for g in opt.param_groups:
                g["lr"] = args.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))
            loads.clear()
            logits = model(input_ids=ids[:, :-1], use_cache=False).logits        # [B, S-1, V]
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            with torch.no_grad():  # auxiliary-loss-free balancing (DeepSeek-V3)
                for layer in ctl.layers:
                    load = loads[layer.index].float()
                    layer.router.e_score_correction_bias += args.bias_rate * torch.sign(load.mean() - load)
            step += 1
            if step % 25 == 0:
                spread = {i: float(l.max() / l.float().mean()) for i, l in loads.items()}
                log.append({"step": step, "seconds": round(time.time() - t0, 1), "loss": float(loss),
                            "max_load_over_mean": spread})
                print(json.dumps(log[-1]), flush=True)
    ctl.remove()
    model.eval()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "train_log.json").write_text(json.dumps({"args": vars(args), "steps": step, "log": log}, indent=1))
    print(f"trained {step} steps in {time.time() - t0:.0f} s -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
