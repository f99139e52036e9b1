"""Calibration statistics from the traffic a vLLM engine serves: the file ``moetailor calibrate``
writes, accumulated by the plugin while vLLM serves, for ``moetailor plan`` to read unchanged.

Opt in per engine through ``additional_config``::

    {"moetailor_observe": "stats.safetensors"}            # written at shutdown and on demand
    {"moetailor_observe": "stats.safetensors", "moetailor_observe_every": 500}   # and every 500 steps

On demand: ``rpc.call(llm, rpc.save_observed)`` (a function for ``LLM.collective_rpc``). The
statistics are calibration's (``calibration.observe.ObservedStats``, the embedded engine's too); this
module only says what a vLLM step is and where its sums are kept:

  * the runner adapter (``runners.py``) reports each step before its forward: how many tokens it
    schedules, which are decode tokens and, on the v1 runner, their token ids (``data_sha256``; the v2
    runner's ids stay on the device, so its files carry no hash), and arms every layer to count the
    step once. Tokens past that count are padding (``live`` False) and never observed;
  * each hooked MoE layer's routing op (``torch.ops.moetailor.step_routes_observed``: the routing op
    plus the observation, one opaque op to the compiler) recomputes the full router's routes from the
    step's logits (a plan or a request's budget never changes what is counted) and adds the step's
    frequency, mass, co-selection and beta to the layer's sums on the device (``LayerSums``: one native
    call on the CPU, tensor ops elsewhere; no host read, no Python decision per step). A forward the
    runner did not report (vLLM's profile and warm-up runs, a dummy run) finds the layer unarmed and
    adds nothing;
  * the sums join the statistics only when the file is written (every N steps, on demand, at
    shutdown): the one point that reads the device.

EAN and REAP need each routed expert's output before its weight: where the layer runs moetailor's
experts kernel (``moetailor_experts_kernel``, CPU) the experts op of the step
(``swiglu_experts_observed``, given the layer's sums) adds the outputs of the routes the routing op
left there from its one expert pass (a route the step does not serve, under a plan or a budget, is one extra
row there); vLLM's fused-MoE kernels return only the weighted sum, so there the file holds
frequency, mass, co-selection and beta, and says so (``observed.expert_outputs``).

On a GPU the engine must run eager (``enforce_eager=True``, else the start is refused): the ops are
capturable tensor work, but observing under CUDA graphs was never run. Tensor and expert parallel
ranks see every token, so rank 0 alone writes; pipeline and data parallelism are refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from ...calibration.observe import LayerSums, ObservedStats, check_observe_path
from ...models.architectures import RouterSemantics
from ...routing.router import CompiledPolicy, route

OBSERVE_KEY = "moetailor_observe"              # additional_config: the statistics file
EVERY_KEY = "moetailor_observe_every"          # additional_config: also write every N steps


def observe_settings(additional_config) -> tuple[str, int] | None:
    """(path, every) from vLLM's additional_config, or None when the engine does not observe; a bad
    value is a one-line ValueError."""
    if not isinstance(additional_config, dict) or not additional_config.get(OBSERVE_KEY):
        if isinstance(additional_config, dict) and additional_config.get(EVERY_KEY):
            raise ValueError(f"additional_config {EVERY_KEY} needs {OBSERVE_KEY}: the statistics file to write")
        return None
    path, every = additional_config[OBSERVE_KEY], additional_config.get(EVERY_KEY, 0)
    if not isinstance(path, str):
        raise ValueError(f"additional_config {OBSERVE_KEY} must be a file path, got {path!r}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(f"additional_config {EVERY_KEY} must be 0 (at shutdown and on demand only) or a positive "
                         f"step count, got {every!r}")
    return path, every


def check_observe_config(additional_config, worker: bool = False) -> tuple[str, int] | None:
    """``observe_settings`` with the path checked writable (before the model loads); ``worker``: checked
    in vLLM's worker, which shares the claim of the launcher that started it."""
    settings = observe_settings(additional_config)
    if settings is not None:
        check_observe_path(settings[0], f"additional_config {OBSERVE_KEY}", worker=worker)
    return settings


