"""The offline engine: ``LLM(model, plan).generate(prompts, SamplingParams)``.

Each step is all-prefill or all-decode (see ``Scheduler``), so the step's phase selects the expert
policy: prefill steps run ``plan.prefill``, decode steps ``plan.decode`` (None = the full router).
What else decides a step lives beside it: per-request expert budgets in ``budgets.py``, decode pools
that follow the load in ``load_pools.py``, the collapse guard in ``guard.py``; ``disagg.py`` runs two
engines as prefill and decode workers.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import torch

from ..models.loading import load_checked
from ..plans.plan import Plan
from ..routing.budgets import BudgetPolicy
from ..routing.controller import RoutingController
from ..routing.policy import FULL_PHASE, PhasePolicy
from ..routing.traffic import StepCost
from ..runtime.config import EngineConfig
from ..runtime.runner import ModelRunner, StepOutput
from ..runtime.step import Routing
from .guard import Abort, Action, Guard, GuardConfig, RunOn
from .load_pools import PoolsByLoad
from .logprobs import record_logprobs, take_prompt_logprobs
from .observe import observed_step
from .sampling import NonFiniteLogits, SamplingParams, per_prompt, sample
from .outputs import RequestOutput, StreamDelta, delta
from .scheduler import BlockManager, Scheduler, Sequence
from .validation import RequestLimits, check_request, encode_prompt

log = logging.getLogger("moetailor.serving")


@dataclass
class StepRecord:
    phase: str                          # "prefill" | "decode"
    num_seqs: int
    num_tokens: int
    seconds: float
    distinct_experts: dict[int, int]    # MoE layer -> distinct experts read this step
    expert_bytes: int                   # expert weight bytes read this step
    mean_k: float = 0.0                 # mean experts per token this step (per-request budgets)
    pool_size: int | None = None        # decode pool by load: experts per layer the step's pool keeps


def eos_token_ids(model, tokenizer) -> set[int]:
    """The ids an engine stops on: the generation config's, the model config's and the tokenizer's EOS."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            ids.update([value] if isinstance(value, int) else value)
    return ids


