"""k-aware batching policy for per-request expert budgets (MoE-Prism's scheduler), as pure data.

A request asks for ``k`` sub-experts per token (``SamplingParams.expert_top_k``). A step that mixes
budgets runs at the largest one unless the engine keeps budgets apart, so this module decides
which requests share a step and at which k. It never reads the model: it works on
``KRequest(request_id, k, arrival)`` lists and returns ``Batch``es. Two guarantees hold for every
batch: ``batch.k >= k`` of every member (a request never gets FEWER experts than it asked for;
running it at more is allowed, and counted in ``Batch.upgraded``), and every queued request is
served within a bounded wait (``OnlineLanes``: at most ``max_wait`` steps between turns of a lane).

The schedules decide with the step cost model ``StepCost`` (``routing/traffic.py``, shared with
the GPU roofline): seconds(k, B) of a decode step of B sequences at budget k, from the expected
distinct experts the batch touches; throughput of a batch is B / seconds(k, B).

Offline mode (``plan_offline``): requests are sorted into tiers by k (ascending). Each tier fills
batches of ``max_batch``; the residual (a partial batch) either runs alone at its own k, or merges
upward into the next tier, where it is served at the higher k. The choice compares the estimated
time to serve [residual + next tier] both ways: alone = seconds(k_t, r) + T(next tier),
merged = T(next tier + residual) at the next tier's k (T = sum of step seconds over its batches).

Online mode (``OnlineLanes``): running requests are split into a low-k and a high-k lane at a
boundary; each decode step serves one lane (the one that has waited ``max_wait`` steps first,
otherwise the one with the higher estimated throughput), and within a lane the requests served
longest ago first. The boundary adapts every ``adapt_every`` steps to the candidate that
minimises the estimated time to give every running request one token, moving only when that
saves more than ``hysteresis`` (a soft boundary), and may collapse to a single lane.

``budgets.BudgetPolicy`` wires these to the engine's sequences: a decode step asks
``lanes.next_batch(running)`` which running sequences to step, and each member runs at its own k
(which respects the guarantee, since route() trims per token).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .traffic import StepCost  # noqa: F401  (the vLLM scheduler imports it from here)


@dataclass(frozen=True)
class KRequest:
    request_id: str
    k: int              # sub-experts per token asked for
    arrival: float = 0.0


@dataclass(frozen=True)
class Batch:
    request_ids: tuple[str, ...]
    k: int                          # budget the step runs at: >= every member's k
    upgraded: tuple[str, ...] = ()  # members served above their own k (merged upward)


# ---------------------------------------------------------------------------------------------
# offline: tiers, flush or merge upward
# ---------------------------------------------------------------------------------------------

def _batches(reqs: list[KRequest], k: int, max_batch: int) -> list[Batch]:
    out = []
    for i in range(0, len(reqs), max_batch):
        chunk = reqs[i:i + max_batch]
        out.append(Batch(tuple(r.request_id for r in chunk), k, tuple(r.request_id for r in chunk if r.k < k)))
    return out


def plan_offline(requests: list[KRequest], max_batch: int, cost: StepCost) -> list[Batch]:
    """Group queued requests into k tiers and batches (see the module docstring). Batches come out
    ordered by their oldest member's arrival, so no tier waits behind all the others."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1 (got {max_batch})")
    tiers: dict[int, list[KRequest]] = {}
    for r in sorted(requests, key=lambda r: (r.arrival, r.request_id)):
        tiers.setdefault(r.k, []).append(r)
    ks = sorted(tiers)
    out: list[Batch] = []
    carry: list[KRequest] = []
    for t, k in enumerate(ks):
        pool = carry + tiers[k]
        carry = []
        full = len(pool) - len(pool) % max_batch
        out += _batches(pool[:full], k, max_batch)
        residual = pool[full:]
        if not residual:
            continue
        if t + 1 < len(ks):
            k_next, n_next = ks[t + 1], len(tiers[ks[t + 1]])
            alone = cost.seconds(k, len(residual)) + cost.serve(k_next, n_next, max_batch)
            merged = cost.serve(k_next, n_next + len(residual), max_batch)
            if merged < alone:
                carry = residual
                continue
        out += _batches(residual, k, max_batch)
    arrival = {r.request_id: r.arrival for r in requests}
    return sorted(out, key=lambda b: min(arrival[i] for i in b.request_ids))


# ---------------------------------------------------------------------------------------------
# online: two decode lanes with an adaptive boundary and bounded wait
# ---------------------------------------------------------------------------------------------

