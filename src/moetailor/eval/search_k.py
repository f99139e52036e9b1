"""`moetailor search-k`: a per-layer active-expert allocation under a total budget.

Quality is the next-token KL from the full model on calibration text, scored as the engine serves
(``eval.metrics.HeldoutScorer``). Coordinate descent over single-expert transfers keeps the total
fixed: start uniform (budget // n per MoE layer, the remainder to the last layers); each round take
the move "one expert from layer i to layer j" (k_i > 1, k_j < k) that lowers KL most; stop when none lowers it by more
than ``tol`` nats or after ``max_rounds``. Scored allocations are cached, so a round costs at most
n(n-1) passes. The result is checked on held-out text (and optionally tasks) and written as a plan.
"""
from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field

from ..plans.plan import Plan
from ..plans.techniques import Shape, layer_k_policy, technique_plan
from ..routing.policy import PhasePolicy

SEARCH_PHASES = ("both", "decode", "prefill")
METHOD = ("coordinate descent over single-expert transfers between MoE layers (total fixed), from the uniform "
          "allocation; each round takes the transfer that lowers next-token KL to the full model most; stops when "
          "none lowers it by more than tol or after max_rounds")


@dataclass
class SearchResult:
    ks: list[int]                      # per MoE layer, the chosen k
    kl: float                          # its KL on the search text
    uniform: list[int]                 # the starting allocation
    uniform_kl: float
    rounds: int
    evaluations: int
    history: list[dict] = field(default_factory=list)   # one entry per accepted move

    def to_json(self) -> dict:
        return asdict(self)


def uniform_allocation(shape: Shape, budget: int) -> list[int]:
    """budget // n experts per MoE layer; the remainder goes one each to the last layers."""
    n = len(shape.layers)
    if not n <= budget <= n * shape.top_k:
        raise ValueError(f"a total budget of {budget} active experts cannot be spread over {n} MoE layers with "
                         f"1..{shape.top_k} experts each; choose a budget in [{n}, {n * shape.top_k}]")
    base, extra = divmod(budget, n)
    return [base + (1 if pos >= n - extra else 0) for pos in range(n)]


def phase_policies(policy: PhasePolicy, phase: str) -> tuple[PhasePolicy | None, PhasePolicy | None]:
    """(prefill, decode) for a search phase."""
    if phase not in SEARCH_PHASES:
        raise ValueError(f"unknown phase {phase!r}; choose from {', '.join(SEARCH_PHASES)}")
    return (policy if phase in ("both", "prefill") else None, policy if phase in ("both", "decode") else None)


def search_k(model, windows: list[list[int]], budget: int, *, phase: str = "both", max_rounds: int = 20,
             tol: float = 1e-4, start: list[int] | None = None, progress: bool = True, log=None,
             policy_of=None, low: int = 1, high: int | None = None, step: int = 1) -> SearchResult:
    """Coordinate descent (see the module docstring) on ``windows`` of calibration token ids.
    By default the per-layer count is the active experts per token (``top_k``, in [1, k]); with
    ``policy_of`` (counts -> PhasePolicy) it can be any per-layer budget in [low, high], moved
    ``step`` at a time — e.g. the size of each layer's static expert pool (``search_pool``)."""
    from .metrics import HeldoutScorer

    shape = Shape.of(model)
    phase_policies(PhasePolicy(), phase)   # validate before any work
    policy_of = policy_of or (lambda ks: layer_k_policy(shape, ks))
    current = list(start) if start is not None else uniform_allocation(shape, budget)
    policy_of(current)
    if sum(current) != budget:
        raise ValueError(f"the start allocation {current} spends {sum(current)} experts, not the budget {budget}")
    scorer = HeldoutScorer(model, windows)
    return descend(lambda ks: scorer.score(*phase_policies(policy_of(ks), phase)).kl, current, low=low,
                   high=high if high is not None else shape.top_k, step=step, max_rounds=max_rounds, tol=tol,
                   progress=progress, log=log)


