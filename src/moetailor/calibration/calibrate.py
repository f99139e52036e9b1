"""One streaming forward pass that accumulates per-expert statistics (and optionally ExFold tables).

The RoutingController's observer sees each MoE layer's input [T, H] and the stock routes; the
collector recomputes expert outputs for the routed tokens only (``all_experts``: every expert on
every token) into float64 sums, so memory is bounded by one batch, never by the token count.
"""
from __future__ import annotations

import hashlib
import sys
import time
from typing import Callable

import torch

from ..models.adapters import MoeLayer
from ..tables import unknown_choice
from .data import iter_token_batches, parse_data_spec
from .stats import BETA_BINS, STATS_FORMAT, STATS_VERSION, ExpertStats, LayerStats

GATES = {
    "renorm": "g_j = p_j / sum_{i in top-k} p_i, p = router scores over all experts (softmax; sigmoid for "
              "DeepSeek-V3), renormalised over the chosen k",
    "softmax": "g_j = p_j, p = router scores over all experts (softmax; sigmoid for DeepSeek-V3), not renormalised",
}
ALL_EXPERTS_CHUNK_BYTES = 64 << 20  # all-experts mode computes [chunk, E, H] outputs at a time


# expert_outputs(layer, hidden [S, H], experts [S] sorted) -> [S, H]: E_j(x) of each route, without the gate weight
ExpertOutputs = Callable[[MoeLayer, torch.Tensor, torch.Tensor], torch.Tensor]