@dataclass
class LayerObserver:
    """What one hooked layer's routing op adds to the statistics: the full router's routes of the step's
    logits (a plan or a request's budget never changes what is counted) into the layer's device sums."""

    semantics: RouterSemantics
    full: CompiledPolicy
    bias: torch.Tensor | None            # [E] DeepSeek's e_score_correction_bias
    sums: LayerSums
    armed: torch.Tensor                  # [L] int64, the observer's: set when a step opens, cleared per layer
    slot: int                            # this layer's entry of ``armed``
    select_kernel: object = None         # the native softmax_topk (CPU), else torch's selection

    def add(self, logits: torch.Tensor, live: torch.Tensor, decode: torch.Tensor) -> None:
        """The step's logits [T, E] and its per-token live / decode flags [T]: tensor ops only."""
        if self.selects:     # a softmax router's full routes are its top k logits: the native op picks them
            self.sums.add_logits(logits, live, decode, self.armed, self.slot)
            return
        weights, index = route(logits.float(), self.semantics, self.full, self.bias, None, graph_safe=True,
                               select_kernel=self.select_kernel)                       # [T, K]
        self.sums.add_routes(logits, weights, index, live, decode, self.armed, self.slot)

    @property
    def selects(self) -> bool:
        return self.sums.native and self.semantics.scoring == "softmax" and self.bias is None


class StepObserver:
    """The plugin's side of one observing engine: reports each step to the statistics when the runner
    reports it (and arms every layer to count it once); the layers' routing ops add the step's sums on
    the device; the sums join the statistics when the file is written."""

    def __init__(self, stats: ObservedStats, layers: dict[int, LayerObserver], armed: torch.Tensor):
        self.stats, self.layers, self.armed = stats, layers, armed
        self.open = False                     # a reported step not yet committed

    def begin(self, decode: np.ndarray, ids: np.ndarray | None) -> None:
        """A step's T tokens before its forward: decode flags [T], token ids [T] (None: not known)."""
        self.finish()
        n_decode = int(np.count_nonzero(decode))
        if ids is not None:
            ids = np.asarray(ids)
            if (ids < 0).any():     # async scheduling: sampled ids still on the device
                ids = None
        self.stats.begin(None, ids, n_decode == 0, count=len(decode), decode_tokens=n_decode)
        self.armed.fill_(1)
        self.open = True

    def finish(self) -> None:
        """Count the open step (a reported step whose forward did not run is caught when the sums are
        read: ``ObservedStats``, ``sums``)."""
        if self.open:
            self.open = False
            self.stats.commit()

    def save(self, path: str | Path | None = None) -> dict:
        self.finish()
        return self.stats.save(path)


# op key (the routing op's, routing.py) -> the hooked layer's observation; set at install, per process
OBSERVERS: dict[str, LayerObserver] = {}


