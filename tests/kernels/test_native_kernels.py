"""The compiled CPU kernels against plain torch on the same inputs: the routed SwiGLU experts (fp32 and
bf16 weights, dropped routes, row counts that are not multiples of the 4-row block) and decode
attention over a paged cache (ragged lengths, scattered blocks, grouped-query heads)."""
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moetailor import kernels

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="no C++ compiler: the engine runs on torch's kernels")


def rows_in(weight: torch.Tensor, packed: bool) -> "callable":
    """What the kernel multiplies a weight's rows by: on a processor with the bf16 dot product, packed
    bf16 weights meet rows rounded to bf16 (``kernels.experts_round_to_bf16``), else the rows as given."""
    if packed and weight.dtype == torch.bfloat16 and kernels.experts_round_to_bf16():
        return lambda rows: rows.to(torch.bfloat16).float()
    return lambda rows: rows


def reference_experts(x, gate_up, down, index, weight, packed=False):
    """Token by token: sum over live routes of weight * down(silu(gate) * up)."""
    E, I = gate_up.shape[0], down.shape[2]
    rows = rows_in(gate_up, packed)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(index[t].tolist(), weight[t].tolist()):
            if 0 <= e < E:
                h = gate_up[e].float() @ rows(x[t])                # [2I]
                out[t] += w * (down[e].float() @ rows(F.silu(h[:I]) * h[I:]))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 37])
