"""The engine's side of observing served traffic (``LLM(observe=...)``, ``moetailor serve --observe``):
which rows of a step are traffic, and the experts' outputs through the step's own experts path.
The statistics themselves are calibration's (``calibration.observe.ObservedStats``)."""
from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from ..calibration.observe import ObservedStats
from ..models.adapters import MoeLayer
from ..runtime.step import current
from .guard import is_shadow
from .scheduler import Sequence


def step_expert_outputs(layer: MoeLayer, hidden: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """E_j(x) [S, H] for rows routed to one expert each, through the implementation the step runs
    (the native kernel, packed weights included, else grouped GEMMs): each row routed once, weight 1."""
    from ..runtime.experts import experts_forward

    ones = torch.ones(hidden.shape[0], 1, dtype=torch.float32, device=hidden.device)   # [S, 1]
    return experts_forward(layer.experts, hidden, experts[:, None], ones.to(hidden.dtype))


def full_routes(controller, layer: MoeLayer, logits: torch.Tensor, weights: torch.Tensor, index: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The full router's (weights, index) [T, K] for a step's logits: the step's own where it ran the
    full router at the layer's k, else recomputed under the full router."""
    step = current()
    routing = step.routing if step is not None else None
    if routing is None or (routing.policy.get(layer.index) is None and routing.token_top_k is None):
        return weights, index
    return controller.apply_policy(layer, logits, None, None, None, None)


def engine_observer(model, controller, path: str | Path, every: int = 0, command: str | None = None) -> ObservedStats:
    """Statistics of the engine's traffic: an observer of ``controller`` until it is closed."""
    from ..models.loading import model_fingerprint

    observer = ObservedStats(controller.layers, model_fingerprint(model),
                             str(next(model.parameters()).dtype).replace("torch.", ""), path, every,
                             expert_outputs=step_expert_outputs, full_routes=partial(full_routes, controller),
                             source="moetailor", command=command)
    controller.observers.append(observer)
    observer.on_close.append(lambda o: o in controller.observers and controller.observers.remove(o))
    return observer


def traffic_rows(seqs: list[Sequence], is_prefill: bool) -> tuple[list[int] | None, list[int], list[tuple[Sequence, int]]]:
    """(rows of the step's tokens to count, None = all; their token ids; (sequence, positions counted
    once the step succeeds)): each position of a request once, shadows never."""
    rows: list[int] = []
    ids: list[int] = []
    seen: list[tuple[Sequence, int]] = []
    r = 0
    for seq in seqs:
        n = len(seq) if is_prefill else 1                 # a prefill step runs every position, a decode step the last
        first = len(seq) - n
        if not is_shadow(seq):
            done = getattr(seq, "observed_tokens", 0)      # a preempted request's prefill again: counted before
            for p in range(max(first, done), len(seq)):
                rows.append(r + p - first)
                ids.append(seq.token_ids[p])
            seen.append((seq, len(seq)))
        r += n
    return (None if len(rows) == r else rows), ids, seen


@contextmanager
def observed_step(observer: ObservedStats | None, seqs: list[Sequence], is_prefill: bool):
    """Count the step's traffic if the block succeeds; nothing if it raises."""
    if observer is None:
        yield
        return
    rows, ids, seen = traffic_rows(seqs, is_prefill)
    observer.begin(rows, ids, is_prefill)
    try:
        yield
    except BaseException:
        observer.discard()
        raise
    observer.commit()
    for seq, n in seen:
        seq.observed_tokens = n