def make_observer(runner, moe_runners: list, tables, keys: dict[int, str], path: str, every: int,
                  experts_kernel: bool) -> StepObserver:
    """The observer of a loaded vLLM model (``patches.setup_model``), after its MoE layers are hooked;
    ``moe_runners``: the model's fused-MoE layer objects (``routing.moe_runners``), ``keys``: the hooked
    layers' op keys (``routing.install``), registered in ``OBSERVERS``. On moetailor's experts kernel
    each layer's experts also add their outputs to its sums (``experts.run_experts``)."""
    from ... import kernels
    from ...routing.policy import FULL
    from .plan import checkpoint_fingerprint

    config = runner.vllm_config
    sem = tables.semantics
    device = torch.device(runner.device)
    runners = {r.layer_id: r for r in moe_runners}
    hidden = int(config.model_config.hf_config.hidden_size)
    # each layer as the statistics see it (the fields of moetailor's ``MoeLayer`` they read)
    layers = [SimpleNamespace(index=i, semantics=sem, hidden_size=hidden, num_experts=sem.num_experts)
              for i in sorted(keys)]
    full = CompiledPolicy.build(FULL, sem, device, None)
    native = device.type == "cpu" and kernels.observe_routes() is not None
    select_kernel = kernels.softmax_topk() if native else None
    armed = torch.zeros(len(keys), dtype=torch.long, device=device)                   # [L]
    observers = {}
    for slot, (i, key) in enumerate(sorted(keys.items())):
        sums = LayerSums(sem.num_experts, sem.top_k, runner.max_num_tokens, device,
                         sigmoid=sem.scoring == "sigmoid-grouped", hidden_size=hidden if experts_kernel else None,
                         native=native)
        observers[i] = OBSERVERS[key] = LayerObserver(sem, full, getattr(runners[i].router, "e_score_correction_bias",
                                                                          None), sums, armed, slot, select_kernel)
        if experts_kernel:     # the fused-experts object moetailor's experts kernel replaces (experts.py)
            runners[i].routed_experts.quant_method.moe_kernel.fused_experts._moetailor_observe = sums
    dtype = str(config.model_config.dtype).replace("torch.", "")
    note = None if experts_kernel else ("none: vLLM's fused-MoE kernel returns only the weighted sum of a token's "
                                        "experts (observe with moetailor_experts_kernel for EAN and REAP)")
    stats = ObservedStats(layers, checkpoint_fingerprint(config.model_config.model), dtype, path,
                          every, source="vllm", outputs_note=note,
                          sums={i: o.sums for i, o in observers.items()})
    return StepObserver(stats, observers, armed)


def check_observable(config, runners, experts_kernel: bool, device) -> None:
    """Refuse (one line) an engine the observer cannot see whole: a CUDA graph replay, pipeline or data
    parallelism, a layer whose fused kernel routes inside itself, expert outputs split by tensor
    parallelism."""
    parallel = config.parallel_config
    if experts_kernel and getattr(parallel, "tensor_parallel_size", 1) > 1:
        raise ValueError(f"additional_config {OBSERVE_KEY}: with tensor parallelism each rank's experts kernel holds "
                         "part of every expert, so no rank sees an expert's whole output; observe on one rank")
    if getattr(parallel, "pipeline_parallel_size", 1) > 1 or getattr(parallel, "data_parallel_size", 1) > 1:
        raise ValueError(f"additional_config {OBSERVE_KEY}: an engine with pipeline or data parallelism splits the "
                         "traffic or the layers between processes; observe with one of them only")
    if experts_kernel:
        scaled = [r.layer_id for r in runners if getattr(r.routed_experts, "apply_router_weight_on_input", False)]
        if scaled:
            raise ValueError(f"additional_config {OBSERVE_KEY}: MoE layers {scaled} apply the router weight to the "
                             "experts' input, so the experts kernel never sees an expert's own output; observe on "
                             "vLLM's kernel (without moetailor_experts_kernel) for the router statistics")
    if torch.device(device).type != "cpu" and not config.model_config.enforce_eager:
        raise ValueError(f"additional_config {OBSERVE_KEY}: observing under CUDA graphs is untested; start the "
                         "engine with enforce_eager=True (vllm serve --enforce-eager) to observe")
    inside = [r.layer_id for r in runners if r.routed_experts.quant_method.is_monolithic]
    if inside:
        raise ValueError(f"additional_config {OBSERVE_KEY}: MoE layers {inside} route inside a monolithic fused "
                         "kernel, which shows the observer no routes; serve with a modular fused-MoE backend")


def writes_here() -> bool:
    """Rank 0 of the tensor/expert parallel group writes (every rank routes every token)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() == 0
    except Exception:      # no distributed group initialised: one process
        return True
