"""MoE-Prism's k-aware scheduler as a vLLM scheduler class (``SchedulerConfig.scheduler_cls``).

Requests carry a budget (``expert_top_k`` in ``SamplingParams.extra_args``; none = the model's k).
A step that mixes budgets touches the union of its requests' experts, so which requests share a
step decides its cost. ``KAwareScheduler`` subclasses vLLM's v1 ``Scheduler`` and keeps vLLM's
scheduling (token budget, chunked prefill, preemption, KV connectors) with two changes, both driven
by moetailor's pure-data policies in ``routing/k_tiers.py``:

  * ``lanes`` (online): before each step, ``OnlineLanes.next_batch`` picks one lane of the running
    decode requests (low k / high k, adaptive boundary, bounded wait); the others sit this step out
    (they keep their KV blocks and their place in ``running``; vLLM's own skip rule
    ``next_decode_eligible_step``, used by its pipeline-parallel and diffusion schedulers, holds them).
    Requests still in prefill always run.
  * ``tiers`` (admission): the waiting queue is ordered by ``plan_offline``: requests grouped by
    budget into batches of ``max_num_seqs`` (a residual tier merges upward when the cost model
    says so), batches in order of their oldest member, so a step's newcomers share a tier.
    Preempted requests keep their place at the front.

Settings, through ``additional_config`` (they reach the engine-core process):

    {"moetailor_k_schedule": "lanes" | "tiers" | "tiers+lanes" | "fifo",   # default "lanes"
     "moetailor_k_cost": {"per_expert": s, "per_route": s, "per_token": s, "fixed": s},  # optional
     "moetailor_k_measure": true,                                           # default true
     "moetailor_schedule_log": "steps.jsonl"}                               # optional

With ``moetailor_k_measure`` (the default) the lanes are kept only while they decode faster than one
joint step of every running request, measured on the clock (``k_tiers.MeasuredChoice``: each
all-decode step is timed from ``schedule`` to ``update_from_output``, which run in turn on the CPU
backend); false keeps the lanes whatever they cost.

"fifo" keeps vLLM's order (the baseline, with the step log). Without ``moetailor_k_cost`` the cost
model is ``StepCost``'s first estimate from the checkpoint's shapes (moetailor's engine fits one
with ``LLM.fit_k_cost`` and its coefficients can be passed here). A request never runs at FEWER
experts than it asked for: the scheduler only chooses when a request runs, each token still routes
at its own budget. vLLM warns that a custom scheduler class disables async scheduling; the CPU
backend runs without it anyway.
"""
from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from ...routing.k_tiers import KRequest, MeasuredChoice, OnlineLanes, StepCost, plan_offline
from ...tables import unknown_choice
from .plan import request_top_k

SCHEDULER_CLS = "moetailor.integrations.vllm.scheduler.KAwareScheduler"
SCHEDULE_KEY = "moetailor_k_schedule"
COST_KEY = "moetailor_k_cost"
LOG_KEY = "moetailor_schedule_log"
MEASURE_KEY = "moetailor_k_measure"
MODES = ("lanes", "tiers", "tiers+lanes", "fifo")


def scheduler_kwargs(schedule: str = "lanes", cost: dict | None = None, log: str | None = None,
                     additional_config: dict | None = None, measure: bool = True) -> dict:
    """``vllm.LLM`` / ``vllm serve`` arguments that select the k-aware scheduler."""
    if schedule not in MODES:
        raise ValueError(unknown_choice("k schedule", schedule, MODES))
    extra = {**(additional_config or {}), SCHEDULE_KEY: schedule, MEASURE_KEY: bool(measure)}
    if cost:
        extra[COST_KEY] = dict(cost)
    if log:
        extra[LOG_KEY] = str(log)
    return {"scheduler_cls": SCHEDULER_CLS, "additional_config": extra}


def cost_from_config(hf_config, dtype_bytes: int, overrides: dict | None = None) -> StepCost:
    """``StepCost.for_model``'s first estimate from config shapes (no model in the scheduler's process)."""
    from ...models.architectures import arch_spec

    experts = arch_spec(hf_config).num_experts(hf_config)
    width = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
    layers = hf_config.num_hidden_layers - len(getattr(hf_config, "mlp_only_layers", None) or ()) \
        - int(getattr(hf_config, "first_k_dense_replace", 0) or 0)
    expert_bytes = 3 * hf_config.hidden_size * width * dtype_bytes
    base = StepCost.from_bandwidth(layers, experts, expert_bytes, 20e9, 3e-5, per_token=2e-4, fixed=2e-3)
    if overrides:
        unknown = set(overrides) - {"per_expert", "per_route", "per_token", "fixed"}
        if unknown:
            raise ValueError(f"{COST_KEY} has unknown fields {sorted(unknown)}; give per_expert, per_route, "
                             f"per_token, fixed (seconds)")
        base = replace(base, **overrides)
    return base


