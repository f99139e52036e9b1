"""The collapse guard: notices when a reduced expert pool stops behaving like the full model and
sends its requests back to the full pool (docs/guard.md: what it watches, the bounds, the trip cycle).

Per request it rescues (repetition, overrun past the full pool's p90); per policy it compares a window
of recent requests with the full pool's, fed by shadows, and trips. Lengths count only where the model
chose to stop (EOS): a request cut by ``max_tokens`` or a client's stop string is evidence only past the
overrun limit, else 30 requests with ``max_tokens: 1`` would look like a collapse.

The guard decides and the engine acts: ``admit`` returns an ``Admission``; ``observe``, ``forget`` and
``reset`` return ``Action``s (``RunOn``, ``Abort``) that ``LLM`` applies. The guard never calls the
engine; a switch changes only ``seq.plan`` / ``seq.plan_key`` (the KV cache is shared by every pool).
"""
from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

log = logging.getLogger("moetailor.guard")

FULL_KEY = "full"           # plan_key of sequences the guard runs on the full pool
DEFAULT_POLICY = "default"  # the engine's own plan (requests without a per-request plan)
STATES = ("active", "probation", "tripped")


@dataclass(frozen=True)
class RunOn:
    """Action: run ``seq``'s next steps on ``plan`` (its KV blocks stay as they are)."""
    seq: object
    plan: object
    plan_key: str


@dataclass(frozen=True)
class Abort:
    """Action: end the request ``request_id`` (a shadow whose request ended, or a reset)."""
    request_id: str
    reason: str = "abort"
    error: str | None = None


Action = RunOn | Abort


@dataclass(frozen=True)
class Admission:
    """What to do with a new request: run it on ``plan`` (None = as asked) and queue ``shadow`` (a
    full-pool twin, or None) first."""
    plan: object = None
    plan_key: str | None = None
    shadow: object = None


SHADOW_SUFFIX = "~shadow"


def shadow_id(request_id: str) -> str:
    """The request id of a request's full-pool shadow."""
    return f"{request_id}{SHADOW_SUFFIX}"


def is_shadow(seq) -> bool:
    """Whether ``seq`` is a guard's full-pool shadow (a copy of a request, not traffic)."""
    return seq.request_id.endswith(SHADOW_SUFFIX)


