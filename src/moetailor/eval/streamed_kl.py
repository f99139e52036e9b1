"""Held-out KL of a pruned model from the full one, for checkpoints that do not fit in memory.

The windows run layer by layer (``models.streamed.LayerStream``) through the full checkpoint, twice
per loaded layer: with the full router and under the candidate (a plan's decode policy on every
token, or a second, pruned checkpoint streamed beside it). Reported: KL(full || candidate) in nats
per token and both perplexities; on random weights this is the meaningful quality number.
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class StreamedKL:
    kl: float                  # mean KL(full || candidate), nats per token
    perplexity_full: float
    perplexity: float          # the candidate's
    tokens: int
    seconds: float
    peak_rss_gib: float
    candidate: str

    def to_json(self) -> dict:
        return asdict(self)


def heldout_kl_streamed(model: str | Path, windows: list[list[int]], *, plan=None, pruned: str | Path | None = None,
                        dtype: torch.dtype | None = None, batch_size: int = 8, progress: bool = True,
                        placement=None) -> StreamedKL:
    """KL of ``plan`` (masked on every token) or of the checkpoint ``pruned`` from ``model``; each layer
    runs where ``placement`` (``device.Placement``, default the CPU) puts it."""
    from tqdm import tqdm

    from ..memory import peak_rss_gib
    from ..models.loading import load_checked
    from ..models.streamed import LayerStream
    from ..plans.plan import Plan
    from ..routing import RoutingController

    if (plan is None) == (pruned is None):
        raise ValueError("held-out KL needs exactly one candidate: --plan PLAN or --pruned DIR")
    t0 = time.time()
    full = LayerStream(model, dtype, placement)
    batches = [torch.tensor(windows[i:i + batch_size], dtype=torch.long) for i in range(0, len(windows), batch_size)]
    shapes = [tuple(b.shape) for b in batches]
    if plan is not None:
        plan = load_checked(plan, Plan, full.model)
    other = full if plan is not None else LayerStream(pruned, full.dtype, full.placement)
    ctl = RoutingController.of(other.model)
    # the full model's experts run through the same code in both modes (the controller, full router): a
    # --plan run and a --pruned run report the same full-model perplexity, bit for bit
    full_ctl = ctl if other is full else RoutingController.of(full.model)
    a, b = full.embed(batches), other.embed(batches)
    bar = tqdm(total=len(full.layers) * 2 * sum(x.numel() for x in batches), unit="tok", desc="held-out KL (streamed)",
               disable=not progress, file=sys.stderr, mininterval=2)
    tick = lambda i, j: bar.update(batches[j].numel())  # noqa: E731
    try:
        if other is full:   # one load per layer: full router, then the plan's mask
            for i in range(len(full.layers)):
                full.load_layer(i)
                for acts, pol in ((a, None), (b, plan.decode)):
                    with ctl.policy(pol):
                        full.forward_layer(i, acts, shapes, on_batch=tick)
                full.free_layer(i)
        else:
            full.run_layers(a, shapes, on_batch=tick)
            other.run_layers(b, shapes, on_batch=tick)
    finally:
        bar.close()
        ctl.remove()
        if full_ctl is not ctl:
            full_ctl.remove()
    kl_sum = nll_full = nll = 0.0
    n = 0
    for j, ids in enumerate(batches):
        lp_full = F.log_softmax(full.logits(a[j])[:, :-1], dim=-1)           # [B, S-1, V]
        lp = F.log_softmax(other.logits(b[j])[:, :-1], dim=-1)               # [B, S-1, V]
        target = ids[:, 1:, None]                                            # [B, S-1, 1]
        kl_sum += float((lp_full.exp() * (lp_full - lp)).sum())
        nll_full += float(-lp_full.gather(-1, target).sum())
        nll += float(-lp.gather(-1, target).sum())
        n += target.numel()
    full.close()
    other.close()
    return StreamedKL(kl=max(kl_sum / n, 0.0), perplexity_full=math.exp(nll_full / n), perplexity=math.exp(nll / n),
                      tokens=n, seconds=round(time.time() - t0, 2), peak_rss_gib=round(peak_rss_gib(), 2),
                      candidate=f"plan {plan.meta.get('criterion', '')}".strip() if plan is not None else str(pruned))