class KAwareScheduler(Scheduler):
    def __init__(self, vllm_config, *args, **kwargs):
        super().__init__(vllm_config, *args, **kwargs)
        extra = vllm_config.additional_config or {}
        self.k_schedule = extra.get(SCHEDULE_KEY, "lanes")
        if self.k_schedule not in MODES:
            raise ValueError(unknown_choice(f"additional_config {SCHEDULE_KEY}", self.k_schedule, MODES))
        hf = vllm_config.model_config.hf_config
        self.model_k = int(getattr(hf, "num_experts_per_tok", 0) or 0)
        if not self.model_k:
            raise ValueError("the k-aware scheduler needs a Mixture-of-Experts model (num_experts_per_tok in config)")
        dtype_bytes = vllm_config.model_config.dtype.itemsize
        self.k_cost = cost_from_config(hf, dtype_bytes, extra.get(COST_KEY))
        self.lanes = OnlineLanes(self.k_cost, max_batch=self.max_num_running_reqs) \
            if "lanes" in self.k_schedule else None
        self.choice = MeasuredChoice() if self.lanes is not None and extra.get(MEASURE_KEY, True) else None
        self._timing: tuple[float, int] | None = None   # (start, decode tokens) of an all-decode step
        self._ordered: set[str] = set()     # waiting requests already placed by the tier order
        log = extra.get(LOG_KEY)
        self._log = open(log, "a", buffering=1) if log else None

    def _k(self, request) -> int:
        return request_top_k(request.sampling_params, self.model_k)

    # ---- admission: tiers ----------------------------------------------------------------------
    def _order_waiting(self) -> None:
        from vllm.v1.core.sched.request_queue import FCFSRequestQueue

        queue = self.waiting
        if not isinstance(queue, FCFSRequestQueue):   # a priority queue: vLLM's priorities win
            return
        fresh = [r for r in queue if r.num_computed_tokens == 0 and r.request_id not in self._ordered]
        if not fresh:
            return
        pinned = [r for r in queue if r.num_computed_tokens > 0]     # preempted: keep them first
        pool = [r for r in queue if r.num_computed_tokens == 0]
        by_id = {r.request_id: r for r in pool}
        batches = plan_offline([KRequest(r.request_id, self._k(r), r.arrival_time) for r in pool],
                               self.max_num_running_reqs, self.k_cost)
        queue.clear()
        queue.extend(pinned + [by_id[i] for b in batches for i in b.request_ids])
        self._ordered.update(by_id)

    # ---- decode: lanes -------------------------------------------------------------------------
    def _hold_lanes(self) -> list:
        """Mark the running decode requests outside this step's lane as ineligible; returns them."""
        decoding = [r for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens]
        if not decoding or (self.choice is not None and self.choice.mode == "joint"):
            return []
        batch = self.lanes.next_batch([KRequest(r.request_id, self._k(r), r.arrival_time) for r in decoding])
        chosen = set(batch.request_ids)
        held = []
        for r in decoding:
            if r.request_id in chosen:
                r.next_decode_eligible_step = 0
            else:   # schedule() first increments current_step, then skips r while current_step < this
                r.next_decode_eligible_step = self.current_step + 2
                held.append(r)
        return held

    def schedule(self, *args, **kwargs):
        if "tiers" in self.k_schedule:
            self._order_waiting()
        held = self._hold_lanes() if self.lanes is not None else []
        waiting = [self._k(r) for r in self.waiting] if self._log is not None else []
        output = super().schedule(*args, **kwargs)
        for r in held:
            r.next_decode_eligible_step = 0
        if self._log is not None:
            self._write_step(output, held, waiting)
        if self.choice is not None:
            self._timing = self._decode_only(output)
        return output

    def _decode_only(self, output) -> tuple[float, int] | None:
        """(now, tokens) when every token of the step is a decode token, else None (a step with prompt
        tokens says nothing about how the lanes decode)."""
        steps = output.num_scheduled_tokens
        for rid, n in steps.items():
            r = self.requests.get(rid)
            # schedule() has already added this step's tokens to num_computed_tokens
            if r is None or n != 1 or r.num_computed_tokens - n < r.num_prompt_tokens:
                return None
        return (time.perf_counter(), len(steps)) if steps else None

    def update_from_output(self, scheduler_output, model_runner_output):
        if self._timing is not None:
            start, tokens = self._timing
            self._timing = None
            self.choice.record(tokens, time.perf_counter() - start)
        return super().update_from_output(scheduler_output, model_runner_output)

    def _write_step(self, output, held, waiting) -> None:
        requests = self.requests
        steps = output.num_scheduled_tokens
        rows = []
        for rid, n in steps.items():
            r = requests.get(rid)
            if r is None:
                continue
            # schedule() has already added this step's tokens to num_computed_tokens
            phase = "decode" if r.num_computed_tokens - n >= r.num_prompt_tokens else "prefill"
            rows.append([rid, self._k(r), phase, n])
        record: dict[str, Any] = {"step": self.current_step, "scheduled": rows,
                                  "held": [[r.request_id, self._k(r)] for r in held],
                                  "waiting": waiting,     # budgets of the waiting queue, in order, before the step
                                  "boundary": None if self.lanes is None else self.lanes.boundary,
                                  "mode": None if self.choice is None else self.choice.mode}
        self._log.write(json.dumps(record) + "\n")

    def _free_request(self, request, *args, **kwargs):   # every finished or aborted request passes here
        self._ordered.discard(request.request_id)
        if self.lanes is not None:
            self.lanes.forget(request.request_id)
        return super()._free_request(request, *args, **kwargs)

    def shutdown(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        super().shutdown()
