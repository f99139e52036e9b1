"""A moetailor plan as vLLM sees it: read from ``additional_config``, checked against the checkpoint
vLLM serves, compiled into the engine's per-layer routing tables. Imports no vLLM (the launcher
checks plans before it starts vLLM, and the main environment has no vLLM).

The channel is vLLM's ``additional_config`` (``--additional-config`` / ``LLM(additional_config=...)``):
it reaches every process of the engine and is part of vLLM's config hash::

    {"moetailor_decode_plan": "plan.json"}   # prefill full, the plan's decode policy on decode tokens
    {"moetailor_plan": "plan.json"}          # the plan's prefill and decode policies, as written

A token is a decode token when its position is at or past its request's prompt length; prefill
tokens (also those of a chunked prompt) get the prefill policy. Every ``LayerPolicy`` field applies
(pools in each mode, top_k, dynamic skipping, token and batch pools, stacked, novice pools): the hooks
call the engine's ``routing.router.route`` with the ``CompiledPolicy`` built here, so plugin and engine
share one representation. Folding and novice policies need the plan's ``fold_stats`` (ExFold tables;
each expert's mean output, the novice constants).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ...models.architectures import RouterSemantics, arch_spec
from ...plans.plan import Plan, PlanMismatch
from ...routing.budgets import budget_of
from ...routing.policy import FULL, LayerPolicy
from ...routing.router import CompiledPolicy

PLAN_KEY = "moetailor_plan"
DECODE_PLAN_KEY = "moetailor_decode_plan"
EXPERT_TOP_K = "expert_top_k"  # SamplingParams.extra_args key (OpenAI: top-level field or vllm_xargs)
# SamplingParams.extra_args key: prompt positions from this one on run under the decode policy, as
# generated tokens would (how ``moetailor eval --backend vllm`` scores a plan's decode phase on held-out
# text through prompt logprobs: the prefix under the prefill policy, the rest under the decode policy)
DECODE_FROM = "moetailor_decode_from"
# additional_config key: every MoE layer adds novice constants (``routing.step_constants``) from the start,
# so that plans switched in later (``rpc.use_plan``) may replace experts by constants; a start plan with
# novice pools hooks its own layers without it
NOVICE_KEY = "moetailor_novice"


def request_top_k(sampling_params, model_k: int) -> int:
    """A request's budget (``expert_top_k`` in its ``extra_args``; none: the model's k)."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    return budget_of(extra.get(EXPERT_TOP_K), model_k)


def plan_settings(additional_config) -> tuple[str, str] | None:
    """(path, "plan" | "decode") from vLLM's additional_config, or None when no plan is given."""
    if not isinstance(additional_config, dict):
        return None
    given = [k for k in (PLAN_KEY, DECODE_PLAN_KEY) if additional_config.get(k)]
    if len(given) > 1:
        raise ValueError(f"additional_config names both {PLAN_KEY} and {DECODE_PLAN_KEY}; give one")
    if not given:
        return None
    return str(additional_config[given[0]]), ("plan" if given[0] == PLAN_KEY else "decode")


