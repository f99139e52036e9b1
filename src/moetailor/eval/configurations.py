"""Named evaluation configurations: how a base plan is applied to the two phases.

SlimWise's four (their Table 3) from one pruning policy P: baseline (full, full), pruned (P, P),
reverse (P prefill, full decode), phase-aware (full prefill, P decode). Other techniques register a
builder (``@configuration("fold-decode", uses_plan=False, takes_arg=True, help=...)``); the runner
only knows names. A spec names one, with an optional argument after a colon ("fold-decode:32").
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ..plans import Plan, uniform_plan
from ..routing.policy import LayerPolicy
from ..tables import unknown_choice


@dataclass(frozen=True)
class Serving:
    """What the engine is told to run for one configuration: a plan, and how to serve it."""

    plan: Plan
    guard: bool = False               # the collapse guard watches decode (serving/guard.py)
    decode_model: str | None = None   # decode on this checkpoint in a separate worker (disaggregated)


# builder(model, base_plan or None, argument or None) -> the plan the engine runs (served plainly),
# or a Serving when the configuration also says how to serve it
Builder = Callable[[object, Plan | None, str | None], "Plan | Serving"]


@dataclass(frozen=True)
class Configuration:
    name: str
    build: Builder
    uses_plan: bool    # the result depends on the base plan (so it is run once per plan in a sweep)
    takes_arg: bool
    help: str


CONFIGURATIONS: dict[str, Configuration] = {}
PHASE_CONFIGURATIONS = ("baseline", "pruned", "reverse", "phase-aware")


def configuration(name: str, *, uses_plan: bool, help: str, takes_arg: bool = False):
    """Register a configuration builder under ``name`` (a decorator)."""
    def register(fn: Builder) -> Builder:
        if name in CONFIGURATIONS:
            raise ValueError(f"configuration {name!r} is already registered")
        CONFIGURATIONS[name] = Configuration(name, fn, uses_plan, takes_arg, help)
        return fn
    return register


def _tagged(plan: Plan, name: str) -> Plan:
    return replace(plan, meta={**plan.meta, "configuration": name})


@configuration("baseline", uses_plan=False, help="full prefill, full decode")
def _baseline(model, plan, arg):
    return _tagged(plan.with_phases(None, None) if plan is not None else uniform_plan(model), "baseline")


def _merged(model, plan: Plan, name: str) -> Serving:
    """A plan that merges experts in decode, served as deployed: full prefill on the model, decode on
    its merged checkpoint (written once, ``transforms.merge.merged_checkpoint``) in the disaggregated
    engine; the plan the engine is told is the full router (the checkpoint holds the merge)."""
    from ..transforms.streaming import merged_checkpoint

    if plan.prefill.merges:
        raise ValueError(f"configuration {name!r} would merge experts in prefill, which runs on the original model "
                         "here; evaluate the merged checkpoint itself (`moetailor prune MODEL PLAN --out DIR`, then "
                         "`moetailor eval DIR --configs baseline`) or use --configs plan / phase-aware")
    source = getattr(model, "moetailor_source", None)
    if source is None:
        raise ValueError("a merged plan is evaluated on its merged checkpoint, written from the model's checkpoint "
                         "on disk; load the model from a directory or a bundled name")
    path = merged_checkpoint(source, plan, "decode")
    return Serving(_tagged(plan.with_phases(None, None), name), decode_model=str(path))


def _served(model, plan: Plan, name: str) -> Plan | Serving:
    """``plan`` tagged ``name``; a plan that merges experts is served on its merged checkpoint."""
    return _merged(model, plan, name) if plan.merges else _tagged(plan, name)


@configuration("pruned", uses_plan=True, help="the plan's pruning in both phases (a pruned checkpoint)")
def _pruned(model, plan, arg):
    p = plan.pruning_policy()
    return _served(model, plan.with_phases(prefill=p, decode=p), "pruned")


@configuration("reverse", uses_plan=True, help="pruned prefill, full decode")
def _reverse(model, plan, arg):
    return _served(model, plan.with_phases(prefill=plan.pruning_policy(), decode=None), "reverse")


@configuration("phase-aware", uses_plan=True, help="full prefill, pruned decode (SlimWise; a merged plan decodes "
               "on its merged checkpoint)")
def _phase_aware(model, plan, arg):
    return _served(model, plan.phase_aware(), "phase-aware")


@configuration("plan", uses_plan=True, help="the plan exactly as written (its own prefill and decode policies)")
def _as_written(model, plan, arg):
    return _served(model, plan, "plan")


def int_argument(value: str, name: str) -> int:
    """A configuration's integer argument (``topk:4``), or a ValueError saying how to write it."""
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} needs an integer argument ({name}:4), got {value!r}") from None


