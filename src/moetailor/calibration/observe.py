"""Calibration statistics from served traffic: the file ``moetailor calibrate`` writes, accumulated
while an engine serves (``moetailor serve --observe``, ``LLM(observe=...)``, the vLLM plugin's
``moetailor_observe``), so ``moetailor plan`` reads it unchanged.

The same ``Collector`` as calibration observes each MoE layer's input hidden [T, H] and router
logits, one engine step at a time; a step's additions are kept only when the step succeeds (a step
the engine runs again request by request is counted once). What counts:
  - every token the engine runs through the model, prefill and decode alike, each position of a
    request once (a preempted request's prefill again is not counted twice); a guard's full-pool
    shadow is not traffic and is left out (the engine says which rows count);
  - the full router's choices: where the step runs a plan or per-request budgets, the routes are
    recomputed from the step's logits under the full router (``RoutingController`` without a
    policy), so frequency, mass, EAN and REAP describe the model's router, as in calibration. The
    hidden states are the served model's, though: under a decode plan the layers before a layer
    ran the plan, so decode tokens' statistics describe the served routing's inputs, not the full
    model's (a full-router engine gives calibration's statistics on the same tokens, to float
    tolerance);
  - expert output norms (EAN, REAP) through the step's own experts path (``expert_outputs``: the
    native kernel where it runs, packed weights included), one extra expert pass over the routed
    tokens, computed only when observing.
``data_sha256``: sha256 of the counted token ids in the order the engine ran them (int64, as
calibration hashes its batches): equal to calibrate's where one request runs at a time and calibrate
runs each request's tokens as one batch.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import torch

from ..models.adapters import MoeLayer
from .calibrate import Collector, ExpertOutputs, stats_of
from .stats import ExpertStats

TRAFFIC = "served traffic"   # the statistics' data name: what `moetailor plan` records as the calibration data


def check_observe_path(path: str | Path, flag: str = "--observe", worker: bool = False) -> Path:
    """A one-line ValueError when statistics cannot be written at ``path`` (checked before a model loads):
    its folder missing or not writable, the path a folder, or a file already there (observed statistics
    are written anew, never appended to an older file), or another moetailor run observing into it."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; give a file path for the statistics, e.g. "
                         f"{flag} {path / 'observed.safetensors'}")
    if path.exists() or path.is_symlink():
        raise ValueError(f"{flag} {path} already exists; move it away or choose another {flag} path (observed "
                         "statistics start from zero and would replace it)")
    folder = path.absolute().parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist; create it or choose another {flag} path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: the folder {folder} is not writable; choose another {flag} path")
    from ..outputs import claim_output

    # a second server observing into the same file fails now, not at its first save; an engine's worker
    # (``worker``) shares the claim of the run that started it (moetailor's launcher claims first)
    claim_output(path, flag, shared_with_parents=worker)
    return path


