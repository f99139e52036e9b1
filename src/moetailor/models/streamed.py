"""Running a checkpoint layer by layer: embeddings, then one decoder layer at a time from the shards.

Memory holds one decoder layer plus every batch's activations ([tokens, H]; on disk beyond
``spill_bytes``), never the model; with a ``placement`` on a GPU, device memory holds one layer and
one batch. Each layer sees the inputs the stock model gives it: mask, position ids and rotary tables
are captured by running the stock base model once per batch shape with recorders for its layers, so
every architecture's mask rules are the stock ones. A RoutingController installed on the meta-device
skeleton (``checkpoint.skeleton``) acts on each layer while it is loaded.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn as nn

from .adapters import decoder_layers
from .architectures import arch_spec
from .checkpoint import load_module, skeleton, stored_dtype


class _Recorder(nn.Module):
    """Stands in for decoder layer ``index``: records its call arguments, passes hidden through."""

    def __init__(self, sink: dict, index: int):
        super().__init__()
        self.sink, self.index = sink, index

    def forward(self, hidden_states, *args, **kwargs):
        self.sink[self.index] = (args, kwargs)
        return hidden_states


class Activations:
    """Per-batch hidden states [B, S, H], in memory or (``spill_dir``) one file per batch on disk."""

    device = torch.device("cpu")   # where the activations wait between layers

    def __init__(self, spill_dir: str | Path | None = None):
        self.spill_dir = None if spill_dir is None else Path(spill_dir)
        self.memory: dict[int, torch.Tensor] = {}

    def __setitem__(self, b: int, value: torch.Tensor) -> None:
        if self.spill_dir is None:
            self.memory[b] = value
        else:
            from safetensors.torch import save_file
            save_file({"h": value.contiguous()}, str(self.spill_dir / f"{b}.safetensors"))

    def __getitem__(self, b: int) -> torch.Tensor:
        if self.spill_dir is None:
            return self.memory[b]
        from safetensors.torch import load_file
        return load_file(str(self.spill_dir / f"{b}.safetensors"))["h"]


class LayerStream:
    """A checkpoint run layer-major over a fixed list of token batches (see the module docstring)."""

    def __init__(self, path: str | Path, dtype: torch.dtype | None = None, placement=None):
        from ..device import Placement

        self.placement = placement or Placement.of("cpu")
        self.dtype = dtype or stored_dtype(path)
        self.model, self.ckpt = skeleton(path, self.dtype)
        self.config = self.model.config
        self.num_experts = arch_spec(self.config).num_experts(self.config)
        self.base = getattr(self.model, "model", self.model)
        self.layers = decoder_layers(self.model)
        self._inputs: dict[tuple, dict[int, tuple]] = {}

    def _load(self, module: nn.Module, prefix: str) -> nn.Module:
        return load_module(module, prefix, self.ckpt, self.config.model_type, self.num_experts, self.dtype)

    def load_layer(self, i: int) -> nn.Module:
        """Decoder layer ``i`` read from the shards onto the compute device."""
        return self.placement.layer(self._load(self.layers[i], f"model.layers.{i}"))

    def free_layer(self, i: int) -> None:
        self.placement.release(self.layers[i])

    def forward_layer(self, i: int, acts: "Activations", shapes: list[tuple[int, int]],
                      on_batch: Callable[[int, int], None] | None = None) -> None:
        """Every batch through the loaded decoder layer ``i``, one batch on the device at a time."""
        layer = self.layers[i]
        with torch.no_grad():
            for b, shape in enumerate(shapes):
                args, kwargs = self.placement.inputs(self.layer_inputs(shape, i))
                hidden = self.placement.inputs(acts[b])                                 # [B, S, H]
                out = layer(hidden, *args, **kwargs)
                out = out[0] if isinstance(out, tuple) else out
                self.placement.step(hidden, out, args, kwargs)
                acts[b] = out.to(acts.device)
                del hidden, out
                if on_batch is not None:
                    on_batch(i, b)

    def layer_inputs(self, shape: tuple[int, int], index: int) -> tuple[tuple, dict]:
        """The (args, kwargs) the stock model passes decoder layer ``index`` for a batch [B, S]."""
        if shape not in self._inputs:
            sink: dict[int, tuple] = {}
            layers = self.base.layers
            self.base.layers = nn.ModuleList([_Recorder(sink, i) for i in range(len(layers))])
            try:
                embeds = torch.zeros(*shape, self.config.hidden_size, dtype=self.dtype)   # [B, S, H]
                with torch.no_grad():
                    self.base(inputs_embeds=embeds, use_cache=False)
            finally:
                self.base.layers = layers
            self._inputs[shape] = sink
        return self._inputs[shape][index]

    def embed(self, batches: list[torch.Tensor], spill_dir: str | Path | None = None) -> Activations:
        """Hidden states after the embeddings, one entry per batch (LongTensor [B, S] each)."""
        acts = Activations(spill_dir)
        embed = self.placement.layer(self._load(self.base.embed_tokens, "model.embed_tokens"))
        with torch.no_grad():
            for b, ids in enumerate(batches):
                ids = self.placement.inputs(ids)
                hidden = embed(ids)                                                      # [B, S, H]
                self.placement.step(ids, hidden)
                acts[b] = hidden.to(acts.device)
        self.placement.release(embed)
        return acts

    def run_layers(self, acts: Activations, shapes: list[tuple[int, int]],
                   on_batch: Callable[[int, int], None] | None = None,
                   after_layer: Callable[[int], None] | None = None) -> Activations:
        """Push every batch through every decoder layer, loading one layer at a time."""
        for i in range(len(self.layers)):
            self.load_layer(i)
            self.forward_layer(i, acts, shapes, on_batch)
            self.free_layer(i)
            if after_layer is not None:
                after_layer(i)
        return acts

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm and LM head on hidden [B, S, H] -> logits [B, S, V] (fp32)."""
        head = getattr(self.model, "lm_head", None)
        if head is None or getattr(self.config, "tie_word_embeddings", False) and \
                "lm_head.weight" not in self.ckpt.weight_map:
            weight = self.ckpt.get("model.embed_tokens.weight")
        else:
            weight = self.ckpt.get("lm_head.weight")
        with torch.no_grad(), self.placement.visiting(self.base.norm) as norm:
            h = norm(self.placement.inputs(hidden))
            weight = self.placement.inputs(weight.to(h.dtype))                           # [V, H]
            logits = torch.nn.functional.linear(h, weight).float()                       # [B, S, V]
            self.placement.step(h, weight, logits)
        return logits.to("cpu")

    def close(self) -> None:
        self.ckpt.close()


def spill_directory(total_bytes: int, spill_bytes: int, spill_dir: str | Path | None) -> Iterator:
    """A context yielding the directory activations spill to (None: keep them in memory)."""
    from contextlib import nullcontext

    if spill_dir is None and total_bytes <= spill_bytes:
        return nullcontext(None)
    if spill_dir is not None:
        Path(spill_dir).mkdir(parents=True, exist_ok=True)
    print(f"activations ({total_bytes / 2**30:.1f} GiB) spill to disk", file=sys.stderr)
    return tempfile.TemporaryDirectory(prefix="moetailor-acts-", dir=spill_dir)