@configuration("topk", uses_plan=False, takes_arg=True, help="topk:K — every token uses K experts in both phases")
def _topk(model, plan, arg):
    k = int_argument(arg, "topk")
    return _tagged(uniform_plan(model, decode=LayerPolicy(top_k=k), prefill=LayerPolicy(top_k=k)), f"topk:{k}")


@configuration("guarded", uses_plan=True, takes_arg=True,
               help="guarded:CONFIG — CONFIG (e.g. phase-aware) served with the collapse guard on (serving/guard.py)")
def _guarded(model, plan, arg):
    inner = parse_configs(arg)[0]
    if inner.name == "guarded":
        raise ValueError("guarded:guarded:... is redundant; name the configuration to guard once")
    served = inner.build(model, plan)
    return replace(served, plan=_tagged(served.plan, f"guarded:{inner.label}"), guard=True)


@configuration("distilled", uses_plan=False, takes_arg=True,
               help="distilled:DIR — full prefill on MODEL, decode on a `moetailor distill` output under its plan "
                    "(phase-aware + distilled; served disaggregated)")
def _distilled(model, plan, arg):
    from ..models.loading import fingerprint_mismatch, model_fingerprint
    from ..transforms.artifacts import load_distilled

    distilled = load_distilled(arg)
    source = distilled.plan.meta.get("distillation", {}).get("distilled_from", {})
    problem = fingerprint_mismatch(source, model_fingerprint(model))
    if problem:
        raise ValueError(f"{arg} was distilled from another model ({problem}); evaluate it with its original model")
    # The plan is stated for the evaluated model (the prefill side, same expert layout); the decode
    # worker runs the distilled checkpoint under the plan saved with it (its own fingerprint).
    built = replace(distilled.plan.with_phases(prefill=None, decode=distilled.plan.decode),
                    model=model_fingerprint(model))
    return Serving(_tagged(built, f"distilled:{arg}"), decode_model=str(distilled.model_path))


@dataclass(frozen=True)
class ConfigSpec:
    name: str
    arg: str | None = None

    @property
    def label(self) -> str:
        return self.name if self.arg is None else f"{self.name}:{self.arg}"

    @property
    def definition(self) -> Configuration:
        return CONFIGURATIONS[self.name]

    def build(self, model, plan: Plan | None) -> Serving:
        if self.definition.uses_plan and plan is None:
            raise ValueError(f"configuration {self.label!r} needs a plan; pass --plan PLAN or --sweep SPEC")
        built = self.definition.build(model, plan, self.arg)
        served = built if isinstance(built, Serving) else Serving(built)
        served.plan.check_model(model)
        return served


def parse_configs(spec: str | list[str]) -> list[ConfigSpec]:
    """'baseline,pruned,fold-decode:32' -> validated specs (unknown names list the valid ones)."""
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if not items:
        raise ValueError(f"no configurations given; valid: {', '.join(CONFIGURATIONS)}")
    out = []
    for item in items:
        name, _, arg = item.partition(":")
        if name not in CONFIGURATIONS:
            raise ValueError(unknown_choice("configuration", name, CONFIGURATIONS))
        c = CONFIGURATIONS[name]
        if c.takes_arg and not arg:
            raise ValueError(f"configuration {name!r} needs an argument ({c.help})")
        if not c.takes_arg and arg:
            raise ValueError(f"configuration {name!r} takes no argument, got {item!r}")
        out.append(ConfigSpec(name, arg or None))
    if len({s.label for s in out}) != len(out):
        raise ValueError(f"configuration list {items} names one configuration twice")
    return out
