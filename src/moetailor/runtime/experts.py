"""moetailor's experts implementation: grouped by expert, touching only the routed union.

One function is registered in transformers' ``ExpertsInterface`` ("moetailor", installed by the
routing controller) and it takes its path from the forward's step (``runtime.step``):

- ``experts == "native"`` (engine steps on CPU, the default): the routed tokens' SwiGLU experts in
  one native op (``torch.ops.moetailor.swiglu_experts``, ``moetailor/kernels``), which pays one
  dispatch per layer instead of a library GEMM per expert;
- ``experts == "grouped"``: the routes, sorted by expert, go through ``grouped_mm`` once per
  projection (``grouped_experts_forward``); experts with no rows are skipped by the kernel (their
  weights are not read) and nothing waits on the host: per-expert counts and offsets stay on the
  device, dropped routes sort last and are masked out;
- otherwise (analysis and evaluation passes, ``experts_impl="loop"``, no step): a Python loop over
  the routed experts (``loop_experts_forward``), which runs any expert layout but the one packed
  for the native kernel; a module an engine packed runs on that kernel on every path.

Every path first hands a novice policy's routes to ``novice_split`` (below) (a dropped expert's route
becomes g * c_e, added to the output, and a sentinel). All share one contract: sentinel routes (index E, from ``route``) cost nothing, and inside a step
each call writes how many distinct experts it read into the step's ``experts_read`` (a device
value, read once after the forward: ``runtime.step.read_experts``), the quantity decode speed is
bound by. An experts module's layer and whether the native kernel runs it are looked up in
``INSTALLED`` (a weak map set once, at install: nothing is written onto transformers' modules).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import kernels
from .step import Step, current

IMPLEMENTATION = "moetailor"
GROUPED_IMPLEMENTATION = "moetailor_grouped"


@dataclass
class Installed:
    """What the engine knows of one experts module: its decoder layer (the key of the step's per-layer
    tensors) and whether the native kernel runs it (its layout, decided once by the engine's runner)."""
    layer: int
    native: bool = False


INSTALLED: "weakref.WeakKeyDictionary[torch.nn.Module, Installed]" = weakref.WeakKeyDictionary()


def layer_of(module) -> int:
    """The decoder layer an installed experts module belongs to (-1: not installed)."""
    found = INSTALLED.get(module)
    return -1 if found is None else found.layer


def runs_natively(module) -> bool:
    found = INSTALLED.get(module)
    return found is not None and found.native


def expert_bytes(gate_up: torch.Tensor, down: torch.Tensor) -> int:
    """Bytes one expert's weights take (what reading it costs), in either layout ([E, ...] first)."""
    return (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()


def step_weights(module, step: Step | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up, down) this step runs: the engine's copy for the step's phase (a decode dtype, or packed
    for the native kernel: ``ModelRunner._expert_weights``), else the module's [E, 2I, H] / [E, H, I]."""
    if step is not None and step.expert_weights:
        found = step.expert_weights.get(layer_of(module))
        if found is not None:
            return found
    return module.gate_up_proj, module.down_proj


def _record(module, step: Step | None, n_distinct: int | torch.Tensor) -> None:
    if step is not None and step.experts_read is not None:
        step.experts_read[layer_of(module)] = n_distinct


def sorted_routes(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert, slot) of every live route, sorted by expert (stable); slot s is token s // K's route.
    Sentinel routes (index >= num_experts) are left out."""
    flat = top_k_index.reshape(-1)                                          # [T*K]
    slots = (flat < num_experts).nonzero()[:, 0]                            # [S]
    experts, order = torch.sort(flat[slots], stable=True)
    return experts, slots[order]


def loop_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor) -> torch.Tensor:
    k = top_k_index.shape[1]                                                # [T, K]
    per_route = routes_buffer(hidden_states, top_k_weights, k)              # [T*K, H]
    experts, slots = sorted_routes(top_k_index, self.num_experts)           # [S], [S]
    ids, counts = torch.unique_consecutive(experts, return_counts=True)
    weights = top_k_weights.reshape(-1)
    start = 0
    for expert, count in zip(ids.tolist(), counts.tolist()):
        chunk = slots[start:start + count]
        start += count
        rows = chunk // k
        gate, up = F.linear(hidden_states[rows], self.gate_up_proj[expert]).chunk(2, dim=-1)  # [n, I]
        y = F.linear(self.act_fn(gate) * up, self.down_proj[expert])                            # [n, H]
        per_route[chunk] = (y * weights[chunk, None]).to(per_route.dtype)
    _record(self, current(), len(ids))
    return sum_routes(per_route, hidden_states, k)


def routes_buffer(hidden_states: torch.Tensor, top_k_weights: torch.Tensor, k: int, dtype=None) -> torch.Tensor:
    """Zeros for every route's weighted output, in slot order [T*K, H] (a dropped route stays 0)."""
    dtype = dtype or torch.promote_types(hidden_states.dtype, top_k_weights.dtype)
    return hidden_states.new_zeros(hidden_states.shape[0] * k, hidden_states.shape[-1], dtype=dtype)


def sum_routes(per_route: torch.Tensor, hidden_states: torch.Tensor, k: int) -> torch.Tensor:
    """Each token's routes summed as transformers' experts sum them (``grouped_mm_experts_forward``): in
    top-k order, one ``sum`` (fp32 accumulation for bf16), one rounding to the activations' dtype. A
    running ``index_add_`` in bf16 rounds after every route instead (1 bf16 ulp apart on Mixtral)."""
    return per_route.view(-1, k, per_route.shape[-1]).sum(dim=1).to(hidden_states.dtype)   # [T, H]


def grouped_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """The routes sorted by expert through one ``grouped_mm`` per projection, without a host sync:
    dropped routes (index E) sort last, past the last offset, so the kernel never computes them
    and their rows are masked out. Decode steps use the decode copy of the weights when the engine
    made one (``Step.expert_weights``: e.g. bf16, which streams faster than fp32)."""
    from transformers.integrations.moe import _grouped_mm

    step = current()
    gu, down = step_weights(self, step)                                     # [E, 2I, H], [E, H, I]
    E, k = self.num_experts, top_k_index.shape[1]                           # top_k_index [T, K]
    flat = top_k_index.reshape(-1)                                          # [T*K]
    experts, order = torch.sort(flat, stable=True)                          # [T*K], sentinels last
    counts = torch.bincount(flat, minlength=E + 1)[:E]                      # [E]
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)                    # [E]
    rows = order // k                                                       # [T*K] token of each route
    x = hidden_states[rows].to(gu.dtype)                                    # [T*K, H]
    gate, up = _grouped_mm(x, gu.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)  # [T*K, I]
    y = _grouped_mm(self.act_fn(gate) * up, down.transpose(-2, -1), offs=offsets)   # [T*K, H]
    w = top_k_weights.reshape(-1)[order, None]                              # [T*K, 1]
    y = torch.where(experts[:, None] < E, y * w, 0.0)                      # rows past the offsets are garbage
    per_route = routes_buffer(hidden_states, y, k)                          # [T*K, H], slot order
    per_route[order] = y.to(per_route.dtype)
    _record(self, step, (counts > 0).sum())
    return sum_routes(per_route, hidden_states, k)


def native_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor, step: Step) -> torch.Tensor:
    """All routed experts in one native op (fp32 activations; fp32 or bf16 weights, the decode
    copy when the engine made one), which writes the distinct-expert count into the step itself."""
    gu, down = step_weights(self, step)                                     # [E, 2I, H], [E, H, I]
    out = torch.ops.moetailor.swiglu_experts(hidden_states.float().contiguous(), gu, down,  # [T, H]
                                             top_k_index.long().contiguous(), top_k_weights.float().contiguous(),
                                             step.experts_read, layer_of(self))
    return out.to(hidden_states.dtype)