def checkpoint_fingerprint(path: str | Path) -> dict:
    """moetailor's model fingerprint (``models.loading.fingerprint``, as ``model_fingerprint`` computes
    it) from a checkpoint's files, without building the model: its config plus the router weights
    read from the safetensors shards."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from ...models.loading import fingerprint

    path = Path(path)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    num_experts = arch_spec(config).num_experts(config)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors weights; moetailor reads router weights from them")
    routers = {}
    for f in files:
        with safe_open(f, "pt") as st:
            for key in st.keys():
                if key.endswith(".gate.weight") and ".experts." not in key and ".layers." in key:
                    if tuple(st.get_slice(key).get_shape())[0] == num_experts:
                        routers[int(key.split(".layers.")[1].split(".")[0])] = st.get_tensor(key)
    return fingerprint(config, routers, path)


def load_checked_plan(path: str | Path, mode: str, checkpoint: str | Path) -> Plan:
    """Load a plan and check it against the checkpoint vLLM serves; raise one user-facing line."""
    from ...models.loading import fingerprint_mismatch

    plan = Plan.load(path)
    if mode == "decode":
        plan = plan.phase_aware()
    if plan.merges:
        raise ValueError(f"plan {path} merges experts, which changes their weights; write the merged checkpoint with "
                         "`moetailor prune MODEL PLAN --out DIR` and serve DIR with stock vLLM (all phases), or decode "
                         "on it: `moetailor serve MODEL --backend vllm --decode-model DIR`")
    fp = checkpoint_fingerprint(checkpoint)
    problem = fingerprint_mismatch(plan.model, fp)
    if problem:
        raise PlanMismatch(f"plan {path} does not match the model vLLM serves ({problem}); make the plan from "
                           f"statistics of this model (`moetailor calibrate` then `moetailor plan`)")
    for phase in ("prefill", "decode"):
        for layer, policy in plan.phase(phase).layers.items():
            policy.validate(fp["num_experts"], fp["top_k"], where=f"{phase} layer {layer}")
            if layer not in fp["moe_layers"]:
                raise ValueError(f"plan {path} names MoE layer {layer}, the model's MoE layers are {fp['moe_layers']}")
    router_tables(plan, checkpoint, where=str(path))   # fold tables, constants present and matching; all compile
    return plan


def plan_stats(plan: Plan, checkpoint: str | Path, where: str, rerun: str):
    """The statistics file the plan names (``plan.fold_stats``, found by the one reader every verb
    uses, ``Plan.fold_tables_path``), checked against the checkpoint vLLM serves."""
    from ...calibration import ExpertStats
    from ...models.loading import fingerprint_mismatch

    stats_path = plan.fold_tables_path()
    stats = ExpertStats.load(stats_path)
    problem = fingerprint_mismatch(stats.model, checkpoint_fingerprint(checkpoint))
    if problem:
        raise PlanMismatch(f"{where}: statistics {stats_path} do not match the model vLLM serves ({problem}); "
                           f"run `{rerun}` on this model")
    return stats


def fold_tables_for(plan: Plan, checkpoint: str | Path, where: str = "the plan") -> dict:
    """The ExFold tables the plan's folding policies read, checked against the checkpoint; {} when the
    plan folds nothing."""
    if not plan.needs_fold_tables:
        return {}
    stats = plan_stats(plan, checkpoint, where, "moetailor calibrate --fold")
    if not stats.has_fold:
        raise ValueError(f"{where}: {plan.fold_tables_path()} holds no fold tables; rerun `moetailor calibrate ... --fold`")
    return stats.fold_tables()


def constants_for(plan: Plan, checkpoint: str | Path, where: str = "the plan") -> dict[int, torch.Tensor]:
    """Per MoE layer, the novice constants [E, H] (each expert's mean output, as the engine's
    ``attach_constants`` reads them) from the plan's statistics, checked against the checkpoint; {}
    when no policy replaces experts by constants."""
    if not plan.needs_constants:
        return {}
    stats = plan_stats(plan, checkpoint, where, "moetailor calibrate")
    stats.require_outputs("a novice plan")
    return {i: layer.mean_output.float() for i, layer in stats.layers.items()}


@dataclass
class RouterTables:
    """What the vLLM layers read: per MoE layer, the engine's compiled policy of each phase."""

    semantics: RouterSemantics
    policies: dict[int, tuple[CompiledPolicy, CompiledPolicy]]  # layer -> (prefill, decode)
    model_k: int
    phase_aware: bool                  # the two phases differ (prefix caching must be off)

    def width(self, layer: int) -> int:
        """Routes per token the layer emits: the largest k either phase routes (static)."""
        return max(cp.policy.top_k or self.model_k for cp in self.policies[layer])

    def mask_bias(self, layer: int) -> torch.Tensor | None:
        """[2, E] 0 / -inf per phase when both phases are plain masks (no other field), else None:
        what a fused kernel that routes inside itself can still apply."""
        rows = []
        for cp in self.policies[layer]:
            p = cp.policy
            if p != LayerPolicy(keep=p.keep):
                return None
            row = torch.zeros(self.semantics.num_experts)
            if p.keep is not None:
                row.fill_(float("-inf"))
                row[list(p.keep)] = 0.0
            rows.append(row)
        return torch.stack(rows)


def router_tables(plan: Plan | None, checkpoint: str | Path, device="cpu", where: str = "the plan") -> RouterTables:
    """The plan's policies compiled per MoE layer (``CompiledPolicy.build``, as the engine does), for
    every MoE layer of the checkpoint; None = the full router in both phases."""
    from transformers import AutoConfig

    from ...models.adapters import semantics_for

    config = AutoConfig.from_pretrained(checkpoint, local_files_only=True)
    sem = semantics_for(config, arch_spec(config))     # as ``moe_layers`` reads them
    fp = checkpoint_fingerprint(checkpoint)
    tables = fold_tables_for(plan, checkpoint, where) if plan is not None else {}
    constants = constants_for(plan, checkpoint, where) if plan is not None else {}
    policies = {}
    for layer in fp["moe_layers"]:
        pair = []
        for phase in ("prefill", "decode"):
            policy = plan.phase(phase).for_layer(layer) if plan is not None else FULL
            try:
                pair.append(CompiledPolicy.build(policy, sem, device, tables.get(layer), constants.get(layer)))
            except ValueError as e:
                raise ValueError(f"{where} ({phase} layer {layer}): {e}") from None
        policies[layer] = tuple(pair)
    phase_aware = plan is not None and plan.prefill != plan.decode
    return RouterTables(sem, policies, sem.top_k, phase_aware)
