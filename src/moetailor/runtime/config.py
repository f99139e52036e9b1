"""One configuration object for every part of the engine (scheduler, block manager, runner)."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..tables import unknown_choice


@dataclass
class EngineConfig:
    max_num_seqs: int = 64                # sequences running at once
    max_num_batched_tokens: int = 4096    # prompt tokens admitted per prefill step
    max_model_len: int | None = None      # prompt + completion limit; None = min(model limit, 4096)
    block_size: int = 16                  # tokens per KV block
    num_kv_blocks: int | None = None      # None = from memory_budget, else enough for every slot at full length
    memory_budget: int | None = None      # bytes for weights + KV cache; KV gets what the weights leave
    dtype: torch.dtype = torch.float32    # weights and KV cache
    prefill_dtype: torch.dtype | None = None  # autocast dtype for prefill steps (bf16 matmuls pay for long prompts)
    # expert weights of decode steps in this dtype (a copy beside the model's; prefill keeps the model's):
    # a decode step streams expert weights, and bf16 streams 2-4x faster than fp32 on AVX-512 BF16 CPUs
    # (`python -m moetailor.bench.kernels` measures it); None = the model's weights
    decode_expert_dtype: torch.dtype | None = None
    device: str = "cpu"
    experts_impl: str = "grouped"         # "grouped": one grouped GEMM per projection; "loop": routing's per-expert loop
    # decode steps run the compiled CPU kernels (moetailor/kernels: experts in one call per layer, paged
    # attention read in place) where they apply and build; the torch ops above otherwise
    native_kernels: bool = True
    # weights held packed for the native kernels (kernels.pack_weight: 16-column panels, the layout
    # their AVX-512 tile reads without transposing; the experts op 1.1-1.35x faster per layer at 8-64
    # rows without AVX512-BF16): the experts, and the bf16 linear layers whose rows all run the native op
    # (no bf16 GEMM hardware), in place: same memory, and the model's experts then run on the native
    # experts kernel on every path (runtime.experts.packed_experts_forward). None = where
    # that tile is compiled (kernels.packed_weights_pay) and the engine loaded the model itself;
    # True = also a model passed in, which the engine then takes over; False = the model's layout.
    pack_weights: bool | None = None
    # prefill and decode steps of a Qwen-MoE-style checkpoint run the engine's own decoder
    # (runtime/decoder.py: transformers' arithmetic without its module calls); False =
    # transformers' modules for every step
    own_decoder: bool = True
    # decode steps run the model through torch.compile (inductor fuses the ops between the kernels;
    # the first decode steps of each new shape pay the compilation, about a minute here)
    compile_decode: bool = False
    # which requests with per-request expert budgets share a step (routing/budgets.py): "mixed": any,
    # each token at its own k; "max": every step at its largest member's k (the usual baseline);
    # "lanes": online low-k and high-k decode lanes; "tiers": generate() plans k tiers offline
    k_schedule: str = "mixed"

    EXPERTS_IMPLS = ("grouped", "loop")
    K_SCHEDULES = ("mixed", "max", "lanes", "tiers")

    @classmethod
    def of(cls, options: dict) -> "EngineConfig":
        """The engine's options from keyword arguments, an unknown name refused with the valid ones."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise TypeError(f"unknown engine option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                            f"the options are {', '.join(names)} (and tokenizer, guard, k_cost, decode_pools, "
                            "step_log_size, observe, observe_every)")
        return cls(**{**options, "device": str(options.get("device", cls.device))})

    def __post_init__(self) -> None:
        for name in ("dtype", "prefill_dtype", "decode_expert_dtype"):
            setattr(self, name, as_dtype(getattr(self, name), name))
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.experts_impl not in self.EXPERTS_IMPLS:
            raise ValueError(unknown_choice("experts_impl", self.experts_impl, self.EXPERTS_IMPLS))
        if self.k_schedule not in self.K_SCHEDULES:
            raise ValueError(unknown_choice("k_schedule", self.k_schedule, self.K_SCHEDULES))
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks} must be at least 1 (or None to size it automatically)")


def as_dtype(value, what: str) -> torch.dtype | None:
    """``value`` as a torch dtype: a dtype, None, or its name ("float32", "bfloat16", "float16"),
    so that ``LLM(dtype="bfloat16")`` means what it says instead of failing deep in the runner."""
    from ..models.checkpoint import DTYPES

    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in DTYPES:
        return DTYPES[value.removeprefix("torch.")]
    raise ValueError(f"{what}={value!r} is not a dtype; pass a torch dtype or one of {', '.join(DTYPES)}")