@pytest.mark.parametrize("inter", [32, 48])
@pytest.mark.parametrize("packed", [False, True])
def test_swiglu_experts_equal_torch(dtype, tokens, inter, packed):
    """inter 48: a down projection whose depth is not a multiple of 32 (the reference model's), where
    row-major bf16 weights take the 16-wide tile instead of the pairs of 32 (AVX-512). packed: the
    same weights in 16-column panels (kernels.pack_weight); 37 tokens give some expert more
    than the panel tile's 8 rows."""
    torch.manual_seed(tokens)
    E, H, I, K = 12, 64, inter, 3
    gate_up, down = (torch.randn(E, 2 * I, H) * 0.1).to(dtype), (torch.randn(E, H, I) * 0.1).to(dtype)
    x = torch.randn(tokens, H)
    weight, index = torch.softmax(torch.randn(tokens, E), -1).topk(K, -1)
    index[0, -1] = E                                              # a dropped route (the router's sentinel)
    read = torch.full((3,), -1)
    held = [kernels.pack_weight(w) for w in (gate_up, down)] if packed else [gate_up, down]
    out = kernels.swiglu_experts()(x, *held, index.contiguous(), weight.contiguous(), read, 1)
    expected = reference_experts(x, gate_up, down, index, weight, packed)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    live = index[(index >= 0) & (index < E)]
    assert read.tolist() == [-1, live.unique().numel(), -1]          # the count goes to its layer's entry


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
def test_swiglu_experts_do_not_depend_on_the_thread_count(dtype, packed):
    """Threads claim experts in turn (most rows first); each expert's rows are computed the same way
    whichever thread takes them, so one thread and two give the same bits."""
    torch.manual_seed(0)
    E, H, I, K, T = 16, 64, 32, 4, 29
    gate_up, down = (torch.randn(E, 2 * I, H) * 0.1).to(dtype), (torch.randn(E, H, I) * 0.1).to(dtype)
    if packed:
        gate_up, down = kernels.pack_weight(gate_up), kernels.pack_weight(down)
    x = torch.randn(T, H)
    weight, index = torch.softmax(3 * torch.randn(T, E), -1).topk(K, -1)   # skewed: uneven rows per expert
    args = (x, gate_up, down, index.contiguous(), weight.contiguous(), torch.zeros(1, dtype=torch.int64), 0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernels.swiglu_experts()(*args)
        torch.set_num_threads(2)
        two = kernels.swiglu_experts()(*args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_swiglu_experts_refuse_bad_shapes():
    gate_up, down = torch.randn(4, 20, 64), torch.randn(4, 64, 10)          # I = 10: not whole vectors
    args = (torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1), torch.full((1,), -1), 0)
    with pytest.raises(RuntimeError, match="multiples of 16"):
        kernels.swiglu_experts()(torch.randn(2, 64), gate_up, down, *args)
    gate_up, down = torch.randn(4, 64, 64), torch.randn(4, 64, 32)
    with pytest.raises(RuntimeError, match="both row-major or both packed"):
        kernels.swiglu_experts()(torch.randn(2, 64), kernels.pack_weight(gate_up), down, *args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_experts_deep_enough_for_narrow_column_groups(dtype):
    """fp32 panels deeper than 1024 take 6-panel column groups (12 would not stay in L2) and 3 panels a
    tile at every row count; 20 tokens on both of 2 experts: row blocks of 8, 8 and 4 on a 10-panel gate_up."""
    torch.manual_seed(1)
    E, H, I, K, T = 2, 1088, 80, 2, 20
    gate_up, down = (torch.randn(E, 2 * I, H) * 0.05).to(dtype), (torch.randn(E, H, I) * 0.05).to(dtype)
    x = torch.randn(T, H)
    weight, index = torch.softmax(torch.randn(T, E), -1).topk(K, -1)
    out = kernels.swiglu_experts()(x, kernels.pack_weight(gate_up), kernels.pack_weight(down), index.contiguous(),
                                   weight.contiguous(), torch.full((1,), -1), 0)
    torch.testing.assert_close(out, reference_experts(x, gate_up, down, index, weight, packed=True), rtol=1e-4, atol=1e-4)


def test_packed_bf16_weights_meet_rows_rounded_to_bf16_where_the_processor_has_the_dot_product():
    """With AVX512-BF16 the packed bf16 tile rounds its rows to bf16 (vdpbf16ps), elsewhere it widens the
    weights and keeps the rows fp32: the op's answer must be the one the kernel computes, so the result
    equals that form's reference to fp32 rounding and differs from the other form's."""
    torch.manual_seed(3)
    w, x = (torch.randn(64, 256) * 0.1).to(torch.bfloat16), torch.randn(5, 256)
    out = kernels.rows_linear()(x, kernels.pack_weight(w), None)
    exact, rounded = x @ w.float().T, x.to(torch.bfloat16).float() @ w.float().T
    want, other = (rounded, exact) if kernels.experts_round_to_bf16() else (exact, rounded)
    assert (out - want).abs().max() < 1e-5 < (out - other).abs().max()
    flags = kernels._cpu_flags().split()
    assert kernels.experts_round_to_bf16() == ("avx512_bf16" in flags and "avx512f" in flags)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_are_a_permutation(dtype):
    """One 64-byte load of a packed weight is 16 output columns at P depths (P = 2 for bf16)."""
    w = torch.randn(3, 32, 48).to(dtype)                                    # [E, cols, depth]
    packed = kernels.pack_weight(w)
    P = 2 if dtype == torch.bfloat16 else 1
    assert packed.shape == (3, 2, 48 // P, 16, P) and kernels.is_packed(packed) and not kernels.is_packed(w)
    assert torch.equal(packed[1, 1, 5, 3], w[1, 16 + 3, 5 * P:5 * P + P])   # expert 1, column 19, depths 5P..
    assert torch.equal(kernels.unpack_weight(packed), w)
    linear = kernels.pack_weight(w[0])                                      # a linear layer's [N, H]
    assert linear.shape == (2, 48 // P, 16, P) and kernels.is_packed(linear) and not kernels.is_packed(w[0])
    assert torch.equal(kernels.unpack_weight(linear), w[0])
    with pytest.raises(ValueError, match="multiples of 16"):
        kernels.pack_weight(torch.randn(2, 24, 32))


@pytest.mark.parametrize("heads,kv_heads,dim,dtype", [(4, 2, 64, torch.float32), (6, 6, 24, torch.float32),
                                                      (4, 2, 64, torch.bfloat16)])
def test_paged_decode_attention_equals_sdpa(heads, kv_heads, dim, dtype):
    torch.manual_seed(heads)
    bs, num_blocks, lens = 4, 40, [1, 7, 16, 37]
    k_cache = torch.randn(num_blocks * bs, kv_heads, dim).to(dtype)
    v_cache = torch.randn(num_blocks * bs, kv_heads, dim).to(dtype)
    free = torch.randperm(num_blocks).tolist()                      # scattered blocks
    tables = [[free.pop() for _ in range((n + bs - 1) // bs)] for n in lens]
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(len(lens), heads, dim)
    out = kernels.paged_decode_attention()(q, k_cache, v_cache, table, torch.tensor(lens), bs, dim ** -0.5)
    for b, n in enumerate(lens):
        slots = torch.tensor([tables[b][p // bs] * bs + p % bs for p in range(n)])
        k, v = k_cache[slots].transpose(0, 1).float(), v_cache[slots].transpose(0, 1).float()  # [nKV, n, D]
        expected = F.scaled_dot_product_attention(q[b][:, None], k, v, enable_gqa=True)[:, 0]  # [nH, D]
        torch.testing.assert_close(out[b], expected, rtol=1e-5, atol=1e-5)


def test_kernels_are_torch_ops_with_fake_implementations():
    """Registered through torch.library (so torch.compile sees one opaque op): schema, fake tensors and
    the mutation of experts_read pass torch's own op checks."""
    from torch.library import opcheck

    torch.manual_seed(0)
    E, H, I, K, T = 6, 32, 16, 2, 3
    gate_up, down, x = torch.randn(E, 2 * I, H), torch.randn(E, H, I), torch.randn(T, H)
    weight, index = torch.softmax(torch.randn(T, E), -1).topk(K, -1)
    opcheck(torch.ops.moetailor.swiglu_experts.default, (x, gate_up, down, index, weight, torch.full((2,), -1), 0))
    k_cache, v_cache = torch.randn(16, 2, 16), torch.randn(16, 2, 16)
    opcheck(torch.ops.moetailor.paged_decode_attention.default,
            (torch.randn(2, 4, 16), k_cache, v_cache, torch.tensor([[0, 1], [2, 3]]), torch.tensor([5, 8]), 4, 0.25))
    opcheck(torch.ops.moetailor.rows_linear.default, (torch.randn(3, 32), torch.randn(40, 32)))
    opcheck(torch.ops.moetailor.rows_linear.default, (torch.randn(3, 32), torch.randn(40, 32), torch.randn(40)))
    opcheck(torch.ops.moetailor.rms_norm.default, (torch.randn(3, 40), torch.randn(40), 1e-6))
    opcheck(torch.ops.moetailor.softmax_topk.default, (torch.randn(3, 16), 4, True))
    opcheck(torch.ops.moetailor.softmax_topk.default, (torch.randn(3, 16), 4, False, torch.rand(16) < 0.7))
    opcheck(torch.ops.moetailor.add_rms_norm.default, (torch.randn(3, 40), torch.randn(3, 40), torch.randn(40), 1e-6))
    cos, sin = torch.randn(2, 16), torch.randn(2, 16)
    opcheck(torch.ops.moetailor.rotary_kv_write.default, (torch.randn(2, 4, 16), torch.randn(2, 2, 16),
            torch.randn(2, 2, 16), cos, sin, k_cache, v_cache, torch.tensor([3, 9])))
    assert kernels.swiglu_experts() is torch.ops.moetailor.swiglu_experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols", [(1, 8192), (3, 50), (8, 17)])
@pytest.mark.parametrize("depth", [64, 48])
def test_rows_linear_equals_torch(rows, cols, dtype, depth):
    """The decode LM head's op: column counts that are not whole 16-column tiles, 1-8 rows; a depth
    that is not a multiple of 32 takes the 16-wide tile for bf16 weights too."""
    torch.manual_seed(rows)
    x, w = torch.randn(rows, depth), torch.randn(cols, depth).to(dtype)
    torch.testing.assert_close(kernels.rows_linear()(x, w), x @ w.float().T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows,cols", [(1, 8192), (3, 50)])
def test_rows_linear_adds_the_bias_as_torch_does(rows, cols):
    """The bias is added to the finished sum, one rounding each: the same bits as the op, then an add."""
    torch.manual_seed(rows)
    x, w, b = torch.randn(rows, 64), torch.randn(cols, 64), torch.randn(cols)
    op = kernels.rows_linear()
    assert torch.equal(op(x, w, b), op(x, w) + b)
    with pytest.raises(RuntimeError, match="bias: contiguous fp32"):
        op(x, w, torch.randn(cols + 1))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows,cols", [(1, 8192), (3, 50)])
def test_rows_linear_on_bf16_rows_rounds_the_fp32_result_once(rows, cols, bias):
    """A bf16 model's decode linears pass bf16 rows: the op's fp32 sums (+ the bias, widened) rounded to
    bf16 once, the same bits as widening the rows, the fp32 op, the add and one ``.to(bf16)``."""
    torch.manual_seed(rows)
    x, w = torch.randn(rows, 64).bfloat16(), torch.randn(cols, 64).bfloat16()
    b = torch.randn(cols).bfloat16() if bias else None
    op = kernels.rows_linear()
    expected = op(x.float(), w) + (b.float() if bias else 0)
    out = op(x, w, b)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 256), (3, 40)])
def test_add_rms_norm_is_the_add_then_the_norm_bit_for_bit(rows, width, dtype):
    """The lean decode forward fuses each residual add with the next norm; the module path adds, then
    norms: the two must agree to the bit (a bf16 model: the sum rounded to bf16, as its add does)."""
    torch.manual_seed(rows)
    x, r, w = (t.to(dtype) for t in (4 * torch.randn(rows, width), torch.randn(rows, width), torch.randn(width)))
    total, normed = kernels.add_rms_norm()(x, r, w, 1e-6)
    assert total.dtype == normed.dtype == dtype
    assert torch.equal(total, r + x) and torch.equal(normed, kernels.rms_norm()(r + x, w, 1e-6))
    with pytest.raises(RuntimeError, match="residual: contiguous"):
        kernels.add_rms_norm()(x, r[:, :-1], w, 1e-6)


@pytest.mark.parametrize("rows,width", [(1, 256), (12, 64), (3, 40)])
def test_rms_norm_equals_transformers(rows, width):
    """The decode norms' op, against transformers' RMSNorm; widths that are not whole 16-wide vectors."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    torch.manual_seed(rows)
    norm = Qwen3MoeRMSNorm(width, eps=1e-6)
    norm.weight.data = torch.randn(width)
    x = 3 * torch.randn(rows, width)
    torch.testing.assert_close(kernels.rms_norm()(x, norm.weight, 1e-6), norm(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="weight: contiguous fp32"):
        kernels.rms_norm()(x, torch.ones(width + 1), 1e-6)


@pytest.mark.parametrize("rows,width", [(1, 2048), (5, 40)])
def test_rms_norm_on_bf16_rows_equals_transformers_bf16_norm(rows, width):
    """A bf16 model's norms (OLMoE's, 2048 wide): transformers rounds the normalised row to bf16 and then
    its product with the bf16 weight; the op does the same, so only the fp32 variance's summation order
    differs: almost every element equal to the bit, none off by more than a bf16 rounding."""
    from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm

    torch.manual_seed(rows)
    norm = OlmoeRMSNorm(width, eps=1e-5)
    norm.weight.data = torch.randn(width)
    norm = norm.bfloat16()
    x = (3 * torch.randn(rows, width)).bfloat16()
    out, ref = kernels.rms_norm()(x, norm.weight, 1e-5), norm(x)
    assert out.dtype == torch.bfloat16
    assert (out == ref).float().mean() > 0.99
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 ** -7, atol=1e-6)
    with pytest.raises(RuntimeError, match="bf16 weight"):
        kernels.rms_norm()(x, norm.weight.float(), 1e-5)


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    """A build killed midway leaves torch's lock file; the next engine must not wait on it forever."""
    import os
    import time

    from torch.utils import cpp_extension

    from moetailor import kernels

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    for name, age in (("stale", kernels.STALE_LOCK_S + 60), ("fresh", 5)):
        lock = tmp_path / name / "lock"
        lock.parent.mkdir()
        lock.touch()
        os.utime(lock, (time.time() - age,) * 2)
    with pytest.warns(UserWarning, match="stale kernel build lock"):
        kernels._clear_stale_build_lock(cpp_extension, "stale")
    kernels._clear_stale_build_lock(cpp_extension, "fresh")
    assert not (tmp_path / "stale" / "lock").exists() and (tmp_path / "fresh" / "lock").exists()


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                               (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("batch,heads,kv_heads,dim", [(1, 4, 2, 64), (5, 8, 8, 32)])
def test_rotary_kv_write_equals_transformers_bit_for_bit(batch, heads, kv_heads, dim, dtype, cache_dtype):
    """The lean decode forward's rotary + cache write: q, k, v as the strided views of one stacked
    projection (as the step has them), against transformers' apply_rotary_pos_emb and two index
    copies. Equal, not close: the lean forward and the module path must write the same cache (a bf16
    model: each product and the sum rounded to bf16, as torch's bf16 ops do)."""
    from transformers.models.qwen2_moe.modeling_qwen2_moe import apply_rotary_pos_emb

    torch.manual_seed(batch)
    qkv = (4 * torch.randn(batch, (heads + 2 * kv_heads) * dim)).to(dtype)
    q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)
    q, k, v = q.view(batch, heads, dim), k.view(batch, kv_heads, dim), v.view(batch, kv_heads, dim)
    angles = torch.rand(batch, dim // 2) * 300
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))   # [B, D]
    slots = torch.randperm(64)[:batch]
    k_cache, v_cache = (torch.zeros(64, kv_heads, dim, dtype=cache_dtype) for _ in range(2))
    out = kernels.rotary_kv_write()(q, k, v, cos, sin, k_cache, v_cache, slots)

    q_ref, k_ref = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    k_expected, v_expected = (torch.zeros(64, kv_heads, dim, dtype=cache_dtype) for _ in range(2))
    k_expected.index_copy_(0, slots, k_ref[0].transpose(0, 1).to(cache_dtype))
    v_expected.index_copy_(0, slots, v.to(cache_dtype))
    assert torch.equal(out, q_ref[0].transpose(0, 1)) and out.is_contiguous()
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    with pytest.raises(RuntimeError, match="slot outside the cache"):
        kernels.rotary_kv_write()(q, k, v, cos, sin, k_cache, v_cache, slots + 64)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("normalise", [True, False])
@pytest.mark.parametrize("rows,experts,k", [(1, 64, 8), (5, 60, 4), (3, 8, 8)])
def test_softmax_topk_equals_the_stock_softmax_router(rows, experts, k, normalise, masked):
    """A decode step's selection in one op: the same experts, sorted, and weights within float
    rounding of torch's (masked_fill ->) softmax -> topk (-> renormalise), as ``routing.select``."""
    torch.manual_seed(rows + experts)
    logits = torch.randn(rows, experts)
    allowed = None
    if masked:
        allowed = torch.zeros(experts, dtype=torch.bool)
        allowed[torch.randperm(experts)[:max(k, experts // 2)]] = True
    weights, index = kernels.softmax_topk()(logits, k, normalise, allowed)
    z = logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))
    want_w, want_i = torch.softmax(z, dim=-1).topk(k, dim=-1)
    if normalise:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert torch.equal(index, want_i)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="k must be in"):
        kernels.softmax_topk()(logits, experts + 1, normalise)


def test_softmax_topk_breaks_ties_toward_the_lower_expert():
    _, index = kernels.softmax_topk()(torch.zeros(1, 4), 2, False)        # every expert scores the same
    assert index.tolist() == [[0, 1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_rows_linear_on_packed_weights_equals_torch(dtype, rows):
    """The packed layout (16-column panels) through the same op, any row count (prefill's too)."""
    torch.manual_seed(rows)
    w, bias = (torch.randn(96, 64) * 0.1).to(dtype), torch.randn(96)
    x = torch.randn(rows, 64)
    out = kernels.rows_linear()(x, kernels.pack_weight(w), bias)
    torch.testing.assert_close(out, rows_in(w, True)(x) @ w.float().T + bias, rtol=1e-4, atol=1e-4)
    rounded = kernels.rows_linear()(x.to(dtype), kernels.pack_weight(w), None)     # bf16 rows: bf16 out
    assert rounded.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_tiles_of_every_row_count(dtype):
    """Each row count up to 8 has its own tile shape (8 rows x 3 panels ... 1 x 6) and more rows go by
    blocks of 8: every count from 1 to 35 against torch, on 7 panels (tiles and leftover panels)."""
    torch.manual_seed(7)
    w = (torch.randn(112, 96) * 0.1).to(dtype)
    packed = kernels.pack_weight(w)
    for rows in range(1, 36):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(kernels.rows_linear()(x, packed, None), rows_in(w, True)(x) @ w.float().T, rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{rows} rows: {m}")


def test_first_build_says_it_compiles_and_how_long_it_took(tmp_path):
    """A new processor's first engine compiles for about a minute: it says so before and after, and a
    cached build says nothing. The build tree is copied without its library, so the 'compile' is a relink."""
    import os
    import subprocess
    import sys

    from torch.utils import cpp_extension

    if kernels._module() is None:
        pytest.skip("the native kernels do not build here")
    name = next(n for n in torch.ops.loaded_libraries if "moetailor_kernels_" in n).rsplit("/", 1)[-1][:-3]
    build = shutil.copytree(cpp_extension._get_build_directory(name, verbose=False), tmp_path / name)
    (build / f"{name}.so").unlink()
    (build / "lock").unlink(missing_ok=True)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    probe = [sys.executable, "-c", "from moetailor import kernels; assert kernels._module() is not None"]
    first = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    assert "compiling the native CPU kernels" in first.stderr and "kernels compiled in" in first.stderr, first.stderr
    again = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "compil" not in again.stderr, again.stderr


def test_each_checkout_and_environment_builds_under_its_own_name(tmp_path):
    """torch rebuilds a cached name whenever its source paths change: two checkouts sharing a venv (or
    two venvs) that shared a name rebuilt each other's build in turn. Same sources at two paths, or in
    two environments, get two names; the same ones twice get one."""
    sources = [Path(kernels.__file__).with_name(n) for n in ("experts.cpp", "vec.h")]
    copy = tmp_path / "other-checkout"
    copy.mkdir()
    copied = [Path(shutil.copy(s, copy / s.name)) for s in sources]
    assert kernels.build_name(sources) == kernels.build_name(list(sources))
    assert kernels.build_name(sources) != kernels.build_name(copied)
    assert kernels.build_name(sources, prefix="/venv-a") != kernels.build_name(sources, prefix="/venv-b")
    before = kernels.build_name(copied)
    (copy / "vec.h").write_text((copy / "vec.h").read_text() + "\n// changed\n")
    assert kernels.build_name(copied) != before                       # new contents, new build


def test_setup_builds_the_kernels_so_the_first_demo_starts_at_once():
    """`make setup` runs `python -m moetailor.kernels`: the build a first `make demo` used to begin with
    (a minute or more) is part of set-up; it exits 0 with or without a compiler."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    recipe = (root / "Makefile").read_text().split("$(STAMP): pyproject.toml", 1)[1].split("\n\n", 1)[0]
    assert "$(PY) -m moetailor.kernels" in recipe and recipe.index("moetailor.kernels") < recipe.index("touch")
    probe = [sys.executable, "-m", "moetailor.kernels"]
    off = subprocess.run(probe, env={**os.environ, "MOETAILOR_NATIVE": "0"}, capture_output=True, text=True, timeout=120)
    assert off.returncode == 0 and "torch's kernels" in off.stderr, off.stderr
    if kernels._module() is None:
        pytest.skip("the native kernels do not build here")
    ready = subprocess.run(probe, capture_output=True, text=True, timeout=600)
    assert ready.returncode == 0 and "native CPU kernels ready" in ready.stderr and "compil" not in ready.stderr
