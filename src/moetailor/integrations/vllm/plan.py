"""A moetailor plan as vLLM sees it: read from ``additional_config``, checked against the checkpoint
vLLM serves, turned into per-layer router biases. Imports no vLLM (the launcher checks plans before
it starts vLLM, and the main environment has no vLLM).

The channel is vLLM's ``additional_config`` (``--additional-config`` / ``LLM(additional_config=...)``):
it reaches every process of the engine and is part of vLLM's config hash::

    {"moetailor_decode_plan": "plan.json"}   # prefill full, the plan's decode policy on decode tokens
    {"moetailor_plan": "plan.json"}          # the plan's prefill and decode policies, as written

A token is a decode token when its position is at or past its request's prompt length; prefill
tokens (also those of a chunked prompt) get the prefill policy. vLLM routes top-k over logits then
softmaxes the k (or scales by the full softmax's normaliser), so a -inf bias on the logits of
dropped experts is exactly moetailor's "mask" pool (= a pruned checkpoint). Policies other than
``keep`` (pool_mode "mask") and ``top_k`` need the routes themselves (folding, skipping) and are
refused with a line that says so.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ...models.architectures import arch_spec
from ...plans.plan import Plan, PlanMismatch
from ...routing.policy import LayerPolicy

PLAN_KEY = "moetailor_plan"
DECODE_PLAN_KEY = "moetailor_decode_plan"
EXPERT_TOP_K = "expert_top_k"  # SamplingParams.extra_args key (OpenAI: top-level field or vllm_xargs)


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
    """moetailor's model fingerprint (``model_fingerprint``) computed from a checkpoint's files,
    without building the model: config facts plus the hash of the router weights read as fp32."""
    from safetensors import safe_open
    from transformers import AutoConfig

    path = Path(path)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    spec = arch_spec(config)
    num_experts = spec.num_experts(config)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors weights; moetailor reads router weights from them")
    tensors = {}
    for f in files:
        with safe_open(f, "pt") as st:
            for key in st.keys():
                if key.endswith(".gate.weight") and ".experts." not in key and ".layers." in key:
                    if tuple(st.get_slice(key).get_shape())[0] == num_experts:
                        tensors[int(key.split(".layers.")[1].split(".")[0])] = st.get_tensor(key)
    layers = sorted(tensors)
    h = hashlib.sha256()
    for i in layers:
        h.update(tensors[i].detach().float().cpu().numpy().tobytes())
    return {"model_type": config.model_type, "moe_layers": layers, "num_experts": num_experts,
            "top_k": int(config.num_experts_per_tok), "router_hash": h.hexdigest()[:16], "source": str(path)}


def load_checked_plan(path: str | Path, mode: str, checkpoint: str | Path) -> Plan:
    """Load a plan and check it against the checkpoint vLLM serves; raise one user-facing line."""
    from ...models.loading import fingerprint_mismatch

    plan = Plan.load(path)
    if mode == "decode":
        plan = plan.phase_aware()
    fp = checkpoint_fingerprint(checkpoint)
    problem = fingerprint_mismatch(plan.model, fp)
    if problem:
        raise PlanMismatch(f"plan {path} does not match the model vLLM serves ({problem}); make the plan from "
                           f"statistics of this model (`moetailor calibrate` then `moetailor plan`)")
    for phase in ("prefill", "decode"):
        for layer, policy in plan.phase(phase).layers.items():
            where = f"{phase} layer {layer}"
            policy.validate(fp["num_experts"], fp["top_k"], where=where)
            if policy != LayerPolicy(keep=policy.keep, top_k=policy.top_k):
                raise ValueError(f"plan {path} ({where}) uses {_unsupported(policy)}, which the vLLM plugin does not "
                                 f"apply (it masks router logits and trims top-k); serve this plan with moetailor's "
                                 f"engine, or use a plan with only keep/top_k")
            if layer not in fp["moe_layers"]:
                raise ValueError(f"plan {path} names MoE layer {layer}, the model's MoE layers are {fp['moe_layers']}")
    return plan


def _unsupported(policy: LayerPolicy) -> str:
    fields = {k: v for k, v in policy.to_json().items() if k not in ("keep", "top_k")}
    return ", ".join(f"{k}={v}" for k, v in fields.items())


@dataclass
class RouterTables:
    """What the vLLM layers read per MoE layer, per phase (index 0 = prefill, 1 = decode)."""

    bias: dict[int, torch.Tensor]      # layer -> [2, E] float: 0 for allowed experts, -inf for dropped
    top_k: dict[int, tuple[int, int]]  # layer -> (prefill k, decode k)
    model_k: int
    phase_aware: bool                  # the two phases differ (prefix caching must be off)


def router_tables(plan: Plan, num_experts: int, model_k: int) -> RouterTables:
    bias, top_k = {}, {}
    for layer in plan.model["moe_layers"]:
        policies = (plan.prefill.for_layer(layer), plan.decode.for_layer(layer))
        b = torch.zeros(2, num_experts)
        for row, p in enumerate(policies):
            if p.keep is not None:
                b[row] = float("-inf")
                b[row, list(p.keep)] = 0.0
        bias[layer] = b
        top_k[layer] = tuple(p.top_k or model_k for p in policies)
    return RouterTables(bias, top_k, model_k, phase_aware=plan.prefill != plan.decode)