def packed_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor, step: Step | None) -> torch.Tensor:
    """An experts module an engine packed for the native kernel (``EngineConfig.pack_weights``), run
    outside the engine's steps (``llm.model(ids)``, an evaluation pass): only that kernel reads the
    layout, so it runs here too, and the engine's model stays a model a user can call."""
    kernel = kernels.swiglu_experts()
    if kernel is None:
        raise RuntimeError("this experts module holds its weights packed for moetailor's native kernel, which "
                           "did not build here (moetailor.kernels); load the model again, or build the engine "
                           "with pack_weights=False")
    if step is not None and step.experts_read is not None:                  # a step counts what it reads
        read, layer = step.experts_read, layer_of(self)
    else:
        read, layer = torch.zeros(1, dtype=torch.long), 0
    out = kernel(hidden_states.float().contiguous(), self.gate_up_proj, self.down_proj,  # [T, H]
                 top_k_index.long().contiguous(), top_k_weights.float().contiguous(), read, layer)
    return out.to(hidden_states.dtype)


NATIVE_WIDTH = 16   # the native kernel's vector: hidden and expert widths are whole multiples of it


def pad_width(gate_up: torch.Tensor, down: torch.Tensor, multiple: int = NATIVE_WIDTH) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert weights [E, 2I, H] / [E, H, I] widened with zero neurons to I' = I rounded up to ``multiple``:
    gate rows 0..I-1 and up rows I'..I'+I-1 of [E, 2I', H], down columns 0..I-1 of [E, H, I']. A zero
    neuron adds silu(0) * 0 = 0 through a zero down column, so every path computes the same experts.
    Why: a ``moetailor split`` checkpoint's sub-experts are I/N wide (the reference model split in 4:
    12), which the native kernel's 16-wide vectors do not cover; padded, they run on it."""
    E, two_i, H = gate_up.shape
    inter = two_i // 2
    wide = -(-inter // multiple) * multiple
    gu = gate_up.new_zeros(E, 2 * wide, H)
    gu[:, :inter], gu[:, wide:wide + inter] = gate_up[:, :inter], gate_up[:, inter:]
    dn = down.new_zeros(E, down.shape[1], wide)
    dn[:, :, :inter] = down
    return gu, dn


def native_layout(experts_module, padded: bool = False) -> bool:
    """Whether the native kernel runs this experts module: SwiGLU with a gate, no biases, the fused
    [E, 2I, H] / [E, H, I] layout (or those packed for the kernel by an engine), fp32 or bf16, and
    sizes in whole 16-wide vectors (``padded``: an expert width that is not, once ``pad_width`` widens it)."""
    m = experts_module
    gu, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(down, torch.Tensor):
        return False
    if kernels.is_packed(gu) and kernels.is_packed(down):   # packed by an engine, which checked it before
        return True
    if gu.dim() != 3 or down.dim() != 3:
        return False
    silu = isinstance(getattr(m, "act_fn", None), torch.nn.SiLU) or type(getattr(m, "act_fn", None)).__name__ == "SiLUActivation"
    E, two_i, H = gu.shape
    return (silu and getattr(m, "has_gate", True) and not getattr(m, "has_bias", False)
            and not getattr(m, "is_transposed", False) and gu.dtype in (torch.float32, torch.bfloat16)
            and down.dtype == gu.dtype and gu.is_contiguous() and down.is_contiguous()
            and tuple(down.shape) == (E, H, two_i // 2) and H % NATIVE_WIDTH == 0
            and (padded or (two_i // 2) % NATIVE_WIDTH == 0))


def needs_padding(experts_module) -> bool:
    """Whether the native kernel runs this experts module once ``pad_width`` widens it, and only then."""
    return native_layout(experts_module, padded=True) and not native_layout(experts_module)



def novice_split(cp, weights: torch.Tensor, index: torch.Tensor):   # cp: routing.router.CompiledPolicy | None
    """Routes of a novice policy [T, K] -> (constant output [T, H] fp32 or None, weights, index): each
    route to an expert outside the pool adds g * c_e (summed per token through a [T, E] x [E, H]
    product, as vLLM's expert substitution does) and becomes a sentinel route, so no expert weight is
    read for it. Any other policy: (None, weights, index) unchanged. Every experts path calls it."""
    if cp is None or cp.constants is None:
        return None, weights, index
    E = cp.keep_mask.numel()
    valid = index < E
    safe = index.clamp_max(E - 1)
    novice = valid & ~cp.keep_mask[safe]                                   # [T, K]
    scales = torch.zeros(index.shape[0], E + 1, device=index.device, dtype=torch.float32)
    scales.scatter_add_(1, torch.where(novice, safe, E), weights.float().masked_fill(~novice, 0.0))
    constant = scales[:, :E] @ cp.constants                                # [T, H]
    return constant, weights.masked_fill(novice, 0.0), index.masked_fill(novice, E)

def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The registered implementation: the step's path (native, grouped) where the layout allows, the
    loop otherwise."""
    step = current()
    constant, top_k_weights, top_k_index = novice_split(layer_policy(self, step), top_k_weights, top_k_index)
    out = _experts_forward(self, hidden_states, top_k_index, top_k_weights, step)
    return out if constant is None else out + constant.to(out.dtype)


def layer_policy(experts_module, step: Step | None):
    """The compiled policy ``step`` routes this experts module's layer with (None: the full router)."""
    return None if step is None else step.routing.policy.get(layer_of(experts_module))


def _experts_forward(self, hidden_states, top_k_index, top_k_weights, step: Step | None) -> torch.Tensor:
    mode = step.experts if step is not None else "loop"
    if mode == "native" and runs_natively(self) and step.experts_read is not None:
        return native_experts_forward(self, hidden_states, top_k_index, top_k_weights, step)
    if getattr(self, "gate_up_proj", None) is not None and kernels.is_packed(self.gate_up_proj):
        return packed_experts_forward(self, hidden_states, top_k_index, top_k_weights, step)
    grouped = mode != "loop" and getattr(self, "has_gate", True) and not (
        getattr(self, "has_bias", False) or getattr(self, "is_transposed", False))   # layouts grouped_mm skips
    forward = grouped_experts_forward if grouped else loop_experts_forward
    return forward(self, hidden_states, top_k_index, top_k_weights)


def register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    for name, forward in ((IMPLEMENTATION, experts_forward), (GROUPED_IMPLEMENTATION, grouped_experts_forward)):
        if name not in ALL_EXPERTS_FUNCTIONS:
            ALL_EXPERTS_FUNCTIONS.register(name, forward)
