"""Gate-only fine-tuning of a split model: train the router rows against the ORIGINAL model's next-token
distribution (mean per-token KL(original || split)), everything else frozen. Each step runs one budget
from a cycle (a quarter, half, three quarters and all of N*k sub-experts, via ``token_top_k``), so the
learned order of sub-experts holds when a request asks for fewer; gradients reach the router through
the selected routing weights.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.adapters import moe_layers


def budget_cycle(full_k: int) -> list[int]:
    """Budgets the fine-tuning cycles through: k/4, k/2, 3k/4 and k (distinct, at least 1)."""
    return sorted({max(1, round(full_k * f)) for f in (0.25, 0.5, 0.75, 1.0)})


def finetune_router(original, split, batches: list[torch.Tensor], steps: int = 60, lr: float = 1e-3,
                    budgets: list[int] | None = None, progress: bool = True) -> dict:
    """Train ``split``'s router weights in place to match ``original``; returns a small summary
    (first/last loss, budgets, steps)."""
    from tqdm import tqdm

    from ..routing import RoutingController

    if not batches:
        raise ValueError("gate fine-tuning needs calibration batches; raise --tokens")
    ctl = RoutingController.of(split)
    routers = [layer.router.weight for layer in moe_layers(split)]
    split.requires_grad_(False)
    for w in routers:
        w.requires_grad_(True)
    full_k = moe_layers(split)[0].top_k
    budgets = budgets or budget_cycle(full_k)
    opt = torch.optim.Adam(routers, lr=lr, betas=(0.9, 0.95))
    device = next(split.parameters()).device
    losses = []
    bar = tqdm(range(steps), desc="fine-tune router", unit="step", disable=not progress)
    for step in bar:
        ids = batches[step % len(batches)].to(device)                               # [B, S]
        k = budgets[step % len(budgets)]
        with torch.no_grad():
            target = F.log_softmax(original(input_ids=ids, use_cache=False).logits.float(), dim=-1)  # [B, S, V]
        token_k = torch.full((ids.numel(),), k, dtype=torch.long, device=device)
        with torch.enable_grad(), ctl.policy(None, token_top_k=token_k):
            logp = F.log_softmax(split(input_ids=ids, use_cache=False).logits.float(), dim=-1)
            loss = (target.exp() * (target - logp)).sum(-1).mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(routers, 1.0)
            opt.step()
        losses.append(float(loss))
        bar.set_postfix(kl=f"{losses[-1]:.4f}", k=k)
    for w in routers:
        w.requires_grad_(False)
    head = sum(losses[:len(budgets)]) / max(1, min(len(losses), len(budgets)))
    tail = sum(losses[-len(budgets):]) / max(1, min(len(losses), len(budgets)))
    return {"steps": steps, "lr": lr, "budgets": budgets, "kl_first_cycle": head, "kl_last_cycle": tail}