@dataclass
class GuardConfig:
    """Every bound of the guard. The defaults are meant to be left on in serving."""

    enabled: bool = True
    window: int = 64                    # recent requests per policy (and for the full pool)
    min_requests: int = 8               # policy requests judged before any policy verdict
    min_reference: int = 4              # full-pool requests before length/budget/entropy comparisons
    shadow_fraction: float = 1 / 16     # share of a reduced policy's requests also decoded on the full pool
    warmup_shadows: int = 4             # ... and its first requests all are, so evidence comes early
    budget_hit_excess: float = 0.25     # trip: budget-hit share above the full pool's by more than this
    p90_factor: float = 2.0             # trip: p90 length above factor x (or below 1/factor x) the full pool's ...
    length_slack: int = 16              # ... by more than this many tokens
    overrun_factor: float = 2.0         # rescue: a request longer than factor x full p90 + length_slack
    ngram: int = 4                      # n-gram size of the repetition measure
    repetition_window: int = 64         # recent tokens the repetition measure looks at
    repetition_min_tokens: int = 32     # completion tokens before repetition is measured
    repetition_max: float = 0.75        # rescue: share of repeated n-grams in the window above this
    entropy_factor: float | None = 3.0  # trip: mean next-token entropy above factor x the full pool's ...
    entropy_margin: float = 0.25        # ... + this many nats (a near-zero full-pool entropy makes ratios jumpy)
    rescued_share_max: float = 0.25     # trip: share of the window's requests that needed a rescue
    cooldown_steps: int = 2000          # engine steps a tripped policy stays off before probation
    probe_requests: int = 8             # requests run (all shadowed) in probation before re-enabling
    check_every: int = 4                # decode tokens between per-request checks

    def __post_init__(self) -> None:
        if self.warmup_shadows < 0:
            raise ValueError(f"warmup_shadows={self.warmup_shadows} must be >= 0")
        if not 0.0 <= self.shadow_fraction <= 1.0:
            raise ValueError(f"shadow_fraction={self.shadow_fraction} must be in [0, 1] (0 = no shadows)")
        for name in ("window", "min_requests", "probe_requests", "ngram", "repetition_window", "check_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"GuardConfig.{name}={getattr(self, name)} must be at least 1")
        if self.min_requests > self.window or self.min_reference > self.window:
            raise ValueError(f"min_requests={self.min_requests} and min_reference={self.min_reference} must not "
                             f"exceed window={self.window}; raise window or lower them")
        for name in ("p90_factor", "overrun_factor"):
            if getattr(self, name) < 1.0:
                raise ValueError(f"GuardConfig.{name}={getattr(self, name)} must be >= 1 (a ratio to the full pool)")
        if self.entropy_factor is not None and self.entropy_factor < 1.0:
            raise ValueError(f"entropy_factor={self.entropy_factor} must be >= 1, or None to turn it off")

    @classmethod
    def parse(cls, spec: str) -> "GuardConfig":
        """'shadow_fraction=0.25,p90_factor=3' -> a GuardConfig (for command lines)."""
        kinds = {f.name: f.type for f in fields(cls)}
        values = {}
        for item in (s.strip() for s in spec.split(",") if s.strip()):
            name, sep, value = item.partition("=")
            name = name.strip()
            if not sep or name not in kinds:
                raise ValueError(f"cannot read guard setting {item!r}; use NAME=VALUE with NAME one of "
                                 f"{', '.join(kinds)}")
            value = value.strip()
            if name == "enabled":
                values[name] = value.lower() in ("1", "true", "yes", "on")
            elif value.lower() == "none":
                values[name] = None
            elif "int" in str(kinds[name]) and "float" not in str(kinds[name]):
                values[name] = int(value)
            else:
                values[name] = float(value)
        return replace(cls(), **values)


@dataclass
class Outcome:
    """One request in a window."""
    length: int
    finish_reason: str | None        # "stop" | "length" | None (rescued before it finished)
    entropy: float                   # mean next-token entropy over its watched decode steps (nats)
    rescued: str | None = None       # why it was moved to the full pool, if it was
    eos: bool = False                # it ended on EOS: its length is the model's choice (not max_tokens or a
                                     # client's stop string)


@dataclass
class Watch:
    """What the guard knows about one live request."""
    policy: str
    role: str                        # "reduced" | "fallback" (guarded, on the full pool) | "shadow" | "full"
    entropy_sum: float = 0.0
    entropy_n: int = 0
    rescued: str | None = None
    switched_at: int | None = None   # completion tokens when it moved to the full pool

    @property
    def entropy(self) -> float:
        return self.entropy_sum / self.entropy_n if self.entropy_n else float("nan")


@dataclass
class PolicyState:
    state: str = "active"
    window: deque = field(default_factory=deque)
    admitted: int = 0                # requests admitted under this policy (shadow counter)
    trips: int = 0
    tripped_at: int = 0              # engine step of the last trip
    reason: str | None = None
    probes_left: int = 0
    steps: dict = field(default_factory=lambda: {"reduced": 0, "fallback": 0, "shadow": 0})
    rescued: dict = field(default_factory=dict)   # reason kind -> count


def window_stats(outcomes, overrun_limit: float = float("nan")) -> dict:
    """p50/p90 of the lengths that ended on EOS (``natural``: how many), the share of budget hits past
    ``overrun_limit`` among the requests whose length says something (``informative``: those that ended
    on EOS and those budget hits; a budget hit below the limit, or a stop on a client's stop string,
    says nothing about collapse), stop/rescued shares and mean entropy of a window."""
    outcomes = list(outcomes)
    finished = [o for o in outcomes if o.rescued is None]
    lengths = np.asarray([o.length for o in finished if o.eos], dtype=np.float64)
    overruns = sum(o.finish_reason == "length" and o.length > overrun_limit for o in finished)   # NaN: none
    informative = len(lengths) + overruns
    ent = [o.entropy for o in outcomes if not math.isnan(o.entropy)]
    return {"requests": len(outcomes), "natural": len(lengths), "informative": informative,
            "p50": float(np.percentile(lengths, 50)) if len(lengths) else float("nan"),
            "p90": float(np.percentile(lengths, 90)) if len(lengths) else float("nan"),
            "stop_share": sum(o.finish_reason == "stop" for o in finished) / max(1, len(finished)),
            "budget_hit_share": overruns / informative if informative else 0.0,
            "rescued_share": sum(o.rescued is not None for o in outcomes) / max(1, len(outcomes)),
            "entropy": float(np.mean(ent)) if ent else float("nan")}


def repetition(tokens: list[int], n: int) -> float:
    """Share of the n-grams in ``tokens`` that already occurred earlier in it (0 = none repeat)."""
    grams = [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


class Guard:
    """Per-policy windows, per-request watches and the switch to the full pool (see module doc)."""

    def __init__(self, full_plan, config: GuardConfig | None = None):
        self.config = config or GuardConfig()
        self.full_plan = full_plan                # the full pool: where fallbacks, rescues and shadows run
        self.reset()

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self.config.enabled = bool(value)

    def reset(self) -> list[Action]:
        """Forget all evidence (a new engine plan is a new deployment); running shadows are aborted."""
        actions = [Abort(seq.request_id) for seq in getattr(self, "shadows", {}).values()]
        self.policies: dict[str, PolicyState] = {}
        self.reference: deque[Outcome] = deque(maxlen=self.config.window)
        self.watches: dict[int, Watch] = {}
        self.shadows: dict[int, object] = {}      # seq_id -> shadow Sequence
        self.events: list[dict] = []              # trips, probations, re-enables, rescues
        self.live: dict[int, object] = {}         # seq_id -> watched Sequence (what a trip moves)
        self.actions: list[Action] = []           # what the observe call under way decided
        self.step_count = 0
        return actions

    # ---- which pool --------------------------------------------------------------------------------
    def _policy_of(self, seq, engine_plan) -> tuple[str, bool]:
        """(policy key, whether that policy reduces the expert pool in either phase)."""
        plan = seq.plan if seq.plan is not None else engine_plan
        reduced = plan is not None and not (plan.prefill.is_identity and plan.decode.is_identity)
        key = seq.plan_key if seq.plan is not None and seq.plan_key else DEFAULT_POLICY
        return key, reduced

    def policy(self, key: str) -> PolicyState:
        if key not in self.policies:
            self.policies[key] = PolicyState(window=deque(maxlen=self.config.window))
        return self.policies[key]

    def _to_full(self, seq) -> RunOn:
        return RunOn(seq, self.full_plan, FULL_KEY)

    def _watch(self, seq, watch: Watch) -> None:
        self.watches[seq.seq_id] = watch
        self.live[seq.seq_id] = seq

    def _unwatch(self, seq) -> Watch | None:
        self.live.pop(seq.seq_id, None)
        self.shadows.pop(seq.seq_id, None)
        return self.watches.pop(seq.seq_id, None)

    # ---- engine hooks ------------------------------------------------------------------------------
    def admit(self, seq, engine_plan) -> Admission:
        """A new request (``engine_plan``: the engine's plan, for requests without their own): run it
        on its policy, or on the full pool when that policy is off; maybe shadow it."""
        if not self.enabled:
            return Admission()
        key, reduced = self._policy_of(seq, engine_plan)
        if not reduced:
            self._watch(seq, Watch(key, "full"))
            return Admission()
        p = self.policy(key)
        self._maybe_probation(key, p)
        if p.state == "tripped" or (p.state == "probation" and p.probes_left <= 0):
            self._watch(seq, Watch(key, "fallback"))
            return Admission(self.full_plan, FULL_KEY)
        self._watch(seq, Watch(key, "reduced"))
        if p.state == "probation":
            p.probes_left -= 1
            shadow = True
        else:
            f = self.config.shadow_fraction
            shadow = p.admitted < self.config.warmup_shadows or \
                math.ceil((p.admitted + 1) * f) > math.ceil(p.admitted * f)   # requests 0, 1/f, 2/f, ...
        p.admitted += 1
        return Admission(shadow=self._shadow(seq, key) if shadow else None)

    def _shadow(self, seq, key: str):
        """The request's full-pool twin (the engine queues it; ``forget`` it if the engine refuses it)."""
        from .scheduler import Sequence

        sampling = replace(seq.sampling, logprobs=None, prompt_logprobs=None)   # a shadow returns nothing
        twin = Sequence(seq.token_ids, sampling, request_id=shadow_id(seq.request_id),
                        prompt=seq.prompt, plan=self.full_plan, plan_key=FULL_KEY)
        self._watch(twin, Watch(key, "shadow"))
        self.shadows[twin.seq_id] = twin
        return twin

    def forget(self, seq) -> list[Action]:
        """An aborted (or failed) request leaves no evidence (an aborted probe is replaced by the next
        request); its full-pool shadow ends with it, so a shadow never outlives a request that failed."""
        w = self._unwatch(seq)
        actions = []
        if w is not None and w.role != "shadow":
            actions.append(Abort(shadow_id(seq.request_id), reason=seq.finish_reason or "abort", error=seq.error))
        if w is not None and w.role == "reduced" and w.policy in self.policies:
            p = self.policies[w.policy]
            if p.state == "probation":
                p.probes_left += 1
        return actions

    @torch.no_grad()
    def observe(self, seqs: list, logits: torch.Tensor, is_prefill: bool) -> list[Action]:
        """After a step: account decode steps per pool, watch the reduced decoders, record finished
        requests; returns the requests to move (rescues, a tripped policy's requests)."""
        if not self.enabled:
            return []
        self.actions: list[Action] = []
        self.step_count += 1
        watched = [(i, self.watches.get(s.seq_id)) for i, s in enumerate(seqs)]
        if not is_prefill and any(w is not None for _, w in watched):
            probs = logits.float().softmax(-1)                                     # [B, V]
            entropy = torch.special.entr(probs).sum(-1).tolist()                  # [B] nats (0 log 0 = 0)
            for i, w in watched:
                if w is None:
                    continue
                if w.role in ("reduced", "fallback", "shadow") and w.policy in self.policies:
                    self.policies[w.policy].steps[w.role] += 1
                if w.role in ("reduced", "shadow", "full") or (w.role == "fallback" and w.switched_at is None):
                    w.entropy_sum += entropy[i]
                    w.entropy_n += 1
        for seq, (_, w) in zip(seqs, watched):
            if w is None:
                continue
            if seq.is_finished:
                self._finished(seq, w)
            elif w.role == "reduced" and not is_prefill and seq.num_completion_tokens % self.config.check_every == 0:
                reason = self._request_problem(seq)
                if reason is not None:
                    self._rescue(seq, w, reason)
        for key, p in self.policies.items():
            self._maybe_probation(key, p)
        actions, self.actions = self.actions, []
        return actions

    # ---- per request -------------------------------------------------------------------------------
    def _request_problem(self, seq) -> str | None:
        c = self.config
        n = seq.num_completion_tokens
        if n >= c.repetition_min_tokens:
            rep = repetition(seq.completion_token_ids[-c.repetition_window:], c.ngram)
            if rep > c.repetition_max:
                return f"repetition {rep:.2f} > {c.repetition_max} ({c.ngram}-grams over the last " \
                       f"{min(n, c.repetition_window)} tokens)"
        ref = window_stats(self.reference)
        if ref["natural"] >= c.min_reference:
            limit = c.overrun_factor * ref["p90"] + c.length_slack
            if n > limit:
                return f"overrun: {n} tokens > {c.overrun_factor:g} x full-pool p90 {ref['p90']:.0f} + {c.length_slack}"
        return None

    def _rescue(self, seq, w: Watch, reason: str) -> None:
        """Move a running request's next decode steps to the full pool (its KV blocks stay as they are)."""
        self.actions.append(self._to_full(seq))
        w.role, w.rescued, w.switched_at = "fallback", reason, seq.num_completion_tokens
        p = self.policy(w.policy)
        kind = reason.split()[0].rstrip(":")
        p.rescued[kind] = p.rescued.get(kind, 0) + 1
        self.events.append({"step": self.step_count, "policy": w.policy, "event": "rescue",
                            "request_id": seq.request_id, "reason": reason, "at_token": w.switched_at})
        log.info("guard: request %s of policy %r moved to the full pool after %d tokens: %s",
                 seq.request_id, w.policy, w.switched_at, reason)
        self._record(w.policy, Outcome(seq.num_completion_tokens, None, w.entropy, reason))

    def _finished(self, seq, w: Watch) -> None:
        self._unwatch(seq)
        if seq.finish_reason not in ("stop", "length"):
            return
        outcome = Outcome(seq.num_completion_tokens, seq.finish_reason, w.entropy, eos=seq.ended_on_eos)
        if w.role in ("shadow", "full") or (w.role == "fallback" and w.switched_at is None):
            self.reference.append(outcome)          # a whole request on the full pool
        elif w.role == "reduced":
            self._record(w.policy, outcome)
        # rescued requests were recorded when they were moved

    # ---- per policy --------------------------------------------------------------------------------
    def _record(self, key: str, outcome: Outcome) -> None:
        p = self.policy(key)
        p.window.append(outcome)
        if p.state == "tripped":
            return
        need = self.config.probe_requests if p.state == "probation" else self.config.min_requests
        if len(p.window) < need:
            return
        reason = self.problem(p)
        if reason is not None:
            self._trip(key, p, reason)
        elif p.state == "probation" and p.probes_left <= 0 and not self._probes_running(key):
            p.state, p.reason = "active", None
            self.events.append({"step": self.step_count, "policy": key, "event": "re-enabled"})
            log.warning("guard: policy %r re-enabled after probation (%d fresh requests healthy)", key, len(p.window))

    def _probes_running(self, key: str) -> bool:
        return any(w.policy == key and w.role == "reduced" for w in self.watches.values())

    def overrun_limit(self) -> float:
        """Completion tokens past which a request runs longer than the full pool needs (NaN: unknown,
        the full pool's window has no request that ended on EOS)."""
        return self.config.overrun_factor * window_stats(self.reference)["p90"] + self.config.length_slack

    def problem(self, p: PolicyState) -> str | None:
        """Why the policy's window departs from the full pool's beyond the bounds, or None. Length
        evidence counts only requests whose length is the model's (see ``window_stats``), and each
        comparison needs as many of them as a verdict needs requests."""
        c = self.config
        limit = self.overrun_limit()
        mine = window_stats(p.window, limit)
        if mine["rescued_share"] > c.rescued_share_max:
            return f"{mine['rescued_share']:.0%} of the last {mine['requests']} requests needed a rescue " \
                   f"(> {c.rescued_share_max:.0%}): {p.rescued}"
        ref = window_stats(self.reference, limit)
        if len(self.reference) < c.min_reference:
            return None
        need = c.probe_requests if p.state == "probation" else c.min_requests
        if mine["informative"] >= need and ref["informative"] >= c.min_reference and \
                mine["budget_hit_share"] > ref["budget_hit_share"] + c.budget_hit_excess:
            return f"budget-hit share {mine['budget_hit_share']:.0%} vs {ref['budget_hit_share']:.0%} on the full " \
                   f"pool (allowed excess {c.budget_hit_excess:.0%})"
        if mine["natural"] >= need and ref["natural"] >= c.min_reference:
            if mine["p90"] > c.p90_factor * ref["p90"] + c.length_slack or \
                    mine["p90"] < ref["p90"] / c.p90_factor - c.length_slack:
                return f"p90 length {mine['p90']:.0f} vs {ref['p90']:.0f} on the full pool (factor {c.p90_factor:g}, " \
                       f"slack {c.length_slack})"
        if c.entropy_factor is not None and mine["entropy"] > c.entropy_factor * ref["entropy"] + c.entropy_margin:
            return f"mean next-token entropy {mine['entropy']:.2f} vs {ref['entropy']:.2f} nats on the full pool " \
                   f"(factor {c.entropy_factor:g} + {c.entropy_margin:g})"
        return None

    def _trip(self, key: str, p: PolicyState, reason: str) -> None:
        p.state, p.reason, p.tripped_at, p.probes_left = "tripped", reason, self.step_count, 0
        p.trips += 1
        moved = 0
        for seq_id, seq in self.live.items():
            w = self.watches[seq_id]
            if not seq.is_finished and w.policy == key and w.role == "reduced":
                self.actions.append(self._to_full(seq))
                w.role, w.switched_at = "fallback", seq.num_completion_tokens or None   # None: not started yet
                moved += 1
        self.events.append({"step": self.step_count, "policy": key, "event": "trip", "reason": reason,
                            "moved": moved})
        log.warning("guard: policy %r tripped (%s); %d running requests and new ones go to the full pool "
                    "for %d steps", key, reason, moved, self.cooldown(p))

    def cooldown(self, p: PolicyState) -> int:
        return self.config.cooldown_steps * 2 ** max(0, p.trips - 1)

    def _maybe_probation(self, key: str, p: PolicyState) -> None:
        if p.state == "tripped" and self.step_count - p.tripped_at >= self.cooldown(p):
            p.state, p.probes_left = "probation", self.config.probe_requests
            p.window.clear()
            self.events.append({"step": self.step_count, "policy": key, "event": "probation"})
            log.warning("guard: policy %r on probation: the next %d requests run on it, shadowed", key, p.probes_left)

    # ---- numbers -----------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """State per policy and both windows (for /metrics, logs and the evaluation)."""
        limit = self.overrun_limit()
        out = {"enabled": self.enabled, "reference": window_stats(self.reference, limit), "policies": {}}
        for key, p in self.policies.items():
            decode = sum(p.steps.values()) - p.steps["shadow"]
            out["policies"][key] = {
                "state": p.state, "trips": p.trips, "reason": p.reason, "window": window_stats(p.window, limit),
                "decode_steps": dict(p.steps), "rescued": dict(p.rescued),
                "fallback_step_share": p.steps["fallback"] / decode if decode else 0.0,
                "shadow_step_share": p.steps["shadow"] / decode if decode else 0.0}
        return out