@dataclass
class OnlineLanes:
    """Decode lanes for low-k (k <= boundary) and high-k requests.

    The engine keeps one (``budgets.BudgetPolicy.lanes``): each decode step calls ``next_batch`` on the
    running requests and steps only the returned ids (the others keep their KV blocks and wait);
    ``max_batch`` is the engine's max_num_seqs.
    """

    cost: StepCost
    max_batch: int
    boundary: int | None = None      # None: one lane (decided by adapt())
    max_wait: int = 2                # a non-empty lane is served at least once every max_wait + 1 steps
    adapt_every: int = 8
    hysteresis: float = 0.05
    step: int = 0
    last_served: dict[str, int] = field(default_factory=dict)   # request id -> step it last ran
    lane_served: dict[str, int] = field(default_factory=dict)   # "low"/"high" -> step it last ran

    def lanes(self, running: list[KRequest]) -> tuple[list[KRequest], list[KRequest]]:
        if self.boundary is None:
            return [], list(running)
        return [r for r in running if r.k <= self.boundary], [r for r in running if r.k > self.boundary]

    def round_seconds(self, running: list[KRequest], boundary: int | None) -> float:
        """Estimated seconds to give every running request one token with this boundary."""
        low, high = (([], running) if boundary is None else
                     ([r for r in running if r.k <= boundary], [r for r in running if r.k > boundary]))
        return sum(self.cost.serve(max(r.k for r in lane), len(lane), self.max_batch) for lane in (low, high) if lane)

    def adapt(self, running: list[KRequest]) -> None:
        """Move the boundary to the cheapest candidate when it saves more than ``hysteresis``."""
        if not running:
            return
        ks = sorted({r.k for r in running})
        candidates = [None] + ks[:-1]
        best = min(candidates, key=lambda b: self.round_seconds(running, b))
        now = self.round_seconds(running, self.boundary)
        if self.round_seconds(running, best) < now * (1 - self.hysteresis):
            self.boundary = best

    def next_batch(self, running: list[KRequest]) -> Batch | None:
        """The requests to step now and their k; None when nothing runs."""
        if not running:
            return None
        if self.step % self.adapt_every == 0:
            self.adapt(running)
        low, high = self.lanes(running)
        lanes = {name: lane for name, lane in (("low", low), ("high", high)) if lane}
        for name in lanes:
            self.lane_served.setdefault(name, self.step)

        def waited(name: str) -> int:
            return self.step - self.lane_served[name]

        for r in running:  # a newcomer queues behind requests already waiting (no overtaking)
            self.last_served.setdefault(r.request_id, self.step - 1)

        def take(lane: list[KRequest]) -> list[KRequest]:
            return sorted(lane, key=lambda r: (self.last_served[r.request_id], r.arrival,
                                               r.request_id))[:self.max_batch]

        overdue = [n for n in lanes if waited(n) >= self.max_wait]
        if overdue:
            name = max(overdue, key=waited)
        else:
            name = max(lanes, key=lambda n: (self.cost.throughput(max(r.k for r in take(lanes[n])),
                                                                  len(take(lanes[n]))), waited(n)))
        chosen = take(lanes[name])
        k = max(r.k for r in chosen)
        self.lane_served[name] = self.step + 1
        for r in chosen:
            self.last_served[r.request_id] = self.step
        self.step += 1
        return Batch(tuple(r.request_id for r in chosen), k, tuple(r.request_id for r in chosen if r.k < k))

    def forget(self, request_id: str) -> None:
        """Drop a finished request's bookkeeping."""
        self.last_served.pop(request_id, None)


@dataclass
class MeasuredChoice:
    """Lanes or one joint step, decided by the clock: the cost model proposes lanes, and each mode is
    then kept only while its measured decode throughput is the higher one.

    Why: the lanes pay only where a step's cost follows the experts its batch touches. Where it is
    mostly fixed cost (a small model, a CPU), running half the requests per step loses (measured in
    vLLM: the k-aware scheduler at 0.58-0.81x FIFO with the shape-based cost model). Each mode gets a
    trial of ``window`` all-decode steps (tokens and seconds recorded by the caller); the faster by
    tokens per second over its last ``window`` steps runs until ``recheck`` steps have passed, then the
    other gets a new trial, so a change in load (other budgets, other batch sizes) is noticed."""

    window: int = 8
    recheck: int = 96
    mode: str = "lanes"              # "lanes" | "joint"
    since_check: int = 0
    samples: dict[str, list[tuple[int, float]]] = field(default_factory=lambda: {"lanes": [], "joint": []})

    def rate(self, mode: str) -> float | None:
        """Decode tokens per second over the mode's last ``window`` steps (None before a full trial)."""
        recent = self.samples[mode][-self.window:]
        if len(recent) < self.window:
            return None
        return sum(t for t, _ in recent) / max(1e-9, sum(s for _, s in recent))

    def record(self, tokens: int, seconds: float) -> None:
        """One all-decode step of the current mode: ``tokens`` decoded in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        self.samples[self.mode].append((tokens, seconds))
        del self.samples[self.mode][:-self.window]
        self.since_check += 1
        other = "joint" if self.mode == "lanes" else "lanes"
        mine, theirs = self.rate(self.mode), self.rate(other)
        if mine is None:
            return                                    # the current trial is not over
        if theirs is None or self.since_check >= self.recheck:
            self.samples[other].clear()               # (re)try the other mode
            self.mode, self.since_check = other, 0
        elif theirs > mine:
            self.mode, self.since_check = other, 0