def descend(kl_of, start: list[int], *, low: int, high: int, step: int = 1, max_rounds: int = 20, tol: float = 1e-4,
            progress: bool = True, log=None) -> SearchResult:
    """The descent itself, on any ``kl_of(per-layer counts)``: each round tries every transfer of
    ``step`` from layer i to layer j within [low, high] and takes the one that lowers KL most; stops
    when none lowers it by more than ``tol`` or after ``max_rounds`` (``tuning`` runs it on its own
    scorer, which may be vLLM)."""
    from tqdm import tqdm

    log = log or (lambda m: print(m, file=sys.stderr))
    if max_rounds < 0:
        raise ValueError(f"--max-rounds must be >= 0, got {max_rounds}")
    scored: dict[tuple[int, ...], float] = {}

    def kl(ks: list[int]) -> float:
        key = tuple(ks)
        if key not in scored:
            scored[key] = kl_of(list(ks))
        return scored[key]

    current, n = list(start), len(start)
    uniform, current_kl = list(current), kl(current)
    history, rounds = [], 0
    for rounds in range(1, max_rounds + 1):
        moves = [(i, j) for i in range(n) for j in range(n)
                 if i != j and current[i] - step >= low and current[j] + step <= high]
        best = None
        for i, j in tqdm(moves, desc=f"search-k round {rounds}", unit="move", disable=not progress, file=sys.stderr,
                         leave=False):
            cand = list(current)
            cand[i] -= step
            cand[j] += step
            value = kl(cand)
            if best is None or value < best[0]:
                best = (value, cand, i, j)
        if best is None or best[0] >= current_kl - tol:
            rounds -= 1
            break
        history.append({"round": rounds, "from_layer": best[2], "to_layer": best[3], "ks": best[1], "kl": best[0]})
        log(f"round {rounds}: move {step} expert(s) from MoE layer {best[2]} to {best[3]} -> {best[1]}, "
            f"KL {current_kl:.4f} -> {best[0]:.4f}")
        current, current_kl = best[1], best[0]
    return SearchResult(current, current_kl, uniform, scored[tuple(uniform)], rounds, len(scored), history)


def calibration_windows(tokenizer, data: str, tokens: int, window: int, seed: int = 0) -> list[list[int]]:
    """Full-length windows of calibration text (the spec of ``moetailor calibrate --data``)."""
    from ..calibration.data import iter_token_windows

    if window < 4:
        raise ValueError(f"--window must be at least 4 tokens, got {window}")
    out = [w for w in iter_token_windows(tokenizer, data, tokens, window, seed) if len(w) == window]
    if not out:
        raise ValueError(f"--tokens {tokens} is less than one window of {window} tokens; raise --tokens")
    return out


def task_accuracy(model, tokenizer, plans: dict[str, Plan | None], n: int, tasks: str = "all",
                  seed: int = 0) -> dict[str, float]:
    """Greedy exact-match accuracy of each plan over ``n`` prompts per task, through the engine."""
    from ..serving import LLM, SamplingParams
    from .metrics import accuracy, score_output
    from .runner import task_budget
    from .user_tasks import select_tasks, task_examples

    chosen = select_tasks(tasks)
    examples = [ex for t in chosen for ex in task_examples(t, n, seed, tokenizer)]
    budgets = {t.name: task_budget(t, tokenizer) for t in chosen}
    params = [SamplingParams(max_tokens=budgets[ex.task], temperature=0.0) for ex in examples]
    llm = LLM(model, tokenizer=tokenizer, max_num_seqs=64)
    out = {}
    for name, plan in plans.items():
        llm.set_plan(plan)
        outputs = llm.generate([ex.prompt for ex in examples], params)
        out[name] = accuracy([score_output(ex, o, p.max_tokens) for ex, o, p in zip(examples, outputs, params)])
    llm.set_plan(None)
    return out


