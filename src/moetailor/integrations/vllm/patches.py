"""The three vLLM methods the plugin wraps (see the package docstring)."""
from __future__ import annotations

import functools

from vllm.logger import init_logger

from .plan import EXPERT_TOP_K, load_checked_plan, plan_settings, router_tables

log = init_logger("moetailor.vllm")


def apply_patches() -> None:
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runners = [GPUModelRunner]
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
        runners.append(CPUModelRunner)
    except ImportError:  # a CUDA build without the CPU runner
        pass
    for cls in runners:
        if "load_model" in cls.__dict__:
            cls.load_model = _wrap_load_model(cls.__dict__["load_model"])
    GPUModelRunner._prepare_inputs = _wrap_prepare_inputs(GPUModelRunner._prepare_inputs)
    InputProcessor._validate_params = _wrap_validate_params(InputProcessor._validate_params)


def _wrap_load_model(load_model):
    @functools.wraps(load_model)
    def wrapped(self, *args, **kwargs):
        result = load_model(self, *args, **kwargs)
        setup_model(self)
        return result
    return wrapped


def setup_model(runner) -> None:
    """Check the plan (if any) and hook the model's MoE layers; a bad plan stops the start."""
    from .routing import StepTokens, install, moe_runners

    config = runner.vllm_config
    hf = config.model_config.hf_config
    model = runner.get_model()
    if not moe_runners(model):
        return
    model_k = int(getattr(hf, "num_experts_per_tok"))
    tables = None
    settings = plan_settings(config.additional_config)
    if settings:
        path, mode = settings
        plan = load_checked_plan(path, mode, config.model_config.model)
        num_experts = plan.model["num_experts"]
        tables = router_tables(plan, num_experts, model_k)
        if tables.phase_aware and config.cache_config.enable_prefix_caching:
            raise ValueError(
                "a moetailor plan whose decode policy differs from its prefill policy needs prefix caching off "
                "(--no-enable-prefix-caching, or enable_prefix_caching=False): vLLM caches blocks of generated "
                "tokens, computed under the decode policy, and would serve them to later prompts as prefill")
    tokens = StepTokens(runner.max_num_tokens, model_k, runner.device)
    layers = install(model, tables, tokens)
    runner._moetailor_tokens = tokens
    log.info("moetailor: hooked %d MoE layers (plan: %s)", layers, settings[0] if settings else "none")


def _wrap_prepare_inputs(prepare_inputs):
    @functools.wraps(prepare_inputs)
    def wrapped(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
        tokens = getattr(self, "_moetailor_tokens", None)
        if tokens is not None:
            tokens.prepare(self, num_scheduled_tokens)
        return prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)
    return wrapped


def _wrap_validate_params(validate_params):
    @functools.wraps(validate_params)
    def wrapped(self, params, *args, **kwargs):
        result = validate_params(self, params, *args, **kwargs)
        extra = getattr(params, "extra_args", None) or {}
        if EXPERT_TOP_K in extra:
            from vllm.exceptions import VLLMValidationError

            from ...engine.k_tiers import validate_expert_top_k

            k, model_k = extra[EXPERT_TOP_K], getattr(self.model_config.hf_config, "num_experts_per_tok", None)
            try:
                if model_k is None:
                    raise ValueError(f"{EXPERT_TOP_K} applies to Mixture-of-Experts models; this model has no experts")
                validate_expert_top_k(int(k) if isinstance(k, float) and k.is_integer() else k, int(model_k))
            except ValueError as e:
                raise VLLMValidationError(str(e), parameter=EXPERT_TOP_K) from None
        return result
    return wrapped

