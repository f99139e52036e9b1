"""Layer-streamed calibration: ``calibrate``'s statistics for a checkpoint that does not fit in memory.

All batches go through the embeddings, then decoder layer 0 (loaded from the shards, then freed), then
layer 1, ... (``models.streamed.LayerStream``), observed by the same ``Collector``, so the statistics
are the in-memory ones, only computed layer-major. Peak memory: one decoder layer plus all batches'
activations (spilled to disk above ``spill_bytes``).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from ..tables import unknown_choice
from .calibrate import GATES, Collector, data_meta, stats_of
from .data import iter_token_batches, parse_data_spec


def calibrate_streamed(source: str | Path, tokenizer, data_spec: str, tokens: int, *, dtype: torch.dtype | None = None,
                       seed: int = 0, batch_tokens: int = 4096, seq_len: int = 512, gate: str = "renorm",
                       all_experts: bool = False, fold: bool = False, progress: bool = True,
                       command: str | None = None, spill_dir: str | Path | None = None,
                       spill_bytes: int = 4 << 30, placement=None):
    """Calibrate the checkpoint at ``source`` layer by layer (arguments as ``calibrate``; ``dtype``
    None = the checkpoint's stored dtype), each layer on ``placement``'s device in turn (default the
    CPU). Deterministic given ``seed``."""
    from tqdm import tqdm

    from ..memory import peak_rss_gib
    from ..models.loading import model_fingerprint
    from ..models.streamed import LayerStream, spill_directory
    from ..routing import RoutingController

    spec = parse_data_spec(data_spec)
    if gate not in GATES:
        raise ValueError(unknown_choice("gate definition", gate, GATES))
    t0 = time.time()
    stream = LayerStream(source, dtype, placement)
    fingerprint = model_fingerprint(stream.model)
    torch.manual_seed(seed)
    batches = list(iter_token_batches(tokenizer, spec, tokens, batch_tokens, seq_len, seed, repeat=False))
    seen = sum(b.numel() for b in batches)
    if seen == 0:
        raise ValueError("no calibration tokens were read; check --data and --tokens")
    shapes = [tuple(b.shape) for b in batches]
    ctl = RoutingController.of(stream.model)
    collector = Collector(ctl.layers, gate, fold, all_experts)
    total = len(stream.layers) * seen
    bar = tqdm(total=total, unit="tok", desc="calibrating (layer-streamed)", disable=not progress, file=sys.stderr,
               mininterval=2)
    act_bytes = seen * stream.config.hidden_size * stream.dtype.itemsize
    try:
        with spill_directory(act_bytes, spill_bytes, spill_dir) as spill, ctl.policy(None), ctl.observing(collector):
            acts = stream.embed(batches, spill)
            stream.run_layers(acts, shapes, on_batch=lambda i, b: bar.update(batches[b].numel()),
                              after_layer=lambda i: bar.set_postfix_str(f"layer {i + 1}/{len(stream.layers)}, "
                                                                        f"peak RSS {peak_rss_gib():.1f} GiB"))
    finally:
        bar.close()
        ctl.remove()
        stream.close()
    meta = {**data_meta(spec, batches, seed, seq_len, batch_tokens, command), "streamed": True,
            "dtype": str(stream.dtype).replace("torch.", ""), "peak_rss_gib": round(peak_rss_gib(), 2),
            "device": str(stream.placement.device), "peak_device_bytes": stream.placement.device_peak_bytes()}
    return stats_of(collector, fingerprint, seen, all_experts, t0, meta)