def search_plan(model, tokenizer, budget: int, *, data: str = "mix", tokens: int = 4096, window: int = 128,
                phase: str = "both", max_rounds: int = 20, tol: float = 1e-4, heldout_docs: int = 1,
                accuracy_n: int = 0, tasks: str = "all", seed: int = 0, progress: bool = True,
                command: str | None = None, log=None) -> tuple[Plan, dict]:
    """Search, check on held-out text (and tasks), and return the plan with a summary."""
    from ..data.corpus import bundled_documents
    from .metrics import HeldoutScorer, heldout_windows

    t0 = time.time()
    shape = Shape.of(model)
    uniform_allocation(shape, budget)
    phase_policies(PhasePolicy(), phase)
    windows = calibration_windows(tokenizer, data, tokens, window, seed)
    result = search_k(model, windows, budget, phase=phase, max_rounds=max_rounds, tol=tol, progress=progress, log=log)
    summary = {"budget": budget, "mean_k": budget / len(shape.layers), "phase": phase, "method": METHOD,
               "data": data, "tokens": len(windows) * window, "window": window, "tol": tol,
               "max_rounds": max_rounds, "search": result.to_json()}
    uniform, searched = (phase_policies(layer_k_policy(shape, ks), phase) for ks in (result.uniform, result.ks))
    if heldout_docs > 0:
        held = heldout_windows(tokenizer, bundled_documents("heldout"), heldout_docs, window)
        scorer = HeldoutScorer(model, held)
        summary["heldout"] = {"tokens": len(held) * (window - window // 2), "uniform_kl": scorer.score(*uniform).kl,
                              "searched_kl": scorer.score(*searched).kl}
    plan = technique_plan(model, *searched, None, technique="layer-k", search=summary, command=command)
    if accuracy_n > 0:
        uniform_plan = technique_plan(model, *uniform)
        summary["accuracy"] = task_accuracy(model, tokenizer, {"full": None, "uniform": uniform_plan,
                                                               "searched": plan}, accuracy_n, tasks, seed)
        summary["accuracy_n"] = accuracy_n
    summary["seconds"] = round(time.time() - t0, 1)
    return plan, summary


POOL_METHOD = ("coordinate descent over transfers of STEP pool slots between MoE layers (total fixed), from the "
               "uniform pool; each pool keeps a layer's top experts by the criterion; each round takes the transfer "
               "that lowers next-token KL to the full model most (scored as served: prefill full, decode pooled)")


def search_pool(model, tokenizer, stats, criterion: str, keep: float, *, data: str = "tasks", tokens: int = 4096,
                window: int = 128, step: int = 4, phase: str = "decode", max_rounds: int = 20, tol: float = 1e-4,
                seed: int = 0, progress: bool = True, stats_path: str | None = None, command: str | None = None,
                log=None, novice: bool = False, protect_super: int = 0) -> tuple[Plan, dict]:
    """Per-layer static pool sizes from measured sensitivity: the same total as a uniform ``keep``
    plan, moved between layers ``step`` experts at a time where next-token KL on ``data`` says the
    layer needs them. Returns a pruning plan (``--layers`` budgets) and a summary. ``novice`` and
    ``protect_super`` are measured as they serve: a layer that loses an expert to its constant
    needs fewer kept places than one that loses it outright."""
    from ..plans.criteria import make_plan
    from ..plans.techniques import attach_plan_fold_tables

    t0 = time.time()
    shape = Shape.of(model)
    E, n = stats.model["num_experts"], len(shape.layers)
    uniform = max(shape.top_k, round(keep * E))
    plans: dict[tuple[int, ...], Plan] = {}

    def plan_of(sizes: list[int]) -> Plan:
        key = tuple(sizes)
        if key not in plans:
            plans[key] = make_plan(stats, model, criterion, layers=dict(zip(shape.layers, sizes)), phase=phase,
                                   stats_path=stats_path, command=command, novice=novice,
                                   protect_super=protect_super)
            if len(plans) == 1:
                attach_plan_fold_tables(model, plans[key])   # the novice constants, the same for every size
        return plans[key]

    def policy_of(sizes: list[int]) -> PhasePolicy:
        p = plan_of(sizes)
        return p.decode if phase == "decode" else p.prefill

    windows = calibration_windows(tokenizer, data, tokens, window, seed)
    search_phase = "decode" if phase == "decode" else "prefill" if phase == "prefill" else "both"
    result = search_k(model, windows, uniform * n, phase=search_phase, max_rounds=max_rounds, tol=tol,
                      start=[uniform] * n, progress=progress, log=log, policy_of=policy_of, low=shape.top_k,
                      high=E, step=step)
    plan = plan_of(result.ks)
    summary = {"criterion": criterion, "keep": keep, "novice": novice, "protect_super": protect_super, "step": step,
               "phase": phase, "method": POOL_METHOD,
               "data": data, "tokens": len(windows) * window, "window": window, "search": result.to_json(),
               "seconds": round(time.time() - t0, 1)}
    plan.meta["pool_search"] = summary
    return plan, summary
