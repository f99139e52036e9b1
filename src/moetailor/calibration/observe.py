"""Calibration statistics from served traffic: the file ``moetailor calibrate`` writes, accumulated
while an engine serves (``moetailor serve --observe``, ``LLM(observe=...)``, the vLLM plugin's
``moetailor_observe``), so ``moetailor plan`` reads it unchanged. What counts (tokens, the full
router's routes, EAN / REAP, ``data_sha256``): docs/plans.md, "Statistics from served traffic".

The same ``Collector`` as calibration observes each MoE layer's input hidden [T, H] and router
logits, one engine step at a time; a step's additions are kept only when the step succeeds. An
engine that traces or captures its step (vLLM) keeps the same sums on its device instead
(``LayerSums``), read only when the file is written.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import numpy as np
import torch

from ..models.adapters import MoeLayer
from .calibrate import Collector, ExpertOutputs, stats_of
from .stats import BETA_BINS, ExpertStats

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


class LayerSums:
    """One MoE layer's calibration sums kept on the engine's device and added to by tensor operations
    only (no host read, no branch on a step's values, buffers allocated once), so that an engine which
    traces or captures its step (vLLM) adds a step's statistics inside the step; the sums join
    ``ObservedStats``' totals only when the file is written (``take``).

    The statistics are ``Collector``'s, to float rounding: per counted token, the full router's routes
    give frequency, mass (the ``renorm`` or ``softmax`` gate), co-selection and beta (``add_routes``);
    with ``hidden_size``, the experts kernel adds each counted route's output y before its weight (sum y,
    sum ||y||^2, max |y_i|, EAN, weighted EAN: ``swiglu_experts_observed``) from the routes and gates
    ``add_routes`` leaves in ``routes`` / ``gates``. ``native``: the one-call CPU op (``kernels.observe_routes``)
    instead of the torch form below; both fill the same layout (``kernels/observe.cpp``)."""

    def __init__(self, num_experts: int, top_k: int, max_tokens: int, device, *, sigmoid: bool = False,
                 gate: str = "renorm", hidden_size: int | None = None, native: bool = False):
        if native:
            from .. import kernels

            if kernels.observe_routes() is None:     # loads the ops (torch.ops.moetailor.*)
                raise RuntimeError("moetailor's native kernels did not build here: observe with native=False")
        E, B = num_experts, BETA_BINS
        self.num_experts, self.sigmoid, self.renorm, self.native = E, sigmoid, gate == "renorm", native
        f64 = dict(dtype=torch.float64, device=device)
        # frequency [E+1] | mass [E+1] | co-selection [(E+1)^2] | beta [B+1] | tokens, decode tokens, steps;
        # slot E (B) takes the routes (tokens) not counted, so the torch form needs no mask of its values
        self.sums = torch.zeros(2 * (E + 1) + (E + 1) ** 2 + B + 1 + 3, **f64)
        self.routes = torch.full((max_tokens, top_k), E, dtype=torch.long, device=device)   # [N, K] counted routes
        self.gates = torch.zeros(max_tokens, top_k, dtype=torch.float32, device=device)      # [N, K] their gates
        self.outputs = torch.zeros(E, hidden_size + 4, **f64) if hidden_size else None        # [E, H + 4]
        # weights / index [0, 0]: the native op selects a softmax router's routes itself (add_logits)
        self._select = (torch.empty(0, 0, device=device), torch.empty(0, 0, dtype=torch.long, device=device))
        self._ones = None if native else torch.ones(max_tokens * top_k * top_k, **f64)   # the torch form's counts

    def _views(self) -> dict[str, torch.Tensor]:
        E, B = self.num_experts, BETA_BINS
        s = self.sums
        cos0 = 2 * (E + 1)
        beta0 = cos0 + (E + 1) ** 2
        return {"frequency": s[:E + 1], "mass": s[E + 1:cos0], "coselect": s[cos0:beta0].view(E + 1, E + 1),
                "beta_hist": s[beta0:beta0 + B + 1], "counts": s[beta0 + B + 1:]}

    def add_routes(self, logits: torch.Tensor, weights: torch.Tensor, index: torch.Tensor, live: torch.Tensor,
                   decode: torch.Tensor, armed: torch.Tensor, slot: int) -> None:
        """One step's full-router routes of this layer: logits [T, E], weights / index [T, K] (index E:
        dropped); rows where ``live`` [T] is set are counted, ``decode`` [T] of them as decode tokens,
        and only while ``armed[slot]`` is set (it is cleared: a layer counts once per step)."""
        logits, weights = logits.float().contiguous(), weights.float().contiguous()
        T, K = index.shape
        if self.native:
            torch.ops.moetailor.observe_routes(logits, weights, index.contiguous(), live[:T].contiguous(),
                                               decode[:T].contiguous(), armed, slot, self.sigmoid, self.renorm,
                                               BETA_BINS, self.sums, self.routes, self.gates)
            return
        E, v = self.num_experts, self._views()
        on = armed[slot] != 0                                                  # [] this step counts here
        counted = live[:T] & on                                                # [T]
        valid = (index < E) & counted[:, None]                                 # [T, K]
        routes = torch.where(valid, index, E)                                  # [T, K]
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(-1)      # [T, E]
        g = scores.gather(1, index.clamp_max(E - 1)) * valid                  # [T, K]
        if self.renorm:
            g = g / g.sum(-1, keepdim=True).clamp_min(1e-20)
        flat = routes.reshape(-1)                                              # [T*K]
        v["frequency"].index_add_(0, flat, self._ones[:flat.numel()])
        v["mass"].index_add_(0, flat, g.reshape(-1).double())
        pairs = (routes[:, :, None] * (E + 1) + routes[:, None, :]).reshape(-1)  # [T*K*K]
        v["coselect"].view(-1).index_add_(0, pairs, self._ones[:pairs.numel()])
        if K >= 2:
            top2 = weights.masked_fill(~valid, 0.0).topk(2, dim=-1).values    # [T, 2]
            ratio = top2[:, 1] / top2[:, 0].clamp_min(1e-20)
            bins = (ratio * BETA_BINS).long().clamp(0, BETA_BINS - 1)
            v["beta_hist"].index_add_(0, torch.where(top2[:, 0] > 0, bins, BETA_BINS), self._ones[:T])
        v["counts"].add_(torch.stack([counted.sum(), (counted & decode[:T]).sum(), on.long()]).double())
        armed[slot] = 0
        self.routes[:T] = routes
        self.gates[:T] = g

    def add_logits(self, logits: torch.Tensor, live: torch.Tensor, decode: torch.Tensor, armed: torch.Tensor,
                   slot: int) -> None:
        """``add_routes`` of a softmax router's full routes, selected by the native op itself from the
        logits [T, E] (the top k logits; no softmax over every expert, no routes op before it); live /
        decode [>=T]."""
        if not self.native or self.sigmoid:
            raise RuntimeError("LayerSums.add_logits is the native op's, for softmax routers: call add_routes")
        torch.ops.moetailor.observe_routes(logits.float().contiguous(), self._select[0], self._select[1], live, decode,
                                           armed, slot, False, self.renorm, BETA_BINS, self.sums, self.routes, self.gates)

    def take(self) -> tuple[dict[str, torch.Tensor], tuple[int, int, int]]:
        """The sums since the last ``take`` as ``LayerStats`` tensors (float64, on the CPU) and (tokens,
        decode tokens, steps) counted; the buffers start again from zero. Reads the device: call it
        between steps (when the file is written), not inside one."""
        E = self.num_experts
        v = {name: t.cpu() for name, t in self._views().items()}
        tensors = {"frequency": v["frequency"][:E].clone(), "mass": v["mass"][:E].clone(),
                   "coselect": v["coselect"][:E, :E].clone(), "beta_hist": v["beta_hist"][:BETA_BINS].clone()}
        if self.outputs is not None:
            out = self.outputs.cpu()
            H = out.shape[1] - 4
            tensors.update(out_sum=out[:, :H].clone(), out_sq=out[:, H].clone(), out_max=out[:, H + 1].clone(),
                           ean=out[:, H + 2].clone(), weighted_ean=out[:, H + 3].clone())
            self.outputs.zero_()
        tokens, decode, steps = (int(c) for c in v["counts"].tolist())
        self.sums.zero_()
        return tensors, (tokens, decode, steps)


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

    ``sums``: the engine adds each layer's statistics itself, on its device (``LayerSums`` by layer
    index; vLLM, whose failed step ends the engine and which writes the file from its stepping thread
    only); the object is then not called per layer, ``begin``/``commit`` report the steps (their token
    ids' hash) and the sums join the totals when the file is written. Where the sums' own token and
    step counts differ from the reported ones, they stand and the file carries no ``data_sha256``."""

    def __init__(self, layers: list, fingerprint: dict, dtype: str, path: str | Path, every: int = 0, *,
                 gate: str = "renorm", expert_outputs: ExpertOutputs | None = None, full_routes=None,
                 source: str = "engine", command: str | None = None, outputs_note: str | None = None,
                 sums: dict[int, LayerSums] | None = None):
        if every < 0:
            raise ValueError(f"observe every {every} steps: give 0 (at shutdown and on demand only) or a positive "
                             "step count")
        self.path, self.every, self.gate = Path(path), int(every), gate
        self.layers, self.sums = layers, sums
        self.expert_outputs = expert_outputs
        outputs = expert_outputs is not None or any(s.outputs is not None for s in (sums or {}).values())
        self.full_routes = full_routes or (lambda layer, logits, weights, index: (weights, index))
        self.fingerprint = fingerprint
        observed = {"engine": source, "phases": "prefill and decode", "routes": "the full router's",
                    "expert_outputs": outputs_note or ("the step's experts implementation" if outputs
                                                       else "none: no EAN, REAP or output statistics")}
        self.meta = {"dtype": dtype, "data": TRAFFIC, "command": command, "observed": observed}
        self.outputs = outputs
        self.totals = Collector(self.layers, gate, expert_outputs=expert_outputs, outputs=outputs)
        self.tokens = self.steps = 0
        self.phase_tokens = {"prefill": 0, "decode": 0}
        self.counted = (0, 0, 0)            # (tokens, decode tokens, steps) the engine's ``sums`` counted
        self.digest = hashlib.sha256()
        self.hashed = True                  # every counted step gave its token ids
        self.t0 = time.time()
        self.lock = threading.Lock()        # totals, counters and digest
        self.write_lock = threading.Lock()  # one writer at a time: an older snapshot never replaces a newer one
        self._step: Collector | None = None
        self._rows: torch.Tensor | None = None
        self._ids: list[int] | np.ndarray | None = []
        self._count = self._decode = 0
        self.on_close: list = []

    def close(self) -> dict:
        """Stop observing and write the statistics."""
        for fn in self.on_close:
            fn(self)
        return self.save()

    def begin(self, rows: list[int] | None, ids: list[int] | np.ndarray | None, is_prefill: bool,
              count: int | None = None, decode_tokens: int | None = None) -> None:
        """A step starts: ``count`` tokens to count (default ``len(ids)``), counted as prefill tokens when
        ``is_prefill``, else as decode tokens, or ``decode_tokens`` of them as decode tokens where a step
        mixes the phases (vLLM)."""
        self._step = self.totals if self.sums is not None else Collector(
            self.layers, self.gate, expert_outputs=self.expert_outputs, outputs=self.outputs)
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
            if self.sums is None:
                self._add({i: st.tensors() for i, st in step.stats.items()})
            self.tokens += self._count
            self.phase_tokens["decode"] += self._decode
            self.phase_tokens["prefill"] += self._count - self._decode
            if self._ids is None:
                self.hashed = False
            else:
                self.digest.update(np.asarray(self._ids, dtype="<i8").tobytes())
            self.steps += 1
            due = self.every and self.steps % self.every == 0
        if due:
            self.save()

    def discard(self) -> None:
        self._step = None

    def _add(self, sums: dict[int, dict[str, torch.Tensor]]) -> None:
        """Per-layer sums into the totals (under ``lock``)."""
        for i, tensors in sums.items():
            total = self.totals.stats[i]
            for name, t in tensors.items():
                if name == "out_max":       # a running maximum, not a sum
                    torch.maximum(total.out_max, t, out=total.out_max)
                else:
                    getattr(total, name).add_(t)

    def _fold_sums(self) -> None:
        """The engine's device sums since the last fold into the totals (under ``lock``); its counts
        stand where the reported steps differ from them."""
        counts = None
        for i, layer_sums in self.sums.items():
            tensors, counts = layer_sums.take()
            self._add({i: tensors})
        if counts is None:
            return
        self.counted = tuple(a + b for a, b in zip(self.counted, counts))
        tokens, decode, steps = self.counted
        if (tokens, decode, steps) != (self.tokens, self.phase_tokens["decode"], self.steps):
            self.tokens, self.steps, self.hashed = tokens, steps, False
            self.phase_tokens = {"prefill": tokens - decode, "decode": decode}

    def snapshot(self) -> ExpertStats:
        """The statistics so far, as ``moetailor calibrate`` would write them."""
        with self.lock:
            if self.sums:
                self._fold_sums()
            copy = Collector(self.layers, self.gate, outputs=self.outputs)
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

