"""Calibration statistics from the traffic a vLLM engine serves: the file ``moetailor calibrate``
writes, accumulated by the plugin while vLLM serves, for ``moetailor plan`` to read unchanged.

Opt in per engine through ``additional_config``::

    {"moetailor_observe": "stats.safetensors"}            # written at shutdown and on demand
    {"moetailor_observe": "stats.safetensors", "moetailor_observe_every": 500}   # and every 500 steps

On demand: ``rpc.call(llm, rpc.save_observed)`` (a function for ``LLM.collective_rpc``). The
statistics are calibration's (``calibration.observe.ObservedStats``, the embedded engine's too); this
module only says what a vLLM step is:

  * the runner adapter (``runners.py``) reports each step before its forward: how many tokens it
    schedules, which are decode tokens and, on the v1 runner, their token ids (``data_sha256``; the v2
    runner's ids stay on the device, so its files carry no hash). Tokens past that count are padding
    and never observed;
  * each hooked MoE layer's routing op (``torch.ops.moetailor.step_routes_observed``: the routing op
    plus the observation, one opaque op to the compiler) hands its layer input [T, H] and router logits
    to the observer, which recomputes the full router's routes (a plan or a request's budget never
    changes what is counted) and adds the step's sums. A forward the runner did not report (vLLM's
    profile and warm-up runs, a dummy run) finds no step open and adds nothing; a layer counts once
    per step;
  * a step's sums join the totals when the next step opens, or when the file is written.

EAN and REAP need each routed expert's output before its weight: where the layer runs moetailor's
experts kernel (``moetailor_experts_kernel``, CPU) the observer runs that kernel once more over the
routed tokens with unit weights; vLLM's fused-MoE kernels return only the weighted sum, so there the
file holds frequency, mass, co-selection and beta, and says so (``observed.expert_outputs``).

The observer runs Python in the step, which a CUDA graph replay skips: on a GPU the engine must run
eager (``enforce_eager=True``), else the start is refused. Tensor and expert parallel ranks see every
token, so rank 0 alone writes; pipeline and data parallelism are refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ...calibration.observe import ObservedStats, check_observe_path
from ...models.architectures import RouterSemantics

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
class ObservedLayer:
    """One vLLM MoE layer as the statistics see it (the fields of moetailor's ``MoeLayer`` they read)."""

    index: int
    semantics: RouterSemantics
    hidden_size: int
    experts: torch.nn.Module            # vLLM's routed experts layer (w13_weight, w2_weight)

    @property
    def num_experts(self) -> int:
        return self.semantics.num_experts


def kernel_expert_outputs(layer: ObservedLayer, hidden: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """E_j(x) [S, H] for rows routed to one expert each, through moetailor's experts kernel on the
    layer's own (possibly packed) weights: each row one route of weight 1."""
    w13, w2 = layer.experts.w13_weight, layer.experts.w2_weight
    ones = torch.ones(hidden.shape[0], 1, dtype=torch.float32, device=hidden.device)            # [S, 1]
    return torch.ops.moetailor.swiglu_experts(hidden.float().contiguous(), w13, w2, experts[:, None].contiguous(),
                                              ones, torch.zeros(1, dtype=torch.long), -1)


class StepObserver:
    """The plugin's side of one observing engine: opens a step when the runner reports it, feeds each
    layer's routing to the statistics once per step, closes the step when the next one opens."""

    def __init__(self, stats: ObservedStats, layers: dict[int, ObservedLayer], full_routes):
        self.stats, self.layers = stats, layers
        self.full_routes = full_routes        # (layer index, logits [T, E]) -> (weights, index) [T, K]
        self.count = 0                        # tokens of the open step (0: none open)
        self.seen: set[int] = set()

    def begin(self, decode: np.ndarray, ids: np.ndarray | None) -> None:
        """A step's T tokens before its forward: decode flags [T], token ids [T] (None: not known)."""
        self.finish()
        self.count = len(decode)
        n_decode = int(np.count_nonzero(decode))
        if ids is not None and (np.asarray(ids) < 0).any():   # async scheduling: sampled ids still on the device
            ids = None
        self.stats.begin(None, None if ids is None else [int(t) for t in ids], n_decode == 0, count=self.count,
                         decode_tokens=n_decode)

    def layer(self, index: int, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """One MoE layer's input [N, H] and router logits [N, E] (N >= T: the rest is padding)."""
        if not self.count or index in self.seen:
            return
        self.seen.add(index)
        T = self.count
        hidden, logits = hidden[:T], logits[:T]
        weights, ids = self.full_routes(index, logits)
        self.stats(self.layers[index], hidden, logits, weights, ids)

    def finish(self) -> None:
        """Count the open step if its forward ran (its layers observed), else drop it."""
        if not self.count:
            return
        if self.seen:
            self.stats.commit()
        else:
            self.stats.discard()
        self.count = 0
        self.seen = set()

    def save(self, path: str | Path | None = None) -> dict:
        self.finish()
        return self.stats.save(path)


# op key (the routing op's, routing.py) -> (the observer, the layer index); set at install, per process
OBSERVERS: dict[str, tuple[StepObserver, int]] = {}


def make_observer(runner, moe_runners: list, tables, path: str, every: int, experts_kernel: bool) -> StepObserver:
    """The observer of a loaded vLLM model (``patches.setup_model``), after its MoE layers are hooked;
    ``moe_runners``: the model's fused-MoE layer objects (``routing.moe_runners``)."""
    from ...routing.policy import FULL
    from ...routing.router import CompiledPolicy, route
    from .plan import checkpoint_fingerprint

    config = runner.vllm_config
    sem = tables.semantics
    runners = {r.layer_id: r for r in moe_runners}
    hidden = int(config.model_config.hf_config.hidden_size)
    layers = {i: ObservedLayer(i, sem, hidden, r.routed_experts) for i, r in sorted(runners.items())}
    full = CompiledPolicy.build(FULL, sem, runner.device, None)
    biases = {i: getattr(r.router, "e_score_correction_bias", None) for i, r in runners.items()}

    def full_routes(index: int, logits: torch.Tensor):
        return route(logits.float(), sem, full, biases[index], None)

    dtype = str(config.model_config.dtype).replace("torch.", "")
    note = None if experts_kernel else ("none: vLLM's fused-MoE kernel returns only the weighted sum of a token's "
                                        "experts (observe with moetailor_experts_kernel for EAN and REAP)")
    stats = ObservedStats(list(layers.values()), checkpoint_fingerprint(config.model_config.model), dtype, path,
                          every, expert_outputs=kernel_expert_outputs if experts_kernel else None, source="vllm",
                          outputs_note=note, direct=True)     # a failed vLLM step ends the engine: nothing to drop
    return StepObserver(stats, layers, full_routes)


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
    if torch.device(device).type != "cpu" and not config.model_config.enforce_eager:
        raise ValueError(f"additional_config {OBSERVE_KEY}: a CUDA graph replays its kernels without the observer; "
                         "start the engine with enforce_eager=True (vllm serve --enforce-eager) to observe")
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
