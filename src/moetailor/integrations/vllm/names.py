"""Every vLLM name the plugin patches, wraps, subclasses, calls or reads, in one registry. It drives
both the patching (``patches.py`` looks each wrapped method up here) and the version check
(``check_vllm``), and ``scripts/vllm_names.py`` reads a vLLM wheel to record which entries each
version has (``vllm_names.json``; ``tests/integrations/vllm/test_vllm_names.py`` checks the two agree). Imports no vLLM.

vLLM has two model-runner generations, and the plugin one adapter per generation (``runners.py`` says
what each wraps): ``v1``, ``vllm/v1/worker/gpu_model_runner.py`` (and the CPU runner built on it), and
``v2``, ``vllm/v1/worker/gpu/model_runner.py`` (and ``cpu/model_runner.py`` on it; 0.34.0's
``cpu/standalone_model_runner.py``, for CPUs without Triton, follows the same protocol). 0.32.0 and
0.33.0 ship both (v1 is the default on CPU, v2 on CUDA with Triton in 0.33.0;
``VLLM_USE_V2_MODEL_RUNNER`` picks), 0.34.0 only v2.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# vLLM versions the plugin accepts, and the runner generations each ships
SUPPORTED = {"0.32.0": ("v1", "v2"), "0.33.0": ("v1", "v2"), "0.34.0": ("v2",)}
FACTS = Path(__file__).with_name("vllm_names.json")   # written by scripts/vllm_names.py


@dataclass(frozen=True)
class VName:
    """One vLLM name. ``kind``: class, function, method, attribute (an instance field, property or
    dataclass field of the class) or parameter (a weight the class registers on a layer); ``params``: the leading parameter names of a method or function the
    plugin calls or wraps; ``runner``: the runner generation it belongs to (None: every one)."""

    module: str
    qualname: str
    kind: str
    use: str                       # wraps, replaces (per instance), subclasses, calls, reads
    params: tuple[str, ...] = ()
    runner: str | None = None
    optional: bool = False         # read with a default where absent (recorded, never required)

    @property
    def key(self) -> str:
        return f"{self.module}:{self.qualname}"

    @property
    def owner(self) -> str:
        """The class of a method or attribute (its qualname without the last part)."""
        return self.qualname.rpartition(".")[0]


def _names(module: str, owner: str, kind: str, use: str, fields: str, runner: str | None = None,
           optional: bool = False) -> list[VName]:
    return [VName(module, f"{owner}.{f}", kind, use, runner=runner, optional=optional) for f in fields.split()]


V1_RUNNER = "vllm.v1.worker.gpu_model_runner"
V1_CPU_RUNNER = "vllm.v1.worker.cpu_model_runner"
V1_BATCH = "vllm.v1.worker.gpu_input_batch"
V2_RUNNER = "vllm.v1.worker.gpu.model_runner"
V2_CPU_RUNNER = "vllm.v1.worker.cpu.model_runner"
V2_STATE = "vllm.v1.worker.gpu.model_states.interface"
V2_BATCH = "vllm.v1.worker.gpu.input_batch"
V2_STATES = "vllm.v1.worker.gpu.states"
# 0.34.0's v2 runner for CPUs without Triton (not x86): the same model_state protocol, its own classes
V2_STANDALONE = "vllm.v1.worker.cpu.standalone_model_runner"
FUSED_MOE = "vllm.model_executor.layers.fused_moe"
CPU_EXPERTS = f"{FUSED_MOE}.experts.cpu_moe"
SCHED = "vllm.v1.core.sched"
KV_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"

REGISTRY: tuple[VName, ...] = tuple([
    # ---- the plugin's vLLM entry points, any runner ----
    VName("vllm.logger", "init_logger", "function", "calls", ("name",)),
    VName("vllm.exceptions", "VLLMValidationError", "class", "calls"),
    VName("vllm.v1.engine.input_processor", "InputProcessor._validate_params", "method", "wraps",
          ("self", "params", "supported_tasks")),
    VName("vllm.v1.engine.input_processor", "InputProcessor.model_config", "attribute", "reads"),
    # ---- v1 runner ----
    VName(V1_RUNNER, "GPUModelRunner.load_model", "method", "wraps", ("self", "load_dummy_weights"), "v1"),
    VName(V1_CPU_RUNNER, "CPUModelRunner.load_model", "method", "wraps", ("self", "load_dummy_weights"), "v1"),
    VName(V1_RUNNER, "GPUModelRunner._prepare_inputs", "method", "wraps",
          ("self", "scheduler_output", "num_scheduled_tokens"), "v1"),
    VName(V1_RUNNER, "GPUModelRunner.get_model", "method", "calls", ("self",), "v1"),
    *_names(V1_RUNNER, "GPUModelRunner", "attribute", "reads", "vllm_config device max_num_tokens input_batch requests",
            "v1"),
    *_names(V1_BATCH, "InputBatch", "attribute", "reads", "num_reqs req_ids num_computed_tokens_cpu num_prompt_tokens",
            "v1"),
    VName(V1_BATCH, "CachedRequestState.sampling_params", "attribute", "reads", runner="v1"),
    # ---- v2 runner ----
    VName(V2_RUNNER, "GPUModelRunner.load_model", "method", "wraps", ("self", "load_dummy_weights"), "v2"),
    VName(V2_CPU_RUNNER, "CPUModelRunner", "class", "reads", runner="v2"),
    VName(V2_RUNNER, "GPUModelRunner.get_model", "method", "calls", ("self",), "v2"),
    *_names(V2_RUNNER, "GPUModelRunner", "attribute", "reads", "vllm_config device max_num_tokens model_state", "v2"),
    VName(V2_STATE, "ModelState.add_request", "method", "wraps", ("self", "req_index", "new_req_data"), "v2"),
    VName(V2_STATE, "ModelState.prepare_inputs", "method", "wraps", ("self", "input_batch", "req_states"), "v2"),
    VName(f"{SCHED}.output", "NewRequestData.sampling_params", "attribute", "reads", runner="v2"),
    *_names(V2_BATCH, "InputBatch", "attribute", "reads",
            "num_reqs idx_mapping_np num_scheduled_tokens num_computed_tokens_np", "v2"),
    VName(V2_STATES, "RequestState.prompt_len", "attribute", "reads", runner="v2"),
    VName(V2_STANDALONE, "StandaloneCPUModelRunner.load_model", "method", "wraps", ("self", "load_dummy_weights"), "v2",
          optional=True),
    *_names(V2_STANDALONE, "StandaloneCPUModelRunner", "attribute", "reads",
            "vllm_config device max_num_tokens model_state req_states", "v2", optional=True),
    VName("vllm.v1.worker.cpu.model_states.interface", "ModelState.add_request", "method", "wraps",
          ("self", "req_index", "new_req_data"), "v2", optional=True),
    VName("vllm.v1.worker.cpu.model_states.interface", "ModelState.prepare_inputs", "method", "wraps",
          ("self", "input_batch", "req_states"), "v2", optional=True),
    *_names("vllm.v1.worker.cpu.input_batch", "InputBatch", "attribute", "reads",
            "num_reqs idx_mapping_np num_scheduled_tokens num_computed_tokens_np", "v2", optional=True),
    VName("vllm.v1.worker.cpu.states", "CPURequestState.prompt_len", "attribute", "reads", runner="v2", optional=True),
    # ---- MoE layers: routing hook (routing.py) ----
    VName(f"{FUSED_MOE}.runner.moe_runner", "MoERunner", "class", "reads"),
    *_names(f"{FUSED_MOE}.runner.moe_runner", "MoERunner", "attribute", "reads", "layer_id router routed_experts"),
    VName(f"{FUSED_MOE}.runner.moe_runner", "MoERunner._apply_quant_method", "method", "replaces",
          ("self", "hidden_states", "router_logits")),
    VName(f"{FUSED_MOE}.router.fused_moe_router", "FusedMoERouter.select_experts", "method", "replaces",
          ("self", "hidden_states", "router_logits", "topk_indices_dtype", "input_ids")),
    VName(f"{FUSED_MOE}.routed_experts", "RoutedExperts.quant_method", "attribute", "reads"),
    # a layer parameter the unquantized method registers on the experts layer (layer.w13_weight)
    VName(f"{FUSED_MOE}.unquantized_fused_moe_method", "UnquantizedFusedMoEMethod.w13_weight", "parameter", "reads"),
    VName(f"{FUSED_MOE}.fused_moe_method_base", "FusedMoEMethodBase.is_monolithic", "attribute", "reads"),
    VName(f"{FUSED_MOE}.fused_moe_modular_method", "FusedMoEModularMethod.moe_kernel", "attribute", "reads"),
    VName(f"{FUSED_MOE}.modular_kernel", "FusedMoEKernel.fused_experts", "attribute", "reads"),
    # ---- moetailor's experts kernel (experts.py), CPU builds ----
    VName(CPU_EXPERTS, "CPUUnquantizedExperts.process_weights_after_loading", "method", "wraps", ("self", "layer")),
    VName(CPU_EXPERTS, "CPUUnquantizedExperts.apply", "method", "wraps",
          ("self", "output", "hidden_states", "w1", "w2", "topk_weights", "topk_ids", "activation",
           "global_num_experts", "expert_map")),
    VName(CPU_EXPERTS, "CPUUnquantizedExperts.moe_problem_size", "method", "wraps", ("self", "a1", "w1", "w2", "topk_ids")),
    VName(CPU_EXPERTS, "CPUUnquantizedExperts.moe_config", "attribute", "reads"),
    VName(f"{FUSED_MOE}.activation", "MoEActivation", "class", "reads"),
    *_names(f"{FUSED_MOE}.config", "FusedMoEConfig", "attribute", "reads",
            "activation intermediate_size_per_partition w13_num_shards"),
    VName("vllm.model_executor.utils", "replace_parameter", "function", "calls", ("layer", "param_name", "new_tensor")),
    # ---- the k-aware scheduler (scheduler.py) ----
    VName(f"{SCHED}.scheduler", "Scheduler.__init__", "method", "subclasses", ("self", "vllm_config")),
    VName(f"{SCHED}.scheduler", "Scheduler.schedule", "method", "subclasses", ("self",)),
    VName(f"{SCHED}.scheduler", "Scheduler.update_from_output", "method", "subclasses",
          ("self", "scheduler_output", "model_runner_output")),
    VName(f"{SCHED}.scheduler", "Scheduler._free_request", "method", "subclasses", ("self", "request")),
    VName(f"{SCHED}.scheduler", "Scheduler.shutdown", "method", "subclasses", ("self",)),
    *_names(f"{SCHED}.scheduler", "Scheduler", "attribute", "reads", "running waiting requests current_step "
            "max_num_running_reqs"),
    VName(f"{SCHED}.request_queue", "FCFSRequestQueue", "class", "reads"),
    *_names("vllm.v1.request", "Request", "attribute", "reads", "request_id sampling_params num_computed_tokens "
            "num_prompt_tokens arrival_time next_decode_eligible_step prompt_token_ids"),
    VName(f"{SCHED}.output", "SchedulerOutput.num_scheduled_tokens", "attribute", "reads"),
    # ---- the KV connector (connector.py) ----
    VName(KV_BASE, "KVConnectorBase_V1.__init__", "method", "subclasses", ("self", "vllm_config", "role",
                                                                             "kv_cache_config")),
    *[VName(KV_BASE, f"KVConnectorBase_V1.{m}", "method", "subclasses", p) for m, p in (
        ("get_num_new_matched_tokens", ("self", "request", "num_computed_tokens")),
        ("update_state_after_alloc", ("self", "request", "blocks", "num_external_tokens")),
        ("build_connector_meta", ("self", "scheduler_output")),
        ("request_finished", ("self", "request", "block_ids")),
        ("start_load_kv", ("self", "forward_context")),
        ("wait_for_layer_load", ("self", "layer_name")),
        ("save_kv_layer", ("self", "layer_name", "kv_layer", "attn_metadata")),
        ("wait_for_save", ("self",)),
        ("_get_connector_metadata", ("self",)))],
    VName(KV_BASE, "KVConnectorBase_V1._kv_transfer_config", "attribute", "reads"),
    VName(KV_BASE, "KVConnectorMetadata", "class", "subclasses"),
    VName(KV_BASE, "KVConnectorRole", "class", "reads"),
    *_names(f"{SCHED}.output", "SchedulerOutput", "attribute", "reads", "scheduled_new_reqs scheduled_cached_reqs"),
    *_names(f"{SCHED}.output", "NewRequestData", "attribute", "reads", "req_id prompt_token_ids block_ids "
            "num_computed_tokens"),
    *_names(f"{SCHED}.output", "CachedRequestData", "attribute", "reads", "req_ids new_block_ids num_computed_tokens"),
    # gone in 0.34.0, where a resumed request is sent again in full among the new ones
    VName(f"{SCHED}.output", "CachedRequestData.resumed_req_ids", "attribute", "reads", optional=True),
    VName("vllm.forward_context", "ForwardContext.no_compile_layers", "attribute", "reads"),
    # ---- calibration from served traffic (observe.py) ----
    VName(V1_BATCH, "InputBatch.token_ids_cpu", "attribute", "reads", runner="v1"),
    VName("vllm.v1.worker.gpu_worker", "Worker.shutdown", "method", "wraps", ("self",)),
    VName("vllm.config.model", "ModelConfig.enforce_eager", "attribute", "reads"),
    *_names("vllm.config.parallel", "ParallelConfig", "attribute", "reads",
            "pipeline_parallel_size data_parallel_size tensor_parallel_size"),
    VName("vllm.distributed.parallel_state", "get_tensor_model_parallel_rank", "function", "calls"),
])

BY_KEY = {n.key: n for n in REGISTRY}
# modules a build may lack (vLLM's CPU fused-MoE, which moetailor's experts kernel replaces): the check
# skips their entries there, and the plugin patches nothing of them
BUILD_OPTIONAL_MODULES = (CPU_EXPERTS,)


def name(module: str, qualname: str) -> VName:
    """The registry entry of a name the plugin touches (a KeyError names one missing from the registry)."""
    return BY_KEY[f"{module}:{qualname}"]


def generations(version: str) -> tuple[str, ...]:
    return SUPPORTED.get(version, ())


def required(entry: VName, runners) -> bool:
    """Whether the entry must exist in a vLLM whose model runner generations are ``runners`` (a
    v1-runner name need not in 0.34.0)."""
    return not entry.optional and (entry.runner is None or entry.runner in runners)


def vllm_class(module: str, cls: str):
    """The class, or None where this build cannot import it (check_vllm has refused a vLLM that lacks
    a required one)."""
    import importlib

    try:
        return getattr(importlib.import_module(module), cls)
    except Exception:
        return None


def wrap_method(module: str, qualname: str, wrapper, own: bool = False) -> bool:
    """Replace a registered vLLM method with ``wrapper(method)`` (a name missing from the registry is a
    KeyError: every name the plugin patches is registered, so the version check covers it). ``own``:
    only a method the class defines itself. False when the class or method is not there; a method
    wrapped already is left as it is."""
    entry = name(module, qualname)
    owner, _, member = entry.qualname.rpartition(".")
    cls = vllm_class(module, owner)
    if cls is None or (own and member not in cls.__dict__) or not hasattr(cls, member):
        return False
    current = cls.__dict__[member] if own else getattr(cls, member)
    if getattr(current, "_moetailor_wrapper", False):     # patched already (idempotent)
        return True
    wrapped = wrapper(current)
    wrapped._moetailor_wrapper = True
    setattr(cls, member, wrapped)
    return True