class LLM:
    """Continuous-batching engine over a transformers MoE model with a paged KV cache."""

    def __init__(self, model, plan: Plan | str | Path | None = None, *, tokenizer=None,
                 guard: GuardConfig | bool | None = None, k_cost: StepCost | None = None,
                 decode_pools: PoolsByLoad | None = None, step_log_size: int = 10_000,
                 observe: str | Path | None = None, observe_every: int = 0, **options):
        """``model``: a checkpoint folder, a bundled name or a loaded model (which keeps its own dtype);
        ``options``: the fields of ``EngineConfig`` (max_num_seqs, block_size, dtype, device, ...);
        ``observe``: write the served traffic's calibration statistics there (``calibration.observe``)."""
        from ..calibration.observe import check_observe_path
        from ..models.loading import load_model, load_tokenizer

        config = EngineConfig.of(options)   # an unknown or bad option fails here, before the model loads
        if observe is not None:   # a path that cannot be written fails before the model loads
            check_observe_path(observe, "observe")
            if observe_every < 0:
                raise ValueError(f"observe_every={observe_every} must be >= 0 (0: write at close and on demand only)")
        owns_model = isinstance(model, (str, Path))   # then the runner may pack its experts in place
        if owns_model:
            name = model
            model = load_model(name, dtype=config.dtype, device=config.device)
            if tokenizer is None:
                try:
                    tokenizer = load_tokenizer(name)
                except Exception:   # no tokenizer files: token-id prompts only
                    tokenizer = None
        else:
            first = next(model.parameters())
            config.dtype, config.device = first.dtype, str(first.device)   # a given model keeps its dtype and device
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config
        self.runner = ModelRunner(self.model, RoutingController.of(self.model), self.config, owns_model)
        self.controller = self.runner.controller
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size)
        self.budgets = BudgetPolicy.of(self.model, config.k_schedule, k_cost, config.max_num_seqs, self.runner.device)
        self.scheduler = Scheduler(self.config, self.block_manager, self.budgets, tokenizer,
                                   eos_token_ids(self.model, tokenizer))
        self.plan: Plan | None = None
        self.guard: Guard | None = None
        self._seqs: dict[str, Sequence] = {}
        if plan is None:   # a novice checkpoint serves its replaced experts' constants (models/novice.py)
            from ..plans.plan import novice_checkpoint_plan
            plan = novice_checkpoint_plan(self.model)
        self.set_plan(plan)
        self.decode_pools: PoolsByLoad | None = None
        self.set_decode_pools(decode_pools)
        self.vocab_size = self.model.get_output_embeddings().out_features   # not weight.shape: it may be packed
        self.step_log: deque[StepRecord] = deque(maxlen=step_log_size)   # the most recent steps
        self.lock = threading.RLock()
        self.tokens_generated = 0
        if guard:   # off unless asked for (the server turns it on): measurements see the raw plan
            self.enable_guard(guard if isinstance(guard, GuardConfig) else GuardConfig())
        self.observer = None
        if observe is not None:
            self.observe(observe, observe_every)

    def observe(self, path: str | Path, every: int = 0, command: str | None = None):
        """Accumulate the served traffic's calibration statistics (``calibration.observe``) and write
        them to ``path`` every ``every`` steps (0: only on ``observer.save()`` and ``close()``)."""
        from .observe import engine_observer

        with self.lock:
            if self.observer is not None:
                raise ValueError(f"this engine already observes into {self.observer.path}")
            self.observer = engine_observer(self.model, self.controller, path, every, command)
        return self.observer

    # ---- configuration -------------------------------------------------------------------------
    def set_plan(self, plan: Plan | str | Path | None) -> None:
        """Use ``plan`` from the next step on (None = the full router in both phases)."""
        plan = load_checked(plan, Plan, self.model)
        if plan is not None:   # compile now so a bad plan fails here, not inside a step
            from ..plans.techniques import attach_plan_fold_tables
            attach_plan_fold_tables(self.model, plan)
            self.controller.compile(plan.prefill)
            self.controller.compile(plan.decode)
        self.plan = plan
        if self.guard is not None:
            self._apply(self.guard.reset())   # a new plan is judged on fresh evidence

    def set_decode_pools(self, pools: PoolsByLoad | None) -> None:
        """Decode steps of requests without their own plan run the pool ``pools`` picks for the step's
        batch size (``load_pools.PoolsByLoad``) instead of the engine plan's decode policy."""
        for rung in pools.rungs if pools is not None else ():
            if rung.plan is not None:
                rung.plan.check_model(self.model)
                self.controller.compile(rung.plan.decode)   # a bad plan fails here, not inside a step
        self.decode_pools = pools

    def enable_guard(self, config: GuardConfig | None = None) -> Guard:
        """Watch reduced pools and fall back to the full pool when one collapses (serving/guard.py)."""
        from ..plans.plan import uniform_plan

        self.guard = Guard(uniform_plan(self.model), config)
        return self.guard

    def step_policy(self, seqs: list[Sequence], is_prefill: bool) -> tuple[PhasePolicy, int | None]:
        """The one owner of which expert policy a step runs, and the decode pool by load it came from:
        the requests' own plan (the scheduler never mixes plans in a step; the guard's full pool is
        one), else in decode the pool the batch size picks, else the engine's plan."""
        own = seqs[0].plan
        if own is not None:
            return own.prefill if is_prefill else own.decode, None
        if not is_prefill and self.decode_pools is not None:
            rung = self.decode_pools.rung_for(len(seqs))
            return (rung.plan.decode if rung.plan is not None else FULL_PHASE), rung.pool_size
        if self.plan is None:
            return FULL_PHASE, None
        return self.plan.prefill if is_prefill else self.plan.decode, None

    @property
    def eos_token_ids(self) -> set[int]:
        return self.scheduler.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: set[int]) -> None:
        self.scheduler.eos_token_ids = set(ids)

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # ---- requests ------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        return encode_prompt(self.tokenizer, prompt)

    def add_request(self, prompt: str | list[int], sampling: SamplingParams | None = None,
                    request_id: str | None = None, plan: Plan | None = None, plan_key: str | None = None,
                    tier: int | None = None) -> Sequence:
        """Queue a request; raises ValueError (naming the limit) when it can never run.
        ``plan`` overrides the engine's plan for this request (``plan_key`` names it; requests
        with different keys run in different steps); so does an offline k ``tier``."""
        sampling = sampling or SamplingParams()
        text, ids = self.encode(prompt)
        check_request(ids, sampling, self.request_limits())
        bs = self.config.block_size
        with self.lock:
            if plan is not None:
                plan = load_checked(plan, Plan, self.model)
                self.controller.compile(plan.prefill), self.controller.compile(plan.decode)
                plan_key = plan_key or f"plan-{id(plan)}"
            seq = Sequence(ids, sampling, request_id=request_id, prompt=text, plan=plan, plan_key=plan_key)
            seq.block_size, seq.tier = bs, tier
            if seq.request_id in self._seqs:
                raise ValueError(f"request id {seq.request_id!r} is already in use")
            self._seqs[seq.request_id] = seq
            if self.guard is not None:   # may run it on the full pool and queue a full-pool shadow of it
                admission = self.guard.admit(seq, self.plan)
                if admission.plan is not None:
                    seq.plan, seq.plan_key = admission.plan, admission.plan_key
                if admission.shadow is not None and not self.enqueue(admission.shadow):
                    self.guard.forget(admission.shadow)
            self.scheduler.add(seq)
        return seq

    def enqueue(self, seq: Sequence, kv: list | None = None) -> bool:
        """Queue a sequence built outside ``add_request``: the guard's full-pool shadows, and sequences
        prefilled by another engine (``disagg.py``), whose KV blocks ``kv`` (per layer (k, v), from
        ``ModelRunner.read_blocks``) are written into this pool unchanged so they join the decode
        batch; without room such a sequence waits and is prefilled again here, like a preempted one.
        False when its request id is already in use."""
        with self.lock:
            if seq.request_id in self._seqs:
                return False
            seq.block_size = self.config.block_size
            self._seqs[seq.request_id] = seq
            if kv is None:
                self.scheduler.add(seq)
            elif self.scheduler.add_prefilled(seq):
                n_src = next(k for k, _ in (x for x in kv if x is not None)).shape[0] // self.config.block_size
                self.runner.write_blocks(seq.block_table[:n_src], kv)
            return True

    def request_limits(self) -> RequestLimits:
        if getattr(self, "_limits", None) is None:
            self._limits = RequestLimits(self.vocab_size, self.config.max_model_len,
                                         self.config.max_num_batched_tokens, self.block_manager.num_blocks,
                                         self.config.block_size, self.budgets.limits)
        return self._limits

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> bool:
        """Stop a request and free its KV blocks. False when it is unknown or already finished."""
        with self.lock:
            seq = self._seqs.pop(request_id, None)
            if seq is None or seq.is_finished:
                return False
            seq.finish(reason, error)
            self.scheduler.finish(seq)
            if self.guard is not None:
                self._apply(self.guard.forget(seq))
            return True

    def _apply(self, actions: list[Action]) -> None:
        """Carry out the guard's decisions."""
        for action in actions:
            if isinstance(action, RunOn):
                action.seq.plan, action.seq.plan_key = action.plan, action.plan_key
            elif isinstance(action, Abort):
                self.abort(action.request_id, action.reason, action.error)

    def has_unfinished(self) -> bool:
        return not self.scheduler.is_finished()

    def poll(self) -> list[Sequence]:
        """Nothing changes in a colocated engine without a step (``serving/client.py``)."""
        return []

    def health(self) -> dict:
        """A colocated engine has no worker processes (``serving/client.py``)."""
        return {"ok": True, "workers": {}}

    def close(self) -> None:
        """Write the observed statistics, if observing (``serving/client.py``)."""
        with self.lock:
            observer, self.observer = self.observer, None
        if observer is not None:
            observer.close()

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one prefill or decode step; returns the sequences that got a token or failed. When the
        step raises, its requests run one by one and only those that still fail end with an error."""
        with self.lock:
            seqs, is_prefill = self.scheduler.schedule()
            if not seqs:
                return []
            start = time.perf_counter()
            policy, pool = self.step_policy(seqs, is_prefill)
            try:
                out, tokens, mean_k = self._run(seqs, is_prefill, policy)
            except Exception:
                return self._step_one_by_one(seqs, is_prefill, policy)
            self.step_log.append(StepRecord("prefill" if is_prefill else "decode", len(seqs),
                                            sum(len(s) for s in seqs) if is_prefill else len(seqs),
                                            time.perf_counter() - start, out.experts_read, out.expert_bytes,
                                            mean_k, pool))
            self._postprocess(seqs, tokens, out.logits, is_prefill)
            return seqs

    def _run(self, seqs: list[Sequence], is_prefill: bool, policy: PhasePolicy
             ) -> tuple[StepOutput, list[int], float]:
        """The forward under ``policy`` and the requests' budgets, then sampling: (output with the
        rows [B, V] that were sampled from, one token per sequence, mean experts per token)."""
        top_k, k_max, mean_k = self.budgets.token_top_k(seqs, is_prefill)
        routing = Routing(self.controller.compile(policy), top_k, k_max,          # compiled once per plan
                          uniform=top_k is not None and mean_k == k_max)               # one budget: the native path
        every = [is_prefill and s.sampling.prompt_logprobs is not None and s.prompt_logprobs is None
                 for s in seqs]                                                    # prompt logprobs still to compute
        observing = observed_step(self.observer, seqs, is_prefill) if self.observer is not None else nullcontext()
        with observing:                                          # counted once the step's tokens are sampled
            out = self.runner.run(seqs, is_prefill, self.block_manager, routing, every if any(every) else None)
            if any(every):
                out = replace(out, logits=take_prompt_logprobs(seqs, every, out.logits))   # [B, V]
            tokens = sample(out.logits, [s.sampling for s in seqs], [s.generator for s in seqs])
        record_logprobs(seqs, out.logits, tokens)
        return out, tokens, mean_k

    def _postprocess(self, seqs: list[Sequence], tokens: list[int], logits: torch.Tensor, is_prefill: bool) -> None:
        for seq in self.scheduler.postprocess(seqs, tokens):
            self._seqs.pop(seq.request_id, None)
        if self.guard is not None:
            self._apply(self.guard.observe(seqs, logits, is_prefill))
        self.tokens_generated += len(seqs)

    def _step_one_by_one(self, seqs: list[Sequence], is_prefill: bool, policy: PhasePolicy) -> list[Sequence]:
        """A failed step again, one request at a time (same KV slots, so nothing is written twice):
        a request that fails alone ends with a short error (the traceback goes to the log), its
        guard shadow with it; the others get their token."""
        done, rows = [], []
        for seq in seqs:
            try:
                out, token, _ = self._run([seq], is_prefill, policy)
            except Exception as e:
                phase = "prefill" if is_prefill else "decode"
                if isinstance(e, NonFiniteLogits):   # the model's numbers, not a bug: one line
                    log.error("request %s failed in a %s step: %s", seq.request_id, phase, e)
                else:
                    log.exception("request %s failed in a %s step", seq.request_id, phase)
                self.abort(seq.request_id, reason="error", error=str(e) if isinstance(e, NonFiniteLogits) else
                           f"internal error ({type(e).__name__}) in the engine step; the server log has the details")
                continue
            for finished in self.scheduler.postprocess([seq], token):
                self._seqs.pop(finished.request_id, None)
            done.append(seq)
            rows.append(out.logits)
        if self.guard is not None and done:
            self._apply(self.guard.observe(done, torch.cat(rows), is_prefill))
        self.tokens_generated += len(done)
        return list(seqs)

    # ---- front ends ----------------------------------------------------------------------------
    def generate(self, prompts: list[str] | list[list[int]] | str, sampling: SamplingParams | list[SamplingParams]
                 | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in prompt order."""
        prompts, params = per_prompt(prompts, sampling)
        if self.config.k_schedule == "tiers":        # each tier is a step group, queued in the plan's order
            seqs: list = [None] * len(prompts)
            for tier, batch in enumerate(self.budgets.tiers(params)):
                for i in batch:
                    seqs[i] = self.add_request(prompts[i], params[i], tier=tier)
        else:
            seqs = [self.add_request(p, s) for p, s in zip(prompts, params)]
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(seqs), desc="generate", unit="req")
        done = 0
        while any(not s.is_finished for s in seqs):
            if not self.step() and not self.has_unfinished():
                break
            if bar is not None:
                now = sum(s.is_finished for s in seqs)
                bar.update(now - done)
                done = now
        if bar is not None:
            bar.close()
        return [RequestOutput.of(s) for s in seqs]

    def fit_k_cost(self, min_steps: int = 8) -> StepCost:
        """Fit the budget schedules' step cost to this engine's measured decode steps (``BudgetPolicy.fit``)."""
        return self.budgets.fit(self.step_log, min_steps)

    def stream(self, prompt: str | list[int], sampling: SamplingParams | None = None,
               request_id: str | None = None) -> Iterator[StreamDelta]:
        """Yield the request's new text and tokens after each step (other requests advance too).
        Closing the iterator early aborts the request and frees its blocks."""
        seq = self.add_request(prompt, sampling, request_id)
        sent_text = sent_tokens = 0
        try:
            while True:
                if not seq.is_finished:
                    self.step()
                if seq.num_completion_tokens > sent_tokens or seq.is_finished:
                    d = delta(seq, sent_text, sent_tokens)
                    sent_text, sent_tokens = sent_text + len(d.text), sent_tokens + len(d.token_ids)
                    yield d
                if seq.is_finished:
                    return
        finally:
            if not seq.is_finished:
                self.abort(seq.request_id)

    # ---- numbers -------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Queue and pool state for /metrics and logs."""
        recent = [r for r in itertools.islice(reversed(self.step_log), 50) if r.phase == "decode"]
        secs = sum(r.seconds for r in recent)
        return {"waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
                "kv_blocks_total": self.block_manager.num_blocks, "kv_blocks_free": self.block_manager.num_free,
                "kv_usage": self.block_manager.usage, "preemptions": self.scheduler.num_preemptions,
                "tokens_generated": self.tokens_generated,
                "decode_tokens_per_s": (sum(r.num_seqs for r in recent) / secs) if secs > 0 else 0.0,
                "distinct_experts_last_step": (sum(self.step_log[-1].distinct_experts.values()) /
                                               max(1, len(self.step_log[-1].distinct_experts))) if self.step_log else 0.0}
