"""Roofline projection of batched MoE decode on a GPU, from the CPU benchmarks' traffic accounting.

A step of B sequences at mean context C reads the dense weights, the union of routed experts
(m'(1-(1-k/m')^B) per layer for a pool of m' of m) and each sequence's KV (plus recurrent state);
its ideal time is max(bytes / bandwidth, FLOPs / peak), derated by ``Efficiency``, and the two terms
are the engine's ``routing.traffic.StepCost`` (``roofline_costs``). The batch a per-user SLO allows
is the largest B whose step fits 1 / SLO and whose KV fits in memory. Weights and KV bf16.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..routing.traffic import StepCost, expected_distinct

BYTES = 2  # bf16 weights and KV


@dataclass(frozen=True)
class GPU:
    name: str
    bandwidth: float   # bytes/s (datasheet)
    flops: float       # dense bf16 FLOP/s (datasheet)
    memory: float      # bytes


GPUS = {
    "a100": GPU("A100-80GB", 2.0e12, 312e12, 80e9),
    "h100": GPU("H100 SXM", 3.35e12, 989e12, 80e9),
    "h200": GPU("H200", 4.8e12, 989e12, 141e9),
}


@dataclass(frozen=True)
class ModelShape:
    """What a decode step reads, per model. Parameter counts are weights, not bytes."""

    name: str
    layers: int
    moe_layers: int
    hidden: int
    experts: int
    top_k: int
    expert_width: int
    shared_width: int            # total width of always-on shared experts per MoE layer (0 = none)
    dense_width: int             # FFN width of the (layers - moe_layers) dense layers
    vocab: int
    attn_params: int             # attention weights summed over all layers
    kv_bytes_per_token: int      # KV cache bytes per context token, all layers
    state_bytes_per_seq: int     # recurrent (linear-attention) state per sequence, all layers
    attn_flops_per_ctx: int      # attention FLOPs per token per context position, all layers
    source: str

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.expert_width

    @property
    def dense_params(self) -> int:
        """Weights every step reads whatever the batch: attention, routers, shared experts, dense FFNs, LM head."""
        return (self.attn_params + self.moe_layers * (self.experts * self.hidden + 3 * self.hidden * self.shared_width)
                + (self.layers - self.moe_layers) * 3 * self.hidden * self.dense_width + self.vocab * self.hidden)

    def active_params(self, top_k: int | None = None) -> int:
        return self.dense_params + self.moe_layers * (top_k or self.top_k) * self.expert_params


def _gqa(layers: int, hidden: int, q_heads: int, kv_heads: int, head_dim: int) -> tuple[int, int, int]:
    """(attention params, KV bytes per token, attention FLOPs per context position) for GQA layers."""
    q, kv = q_heads * head_dim, kv_heads * head_dim
    return layers * (2 * hidden * q + 2 * hidden * kv), layers * 2 * kv * BYTES, layers * 4 * q


def _shapes() -> dict[str, ModelShape]:
    shapes = {}
    a, kv, fl = _gqa(16, 2048, 16, 16, 128)
    shapes["olmoe-1b-7b"] = ModelShape("OLMoE-1B-7B", 16, 16, 2048, 64, 8, 1024, 0, 0, 50304, a, kv, 0, fl,
                                       "model card")
    a, kv, fl = _gqa(48, 2048, 32, 4, 128)
    shapes["qwen3-30b-a3b"] = ModelShape("Qwen3-30B-A3B", 48, 48, 2048, 128, 8, 768, 0, 0, 151936, a, kv, 0, fl,
                                         "model card")
    a, kv, fl = _gqa(32, 4096, 32, 8, 128)
    shapes["mixtral-8x7b"] = ModelShape("Mixtral-8x7B", 32, 32, 4096, 8, 2, 14336, 0, 0, 32000, a, kv, 0, fl,
                                        "model card")
    # DeepSeek-V2-Lite, MLA: 16 heads, q 128+64 rope, compressed KV 512 + 64 rope cached per token,
    # absorbed attention reads 576 dims for scores and 512 for values per head and position.
    mla = 2048 * 16 * 192 + 2048 * 576 + 512 * 16 * 256 + 16 * 128 * 2048
    shapes["deepseek-v2-lite"] = ModelShape("DeepSeek-V2-Lite", 27, 26, 2048, 64, 6, 1408, 2 * 1408, 10944, 102400,
                                            27 * mla, 27 * 576 * BYTES, 0, 27 * 2 * 16 * (576 + 512),
                                            "model card (MLA, first layer dense)")
    # Qwen3.6-35B-A3B (SlimWise's model): 40 layers = 10 x (3 Gated DeltaNet + 1 gated full attention).
    # Full attention: 16 q heads (q_proj also emits a gate), 2 kv heads, head dim 256.
    # Gated DeltaNet: 16 qk heads, 32 v heads, head dim 128; state [32, 128, 128] per layer.
    full = 10 * (2048 * 16 * 256 * 2 + 2 * 2048 * 2 * 256 + 16 * 256 * 2048)
    linear = 30 * (2048 * (2 * 16 * 128 + 2 * 32 * 128) + 2048 * 64 + 32 * 128 * 2048)
    shapes["qwen3.6-35b-a3b"] = ModelShape(
        "Qwen3.6-35B-A3B", 40, 40, 2048, 256, 8, 512, 512, 0, 248320, full + linear, 10 * 2 * 2 * 256 * BYTES,
        2 * 30 * 32 * 128 * 128 * BYTES,  # state read and written each step
        10 * 4 * 16 * 256,
        "expert shapes derived (papers/README); attention layout assumed from the Qwen3.5/3.6-35B-A3B card")
    return shapes


SHAPES = _shapes()


@dataclass(frozen=True)
class RooflineStep:
    """One projected decode step: what it reads and computes, and how long it takes."""
    batch: int
    keep: float
    dense_bytes: float
    expert_bytes: float
    kv_bytes: float
    flops: float
    seconds: float
    bound: str          # "memory" | "compute"

    @property
    def bytes(self) -> float:
        return self.dense_bytes + self.expert_bytes + self.kv_bytes

    @property
    def per_user_tps(self) -> float:
        return 1.0 / self.seconds

    @property
    def throughput(self) -> float:
        return self.batch / self.seconds


def kept_experts(shape: ModelShape, keep: float) -> int:
    return min(max(shape.top_k, round(shape.experts * keep)), shape.experts)


@dataclass(frozen=True)
class Efficiency:
    """How close kernels get to the datasheet. ``IDEAL`` is the roofline; ``overlap=False`` adds the
    memory and compute times instead of taking their max (kernels that do not overlap them)."""

    bandwidth: float = 1.0
    flops: float = 1.0
    overlap: bool = True
    overhead_s: float = 0.0   # fixed per-step cost (launches, scheduling, sampling)
    per_seq_s: float = 0.0    # per-sequence per-step cost beyond its KV bytes (attention kernels, sampling)

    def describe(self) -> str:
        if self == IDEAL:
            return "ideal roofline (datasheet bandwidth and FLOP/s, memory and compute overlapped)"
        return (f"{self.bandwidth:.0%} of datasheet bandwidth, {self.flops:.0%} of peak FLOP/s, "
                f"{'overlapped' if self.overlap else 'memory + compute added'}, {self.overhead_s * 1e3:g} ms/step fixed"
                + (f", {self.per_seq_s * 1e6:.0f} us/sequence" if self.per_seq_s else ""))


IDEAL = Efficiency()
REALISTIC = Efficiency(bandwidth=0.8, flops=0.4, overlap=False, overhead_s=0.002)


def roofline_costs(shape: ModelShape, gpu: GPU, context: int, keep: float = 1.0, num_gpus: int = 1,
                   eff: Efficiency = IDEAL) -> tuple[StepCost, StepCost]:
    """(memory, compute): the step cost model of a decode step at mean context ``context`` as two
    ``StepCost``s, bytes / bandwidth (dense weights fixed, KV and state per sequence, an expert per
    distinct expert) and FLOPs / peak (dense and attention per sequence, an expert per route)."""
    bandwidth, peak = gpu.bandwidth * eff.bandwidth * num_gpus, gpu.flops * eff.flops * num_gpus
    m = kept_experts(shape, keep)
    memory = StepCost(shape.moe_layers, m, per_expert=shape.expert_params * BYTES / bandwidth,
                      per_token=(context * shape.kv_bytes_per_token + shape.state_bytes_per_seq) / bandwidth,
                      fixed=shape.dense_params * BYTES / bandwidth)
    compute = StepCost(shape.moe_layers, m, per_expert=0.0, per_route=2 * shape.expert_params / peak,
                       per_token=(2 * shape.dense_params + context * shape.attn_flops_per_ctx) / peak)
    return memory, compute


def step_cost(shape: ModelShape, gpu: GPU, batch: int, context: int, keep: float = 1.0, num_gpus: int = 1,
              eff: Efficiency = IDEAL) -> RooflineStep:
    """Roofline time of one decode step of ``batch`` sequences at mean context ``context``."""
    m = kept_experts(shape, keep)
    dense = shape.dense_params * BYTES
    experts = shape.moe_layers * expected_distinct(m, shape.top_k, batch) * shape.expert_params * BYTES
    kv = batch * (context * shape.kv_bytes_per_token + shape.state_bytes_per_seq)
    flops = batch * (2 * shape.active_params() + context * shape.attn_flops_per_ctx)
    memory, compute = roofline_costs(shape, gpu, context, keep, num_gpus, eff)
    t_mem, t_cmp = memory.seconds(shape.top_k, batch), compute.seconds(shape.top_k, batch)
    seconds = (max(t_mem, t_cmp) if eff.overlap else t_mem + t_cmp) + eff.overhead_s + batch * eff.per_seq_s
    return RooflineStep(batch, keep, dense, experts, kv, flops, seconds, "memory" if t_mem >= t_cmp else "compute")


def resident_bytes(shape: ModelShape, keep: float) -> float:
    """Weights held on the decode instance when it holds ``keep`` of the experts."""
    return (shape.dense_params + shape.moe_layers * kept_experts(shape, keep) * shape.expert_params) * BYTES


def memory_batch_cap(shape: ModelShape, gpu: GPU, max_context: int, resident: float, num_gpus: int = 1,
                     utilisation: float = 0.9) -> int:
    """Sequences whose KV (at ``max_context``) fits next to ``resident`` bytes of weights."""
    free = gpu.memory * num_gpus * utilisation - resident
    per_seq = max_context * shape.kv_bytes_per_token + shape.state_bytes_per_seq / 2
    return max(0, int(free // per_seq))


def slo_batch(shape: ModelShape, gpu: GPU, slo_tps: float, context: int, keep: float, cap: int, num_gpus: int = 1,
              eff: Efficiency = IDEAL) -> RooflineStep | None:
    """The largest batch <= cap whose step meets the per-user SLO (None when even batch 1 misses it)."""
    budget = 1.0 / slo_tps
    ok = lambda b: step_cost(shape, gpu, b, context, keep, num_gpus, eff).seconds <= budget
    if cap < 1 or not ok(1):
        return None
    lo, hi = 1, 2
    while hi <= cap and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, cap + 1)
    while hi - lo > 1:  # ok(lo), not ok(hi) or hi > cap
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return step_cost(shape, gpu, lo, context, keep, num_gpus, eff)


# SlimWise's measured decode throughput gains per GPU at a 50 tok/s per-user SLO (2xA100, 1k in / 8k out).
SLIMWISE = {"disaggregated": {0.5: 1.81, 0.25: 2.39}, "colocated": {0.5: 1.72, 0.25: 2.28}}


@dataclass
class Projection:
    keep: float
    mode: str                 # "colocated" (full pool resident, masked) | "disaggregated" (pruned checkpoint)
    cap: int                  # memory batch cap
    at_slo: RooflineStep | None
    speedup: float | None     # throughput at SLO vs the full pool's
    slimwise: float | None    # SlimWise's measured speedup for this keep/mode, if any


def project(shape: ModelShape, gpu: GPU, keeps: list[float], slo_tps: float, context: int, max_context: int,
            num_gpus: int = 1, eff: Efficiency = IDEAL) -> list[Projection]:
    """Full pool plus each kept fraction, colocated and disaggregated, at the SLO."""
    full_cap = memory_batch_cap(shape, gpu, max_context, resident_bytes(shape, 1.0), num_gpus)
    full = slo_batch(shape, gpu, slo_tps, context, 1.0, full_cap, num_gpus, eff)
    out = [Projection(1.0, "full", full_cap, full, 1.0 if full else None, None)]
    for keep in keeps:
        for mode in ("colocated", "disaggregated"):
            resident = resident_bytes(shape, 1.0 if mode == "colocated" else keep)
            cap = memory_batch_cap(shape, gpu, max_context, resident, num_gpus)
            at = slo_batch(shape, gpu, slo_tps, context, keep, cap, num_gpus, eff)
            speedup = at.throughput / full.throughput if (at and full) else None
            out.append(Projection(keep, mode, cap, at, speedup, SLIMWISE[mode].get(keep)))
    return out


def slo_curve(shape: ModelShape, gpu: GPU, keep: float, context: int, batches: list[int], num_gpus: int = 1,
              eff: Efficiency = IDEAL) -> list[RooflineStep]:
    """Throughput vs per-user speed as the batch grows (SlimWise Figure 4), one pool."""
    return [step_cost(shape, gpu, b, context, keep, num_gpus, eff) for b in batches]


def per_seq_cost_matching(shape: ModelShape, gpu: GPU, keep: float, mode: str, target: float, slo_tps: float,
                          context: int, max_context: int, num_gpus: int = 1) -> float | None:
    """The per-sequence step cost (seconds) that brings the ideal projection's speedup down to ``target``.
    Extra per-sequence cost lowers every pool's batch at the SLO; the smaller the full pool's batch, the
    less of its pool the union covers, and the smaller the pruned pool's gain."""
    def speedup(c: float) -> float | None:
        proj = project(shape, gpu, [keep], slo_tps, context, max_context, num_gpus, Efficiency(per_seq_s=c))
        return next((p.speedup for p in proj if p.mode == mode), None)

    lo, hi = 0.0, 1.0 / slo_tps
    s_lo, s_hi = speedup(lo), speedup(hi / 2)
    if s_lo is None or s_lo <= target or s_hi is None or s_hi > target:
        return None
    hi /= 2
    for _ in range(40):
        mid = (lo + hi) / 2
        s = speedup(mid)
        lo, hi = (mid, hi) if s is not None and s > target else (lo, mid)
    return (lo + hi) / 2