class ObservedStats:
    """Accumulates a serving engine's routing into calibration statistics, step by step.

    ``begin(rows, ids)`` before a step's forward (``rows``: the [T] rows of the step's tokens to count,
    None = all; ``ids``: their token ids, None where the engine does not know them: no ``data_sha256``
    then), the engine calls the object with each MoE layer's (hidden, logits, weights, index) during the
    forward, ``commit()`` after it succeeded, ``discard()`` otherwise; ``save()`` any time (another
    thread may call it; writes are atomic).

    The engine gives what it knows of itself: ``layers`` (objects with ``index``, ``num_experts``,
    ``hidden_size`` and ``semantics``, as ``MoeLayer`` has), the model's ``fingerprint`` and ``dtype``,
    ``full_routes(layer, logits, weights, index)``: the full router's (weights, index) of a step's
    routes, and ``expert_outputs`` (None: no expert pass, and no EAN, REAP or output statistics; the
    file says so under ``observed.expert_outputs``).

    ``direct``: a step's sums go straight into the totals (no per-step copy to add or drop): for an
    engine whose failed step ends the engine (vLLM), where ``discard`` has nothing to undo and the
    file is written from the stepping thread only."""

    def __init__(self, layers: list, fingerprint: dict, dtype: str, path: str | Path, every: int = 0, *,
                 gate: str = "renorm", expert_outputs: ExpertOutputs | None = None, full_routes=None,
                 source: str = "engine", command: str | None = None, outputs_note: str | None = None,
                 direct: bool = False):
        if every < 0:
            raise ValueError(f"observe every {every} steps: give 0 (at shutdown and on demand only) or a positive "
                             "step count")
        self.path, self.every, self.gate = Path(path), int(every), gate
        self.layers, self.direct = layers, direct
        self.expert_outputs = expert_outputs
        self.full_routes = full_routes or (lambda layer, logits, weights, index: (weights, index))
        self.fingerprint = fingerprint
        observed = {"engine": source, "phases": "prefill and decode", "routes": "the full router's",
                    "expert_outputs": outputs_note or ("the step's experts implementation" if expert_outputs
                                                       else "none: no EAN, REAP or output statistics")}
        self.meta = {"dtype": dtype, "data": TRAFFIC, "command": command, "observed": observed}
        self.totals = Collector(self.layers, gate, expert_outputs=expert_outputs, outputs=expert_outputs is not None)
        self.tokens = self.steps = 0
        self.phase_tokens = {"prefill": 0, "decode": 0}
        self.digest = hashlib.sha256()
        self.hashed = True                  # every counted step gave its token ids
        self.t0 = time.time()
        self.lock = threading.Lock()        # totals, counters and digest
        self.write_lock = threading.Lock()  # one writer at a time: an older snapshot never replaces a newer one
        self._step: Collector | None = None
        self._rows: torch.Tensor | None = None
        self._ids: list[int] | None = []
        self._count = self._decode = 0
        self.on_close: list = []

    def close(self) -> dict:
        """Stop observing and write the statistics."""
        for fn in self.on_close:
            fn(self)
        return self.save()

    # ---- one step ------------------------------------------------------------------------------
    def begin(self, rows: list[int] | None, ids: list[int] | None, is_prefill: bool, count: int | None = None,
              decode_tokens: int | None = None) -> None:
        """A step starts: ``count`` tokens to count (default ``len(ids)``), counted as prefill tokens when
        ``is_prefill``, else as decode tokens, or ``decode_tokens`` of them as decode tokens where a step
        mixes the phases (vLLM)."""
        self._step = self.totals if self.direct else Collector(
            self.layers, self.gate, expert_outputs=self.expert_outputs, outputs=self.expert_outputs is not None)
        self._rows = torch.tensor(rows, dtype=torch.long) if rows is not None else None
        self._ids = ids
        self._count = len(ids) if count is None else int(count)
        self._decode = (0 if is_prefill else self._count) if decode_tokens is None else int(decode_tokens)

    def __call__(self, layer: MoeLayer, hidden: torch.Tensor, logits: torch.Tensor, weights: torch.Tensor,
                 index: torch.Tensor) -> None:
        if self._step is None:        # a forward outside an observed step (a probe, a warm-up)
            return
        weights, index = self.full_routes(layer, logits, weights, index)
        if self._rows is not None:
            rows = self._rows.to(hidden.device)
            hidden, logits, weights, index = hidden[rows], logits[rows], weights[rows], index[rows]
        if hidden.shape[0]:
            self._step(layer, hidden, logits, weights, index)

    def commit(self) -> None:
        step, self._step = self._step, None
        if step is None:
            return
        with self.lock:
            for i, st in ({} if self.direct else step.stats).items():
                total = self.totals.stats[i]
                for name, t in st.tensors().items():
                    if name == "out_max":       # a running maximum, not a sum
                        torch.maximum(total.out_max, t, out=total.out_max)
                    else:
                        getattr(total, name).add_(t)
            self.tokens += self._count
            self.phase_tokens["decode"] += self._decode
            self.phase_tokens["prefill"] += self._count - self._decode
            if self._ids is None:
                self.hashed = False
            else:
                self.digest.update(torch.tensor(self._ids, dtype=torch.long).numpy().astype("<i8").tobytes())
            self.steps += 1
            due = self.every and self.steps % self.every == 0
        if due:
            self.save()

    def discard(self) -> None:
        self._step = None

    # ---- the file ------------------------------------------------------------------------------
    def snapshot(self) -> ExpertStats:
        """The statistics so far, as ``moetailor calibrate`` would write them."""
        with self.lock:
            copy = Collector(self.layers, self.gate, outputs=self.expert_outputs is not None)
            for i, st in self.totals.stats.items():
                for name, t in st.tensors().items():
                    getattr(copy.stats[i], name).copy_(t)
            meta = {**self.meta, "data_sha256": self.digest.hexdigest()[:16] if self.hashed else None,
                    "observed": {**self.meta["observed"], "steps": self.steps, **{f"{p}_tokens": n for p, n
                                                                                  in self.phase_tokens.items()}}}
            tokens = self.tokens
        return stats_of(copy, self.fingerprint, tokens, False, self.t0, meta)

    def save(self, path: str | Path | None = None) -> dict:
        """Write the statistics so far (temp file + rename: a crash never leaves half a file); returns
        the metadata written."""
        with self.write_lock:
            stats = self.snapshot()
            stats.save(path or self.path)
        return stats.meta