def module_expert_outputs(layer: MoeLayer, hidden: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """E_j(x) for rows sorted by expert, one expert's rows at a time through the module's weights."""
    out = torch.empty(hidden.shape[0], hidden.shape[1], dtype=torch.float32, device=hidden.device)   # [S, H]
    ids, counts = torch.unique_consecutive(experts, return_counts=True)
    start = 0
    for e, n in zip(ids.tolist(), counts.tolist()):
        out[start:start + n] = layer.expert_forward(e, hidden[start:start + n]).float()             # [n, H]
        start += n
    return out


class Collector:
    """The observer: turns one layer's hidden states and routes into additions to LayerStats."""

    def __init__(self, layers: list[MoeLayer], gate: str = "renorm", fold: bool = False, all_experts: bool = False,
                 expert_outputs: ExpertOutputs | None = None, outputs: bool = True):
        """``outputs=False``: router-side statistics only (frequency, mass, co-selection, beta), for an
        engine whose experts kernel gives no per-route output; EAN and REAP stay zero."""
        if gate not in GATES:
            raise ValueError(unknown_choice("gate definition", gate, GATES))
        self.gate, self.fold, self.all_experts = gate, fold or all_experts, all_experts
        self.expert_outputs = expert_outputs or module_expert_outputs
        self.outputs = outputs or self.fold
        self.stats = {l.index: LayerStats.zeros(l.num_experts, self.fold, l.hidden_size if self.outputs else None,
                                                all_experts)
                      for l in layers}

    @torch.no_grad()
    def __call__(self, layer: MoeLayer, hidden: torch.Tensor, logits: torch.Tensor, weights: torch.Tensor,
                 index: torch.Tensor) -> None:
        st, E = self.stats[layer.index], layer.num_experts
        valid = index < E                                                   # [T, K] (E = dropped route)
        idx = index.clamp_max(E - 1)
        scores = logits.float().sigmoid() if layer.semantics.scoring == "sigmoid-grouped" else logits.float().softmax(-1)
        g = scores.gather(1, idx) * valid                                   # [T, K]
        if self.gate == "renorm":
            g = g / g.sum(-1, keepdim=True).clamp_min(1e-20)
        routed = index[valid]
        st.frequency += torch.bincount(routed, minlength=E).double().cpu()
        st.mass.index_add_(0, routed.cpu(), g[valid].double().cpu())
        multi = torch.zeros(index.shape[0], E + 1, device=index.device).scatter_(1, index, 1.0)[:, :E]  # [T, E]
        st.coselect += (multi.T @ multi).double().cpu()
        if index.shape[1] >= 2:
            top2 = weights.float().masked_fill(~valid, 0.0).topk(2, dim=-1).values               # [T, 2]
            ratio = top2[:, 1] / top2[:, 0].clamp_min(1e-20)
            bins = (ratio[top2[:, 0] > 0] * BETA_BINS).long().clamp(0, BETA_BINS - 1)
            st.beta_hist += torch.bincount(bins, minlength=BETA_BINS).double().cpu()
        if self.all_experts:
            self._all_experts(layer, st, hidden, idx, valid, g)
        elif self.outputs:
            self._routed(layer, st, hidden, index, valid, g)

    def _routed(self, layer, st, hidden, index, valid, g):
        """Expert outputs for routed tokens only; fold sums over pairs co-selected by a token."""
        T, K = index.shape
        E = layer.num_experts
        norms = torch.zeros(T, K, device=hidden.device)                     # [T, K] ||E_j(x)||
        outputs = torch.zeros(T, K, hidden.shape[1], device=hidden.device) if self.fold else None  # [T, K, H]
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        slots = order[flat[order] < E]                                      # [S] live routes, sorted by expert
        rows, cols = slots // K, slots % K
        y = self.expert_outputs(layer, hidden[rows], flat[slots]).float()   # [S, H] E_j(x) per route
        norms[rows, cols] = y.norm(dim=-1)
        add_outputs_by_expert(st, flat[slots], y)                           # output statistics per expert
        if outputs is not None:
            outputs[rows, cols] = y
        st.ean.index_add_(0, index[valid].cpu(), norms[valid].double().cpu())
        st.weighted_ean.index_add_(0, index[valid].cpu(), (g * norms)[valid].double().cpu())
        if outputs is None:
            return
        st.norm_sum.index_add_(0, index[valid].cpu(), norms[valid].double().cpu())
        st.norm_count += torch.bincount(index[valid], minlength=E + 1)[:E].double().cpu()
        dots = outputs @ outputs.transpose(1, 2)                            # [T, K, K] <u, v>
        w = norms[:, :, None]                                               # [T, K, 1] w = ||u|| (source a)
        pair = valid[:, :, None] & valid[:, None, :] & ~torch.eye(K, dtype=torch.bool, device=index.device)
        key = (index[:, :, None] * E + index[:, None, :])[pair].cpu()        # src * E + dst
        for total, value in ((st.fold_uv, w * dots), (st.fold_vv, w * norms[:, None, :] ** 2),
                             (st.fold_uu, (w ** 3).expand(-1, -1, K)), (st.fold_count, torch.ones_like(dots))):
            total.view(-1).index_add_(0, key, value[pair].double().cpu())

    def _all_experts(self, layer, st, hidden, idx, valid, g):
        """Every expert on every token (chunked): folding sees every pair on every token."""
        T, H = hidden.shape
        E = layer.num_experts
        chunk = max(1, ALL_EXPERTS_CHUNK_BYTES // (E * H * 4))
        for s in range(0, T, chunk):
            x = hidden[s:s + chunk]
            y = torch.stack([layer.expert_forward(e, x).float() for e in range(E)], dim=1)  # [c, E, H]
            n = y.norm(dim=-1)                                              # [c, E]
            sel, ok, gg = idx[s:s + chunk], valid[s:s + chunk], g[s:s + chunk]
            routed_norm = n.gather(1, sel)                                  # [c, K]
            st.out_all_sum += y.double().sum(0).cpu()                      # HC-SMoE's signature: every token
            st.out_all_count += x.shape[0]
            for e in sel[ok].unique().tolist():                             # outputs over the routed tokens only
                add_outputs(st, e, y[(sel == e).logical_and(ok).any(-1), e])
            st.ean.index_add_(0, sel[ok].cpu(), routed_norm[ok].double().cpu())
            st.weighted_ean.index_add_(0, sel[ok].cpu(), (gg * routed_norm)[ok].double().cpu())
            dots = y @ y.transpose(1, 2)                                    # [c, E, E]
            nd = n.double()
            st.fold_uv += torch.einsum("ta,tab->ab", nd, dots.double()).cpu()
            st.fold_vv += torch.einsum("ta,tb->ab", nd, nd ** 2).cpu()
            st.fold_uu += (nd ** 3).sum(0).cpu()[:, None].expand(E, E)
            st.fold_count += x.shape[0]
            st.norm_sum += nd.sum(0).cpu()
            st.norm_count += x.shape[0]


def add_outputs(st: LayerStats, expert: int, y: torch.Tensor) -> None:
    """Add expert ``expert``'s outputs y [n, H] on its routed tokens to the output statistics: the
    largest |y_i| (super experts), sum y (novice constant) and sum ||y||^2 (output variance)."""
    if y.shape[0] == 0:
        return
    st.out_max[expert] = max(float(st.out_max[expert]), float(y.abs().max()))
    st.out_sum[expert] += y.double().sum(0).cpu()
    st.out_sq[expert] += float(y.double().pow(2).sum())


def add_outputs_by_expert(st: LayerStats, experts: torch.Tensor, y: torch.Tensor) -> None:
    """``add_outputs`` for rows of several experts at once: expert ids [S], their outputs y [S, H]."""
    if y.shape[0] == 0:
        return
    e = experts.cpu()
    y64 = y.double().cpu()                                                  # [S, H]
    st.out_sum.index_add_(0, e, y64)
    st.out_sq.index_add_(0, e, y64.pow(2).sum(-1))
    peak = torch.zeros_like(st.out_max).scatter_reduce_(0, e, y.abs().amax(-1).double().cpu(), "amax")
    torch.maximum(st.out_max, peak, out=st.out_max)


def calibrate_batches(model, batches, *, gate: str = "renorm", fold: bool = False, all_experts: bool = False,
                      total_tokens: int | None = None, progress: bool = True, meta: dict | None = None) -> ExpertStats:
    """Run ``model`` over ``batches`` (LongTensor [B, S] each) and return the accumulated statistics."""
    from tqdm import tqdm

    from ..models.loading import model_fingerprint
    from ..routing import RoutingController

    installed = RoutingController.installed(model) is None
    ctl = RoutingController.of(model)
    collector = Collector(ctl.layers, gate, fold, all_experts)
    device = ctl.layers[0].router.weight.device
    body = getattr(model, "model", model)  # the decoder stack: no LM head, no [B, S, vocab] logits to hold
    seen = 0
    t0 = time.time()
    bar = tqdm(total=total_tokens, unit="tok", desc="calibrating", disable=not progress, file=sys.stderr,
               mininterval=2)
    try:
        with torch.no_grad(), ctl.policy(None), ctl.observing(collector):
            for batch in batches:
                body(input_ids=batch.to(device), use_cache=False)
                seen += batch.numel()
                bar.update(batch.numel())
    finally:
        bar.close()
        if installed:
            ctl.remove()
    if seen == 0:
        raise ValueError("no calibration tokens were read; check --data and --tokens")
    meta = {"dtype": str(next(model.parameters()).dtype).replace("torch.", ""), **(meta or {})}
    return stats_of(collector, model_fingerprint(model), seen, all_experts, t0, meta)


def stats_of(collector: Collector, fingerprint: dict, tokens: int, all_experts: bool, t0: float,
             meta: dict | None) -> ExpertStats:
    """The collector's sums with the statistics file's metadata (in-memory and streamed calibration)."""
    info = {"format": STATS_FORMAT, "version": STATS_VERSION, "model": fingerprint, "tokens": tokens,
            "gate": {"name": collector.gate, "definition": GATES[collector.gate]}, "fold": collector.fold,
            "all_experts": all_experts, "beta_bins": BETA_BINS, "seconds": round(time.time() - t0, 2)}
    info.update(meta or {})
    return ExpertStats(info, collector.stats)


def calibrate(model, tokenizer, data_spec: str, tokens: int, *, seed: int = 0, batch_tokens: int = 4096,
              seq_len: int = 512, gate: str = "renorm", all_experts: bool = False, fold: bool = False,
              progress: bool = True, command: str | None = None) -> ExpertStats:
    """Calibrate ``model`` on ``tokens`` tokens of ``data_spec`` (see calibration.data). Deterministic
    given ``seed``."""
    spec = parse_data_spec(data_spec)
    if gate not in GATES:
        raise ValueError(unknown_choice("gate definition", gate, GATES))
    torch.manual_seed(seed)
    # a data file is read once: its repeats are not data (the statistics record the tokens it held)
    batches = list(iter_token_batches(tokenizer, spec, tokens, batch_tokens, seq_len, seed, repeat=False))
    return calibrate_batches(model, batches, gate=gate, fold=fold, all_experts=all_experts, total_tokens=tokens,
                             progress=progress, meta=data_meta(spec, batches, seed, seq_len, batch_tokens, command))


def data_meta(spec, batches: list[torch.Tensor], seed: int, seq_len: int, batch_tokens: int,
              command: str | None) -> dict:
    """What statistics record of their data; ``data_sha256`` hashes exactly the token ids they saw."""
    digest = hashlib.sha256()
    for batch in batches:
        digest.update(batch.numpy().astype("<i8").tobytes())
    return {"data": spec.name, "data_sha256": digest.hexdigest()[:16], "seed": seed,
            "seq_len": min(seq_len, batch_tokens), "batch_tokens": batch_tokens, "command": command}


def calibration_record(meta: dict) -> dict:
    """What a plan or a report says about the calibration data behind statistics ``meta``:
    name, token count and content hash (sha256 of the token ids, first 16 hex digits)."""
    return {"data": meta.get("data"), "tokens": meta.get("tokens"), "sha256": meta.get("data_sha256")}


def describe_calibration(record: dict | None) -> str:
    """One line for people: 'tasks (200,000 tokens, sha256 1a2b...)'."""
    if not record or not record.get("data"):
        return "unknown calibration data"
    tokens = record.get("tokens")
    parts = [f"{tokens:,} tokens" if isinstance(tokens, int) else None,
             f"sha256 {record['sha256']}" if record.get("sha256") else None]
    parts = [p for p in parts if p]
    return f"{record['data']}" + (f" ({', '.join(parts)})" if parts else "")
