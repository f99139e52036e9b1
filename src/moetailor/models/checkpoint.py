"""A checkpoint on disk read one tensor at a time: the streamed verbs never hold the whole model.

Routed experts are stored per expert in the hub layout (``model.layers.{i}.mlp.experts.{j}.gate_proj
.weight``; Mixtral: ``block_sparse_moe.experts.{j}.w1``), which transformers fuses on load into
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``; ``hub_names`` and ``fused_tensor`` map one
decoder layer both ways.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.nn as nn

from ..memory import free_module, release_memory  # noqa: F401  (re-exported)
from ..tables import unknown_choice
from .architectures import LAYER_KEY, split_layer_key  # noqa: F401  (re-exported)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

# per-model-type hub names of the MoE block and of one expert's three projections (gate, up, down)
HUB_MOE = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2")}
HUB_MOE_DEFAULT = ("mlp", "gate_proj", "up_proj", "down_proj")

EXPERT_KEY = re.compile(r"^(?P<moe>mlp|block_sparse_moe)\.experts\.(?P<expert>\d+)\.(?P<proj>[^.]+)\.weight$")
FUSED_KEY = re.compile(r"^(?P<moe>mlp|block_sparse_moe)\.experts\.(?P<proj>gate_up_proj|down_proj)$")
ROUTER_KEY = re.compile(r"^(?P<moe>mlp|block_sparse_moe)\.gate\.(?P<what>weight|e_score_correction_bias)$")


def hub_layout(model_type: str) -> tuple[str, str, str, str]:
    """(MoE block attribute, gate, up, down projection names) of the hub's per-expert layout."""
    return HUB_MOE.get(model_type, HUB_MOE_DEFAULT)


SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


def _header(file: Path) -> tuple[int, dict]:
    """(byte offset of the data, tensor entries) of a safetensors file."""
    with open(file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


class Checkpoint:
    """Tensor names, shapes and reads of a safetensors checkpoint (sharded or single file).
    Tensors are read with plain file reads into fresh (or given) CPU tensors, not through a memory
    map: a read leaves nothing mapped, so the process's resident memory is what it holds, not every
    page of every shard it has read."""

    def __init__(self, path: str | Path):
        from .paths import resolve_model_path

        self.path = resolve_model_path(path)
        index = self.path / INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.path / SINGLE).is_file():
            weight_map = {k: SINGLE for k in _header(self.path / SINGLE)[1]}
        else:
            raise FileNotFoundError(f"{self.path} has neither {SINGLE} nor {INDEX}; moetailor reads safetensors "
                                    "checkpoints (convert .bin weights with transformers' save_pretrained first)")
        self.weight_map: dict[str, str] = weight_map
        self.config = json.loads((self.path / "config.json").read_text())
        self._headers: dict[str, tuple[int, dict]] = {}

    def _entry(self, name: str) -> tuple[Path, int, dict]:
        shard = self.weight_map.get(name)
        if shard is None:
            raise KeyError(f"{self.path} has no tensor {name}")
        if shard not in self._headers:
            self._headers[shard] = _header(self.path / shard)
        start, header = self._headers[shard]
        return self.path / shard, start, header[name]

    def keys(self) -> list[str]:
        """Tensor names in file order (shard by shard, by offset): reading in this order is sequential."""
        def order(name):
            file, _, entry = self._entry(name)
            return file.name, entry["data_offsets"][0]
        return sorted(self.weight_map, key=order)

    def shape(self, name: str) -> list[int]:
        return list(self._entry(name)[2]["shape"])

    def get(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """One tensor in its stored dtype, read into ``out`` (a contiguous tensor of its shape and
        dtype, e.g. a slice of a fused tensor) or a fresh CPU tensor."""
        file, start, entry = self._entry(name)
        dtype, shape = SAFETENSORS_DTYPES[entry["dtype"]], entry["shape"]
        begin, end = entry["data_offsets"]
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        elif list(out.shape) != list(shape) or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(f"cannot read {name} {shape} {dtype} into a {list(out.shape)} {out.dtype} tensor")
        if end > begin:
            view = out.view(-1).view(torch.uint8).numpy()
            with open(file, "rb") as f:
                f.seek(start + begin)
                if f.readinto(memoryview(view)) != end - begin:
                    raise ValueError(f"{file} is truncated (reading {name}); re-download or rewrite the checkpoint")
        return out

    def nbytes(self) -> int:
        return sum((self.path / s).stat().st_size for s in set(self.weight_map.values()))

    def close(self) -> None:
        self._headers.clear()

    def fused_tensor(self, name: str, model_type: str, num_experts: int,
                     substituted: dict[int, tuple[int, ...]] | None = None) -> torch.Tensor:
        """The tensor named ``name`` in the in-memory (fused) state dict, read from either layout.
        ``substituted``: per layer, experts a novice checkpoint stores no weights for (zero rows)."""
        if name in self.weight_map:
            return self.get(name)
        split = split_layer_key(name)
        if split is None:
            raise KeyError(f"{self.path} has no tensor {name}")
        layer, rest = split
        base = name[: len(name) - len(rest)]
        moe, gate, up, down = hub_layout(model_type)
        m = FUSED_KEY.match(rest)
        if m:   # read expert by expert straight into the fused tensor: no other copy in memory
            projs = (gate, up) if m["proj"] == "gate_up_proj" else (down,)
            names = [[f"{base}{moe}.experts.{e}.{p}.weight" for p in projs] for e in range(num_experts)]
            absent = set((substituted or {}).get(layer, ()))
            stored = next(e for e in range(num_experts) if e not in absent)
            shapes = [self.shape(n) for n in names[stored]]
            dtype = SAFETENSORS_DTYPES[self._entry(names[stored][0])[2]["dtype"]]
            out = torch.empty(num_experts, sum(s[0] for s in shapes), shapes[0][1], dtype=dtype)
            for e, expert in enumerate(names):   # gate_up [E, 2I, H]: gate rows then up rows (chunk(2) order)
                if e in absent:                  # a novice checkpoint's replaced expert: never run
                    out[e].zero_()
                    continue
                start = 0
                for n, shape in zip(expert, shapes):
                    self.get(n, out=out[e, start:start + shape[0]])
                    start += shape[0]
            return out
        m = ROUTER_KEY.match(rest)
        if m:
            return self.get(f"{base}{moe}.gate.{m['what']}")
        raise KeyError(f"{self.path} has no tensor {name}")


def hub_names(name: str, shape: tuple[int, ...], model_type: str) -> list[tuple[str, tuple[int, ...], tuple]]:
    """The hub-layout tensors that store the fused tensor ``name`` of ``shape``: a list of
    (hub name, hub shape, (expert, row slice) or ()) — the inverse of ``Checkpoint.fused_tensor``."""
    split = split_layer_key(name)
    if split is None:
        return [(name, shape, ())]
    layer, rest = split
    base = name[: len(name) - len(rest)]
    moe, gate, up, down = hub_layout(model_type)
    m = FUSED_KEY.match(rest)
    if m and m["proj"] == "gate_up_proj":
        E, two_i, H = shape
        return [(f"{base}{moe}.experts.{e}.{p}.weight", (two_i // 2, H), (e, half))
                for e in range(E) for half, p in enumerate((gate, up))]
    if m:
        E, H, I = shape
        return [(f"{base}{moe}.experts.{e}.{down}.weight", (H, I), (e, None)) for e in range(E)]
    m = ROUTER_KEY.match(rest)
    if m:
        return [(f"{base}{moe}.gate.{m['what']}", shape, ())]
    return [(name, shape, ())]


def meta_model(config, dtype: torch.dtype):
    """The stock model for ``config`` on the meta device: module tree and shapes, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def load_module(module: nn.Module, prefix: str, ckpt: Checkpoint, model_type: str, num_experts: int,
                dtype: torch.dtype) -> nn.Module:
    """Materialise ``module`` (named ``prefix`` in the model) on the CPU from the checkpoint."""
    state = {}
    for key, value in module.state_dict().items():   # meta tensors: names, shapes and dtypes only
        full = f"{prefix}.{key}" if prefix else key
        state[key] = ckpt.fused_tensor(full, model_type, num_experts).to(value.dtype)
    module.load_state_dict(state, strict=True, assign=True)
    module.requires_grad_(False)
    return module


def skeleton(path: str | Path, dtype: torch.dtype | None = None):
    """(meta model with routers, the norm and rotary tables loaded; Checkpoint). Nothing else is in
    memory: ``moe_layers``, ``model_fingerprint`` and plans work on it; decoder layers load on demand.
    ``dtype`` None = the stored dtype (the fingerprint then equals a model loaded in that dtype)."""
    from transformers import AutoConfig

    from .adapters import moe_layers
    from .architectures import arch_spec

    ckpt = Checkpoint(path)
    dtype = dtype or stored_dtype(ckpt.path)
    config = AutoConfig.from_pretrained(ckpt.path, local_files_only=True)
    spec = arch_spec(config)
    model = meta_model(config, dtype)
    model.eval()
    names = {id(m): n for n, m in model.named_modules()}
    E = spec.num_experts(config)
    for layer in moe_layers(model):
        load_module(layer.router, names[id(layer.router)], ckpt, config.model_type, E, dtype)
    base = _cpu_rotary(model, config)
    if hasattr(base, "norm"):
        load_module(base.norm, names[id(base.norm)], ckpt, config.model_type, E, dtype)
    model.moetailor_source = str(ckpt.path)
    model.moetailor_checkpoint = ckpt
    return model, ckpt


def _cpu_rotary(model, config) -> nn.Module:
    """Rebuild the meta model's rotary table on the CPU from the config (its inv_freq is not
    persistent, so no checkpoint stores it); returns the decoder stack."""
    base = getattr(model, "model", model)
    rotary = getattr(base, "rotary_emb", None)
    if rotary is not None:
        with torch.device("cpu"):
            base.rotary_emb = type(rotary)(config)
    return base


def load_whole(path: str | Path, dtype: torch.dtype | None = None):
    """The whole stock model, read tensor by tensor with plain file reads into its final tensors:
    resident memory ends at the weights (+ one tensor while it is cast, when ``dtype`` is not the
    stored one), where ``from_pretrained`` maps the shards and holds near twice the weights.
    ``dtype`` None = the stored dtype."""
    from transformers import AutoConfig, GenerationConfig

    from .architectures import arch_spec

    ckpt = Checkpoint(path)
    dtype = dtype or stored_dtype(ckpt.path)
    config = AutoConfig.from_pretrained(ckpt.path, local_files_only=True)
    E = arch_spec(config).num_experts(config)
    model = meta_model(config, dtype)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {}
    from .novice import read_constants, substituted_experts

    substituted = substituted_experts(config)
    for key, value in model.state_dict().items():   # meta tensors: names, shapes and dtypes only
        if tied and key == "lm_head.weight" and key not in ckpt.weight_map:
            continue
        state[key] = ckpt.fused_tensor(key, config.model_type, E, substituted).to(value.dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.tie_weights()
    _cpu_rotary(model, config)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"{ckpt.path} does not store {', '.join(left[:3])}; the checkpoint is incomplete")
    if (ckpt.path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(ckpt.path, local_files_only=True)
    if substituted:   # a novice checkpoint: the constants its plan adds (models/novice.py)
        model.moetailor_substituted = substituted
        model.moetailor_constants = read_constants(ckpt, config, substituted)
    return model.eval()


def stored_dtype(path: str | Path) -> torch.dtype:
    """The dtype a checkpoint stores its weights in (config ``dtype``/``torch_dtype``; fp32 if unset)."""
    from .paths import resolve_model_path

    config = json.loads((resolve_model_path(path) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    value = getattr(torch, name, None) if isinstance(name, str) else None
    return value if isinstance(value, torch.dtype) else torch.float32


class ShardWriter:
    """Writes tensors into safetensors shards of at most ``shard_bytes`` as they arrive (memory: one
    shard), then ``model.safetensors`` (one shard) or ``model-0000i-of-0000N.safetensors`` + index."""

    def __init__(self, directory: Path, shard_bytes: int = 1 << 30):
        self.directory, self.shard_bytes = Path(directory), shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[str, list[str]]] = []       # (temporary file name, tensor names)
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.shard_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        tmp = f".shard-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(self.directory / tmp), metadata={"format": "pt"})
        self.files.append((tmp, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0
        release_memory()

    def close(self) -> dict[str, str]:
        """Finish the last shard, name the shards, write the index; returns the weight map."""
        if self.pending or not self.files:
            self._flush()
        n = len(self.files)
        weight_map = {}
        for i, (tmp, names) in enumerate(self.files):
            final = SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.directory / tmp).rename(self.directory / final)
            weight_map.update({k: final for k in names})
        if n > 1:
            (self.directory / INDEX).write_text(json.dumps({"metadata": {"total_size": self.total},
                                                            "weight_map": weight_map}, indent=2))
        return weight_map


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def working_dtype(name: str, path: str | Path) -> torch.dtype:
    """``--dtype``: 'auto' = the checkpoint's stored dtype (bf16 for hub MoE checkpoints), or a name."""
    if name == "auto":
        return stored_dtype(path)
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(name, name)   # the CLI's spelling
    if name not in DTYPES:
        raise ValueError(unknown_choice("--dtype", name, ("auto", *DTYPES)))
    return DTYPES[name]


def should_stream(path: str | Path, dtype: torch.dtype, mode: str = "auto", share: float = 0.6,
                  device: torch.device | None = None) -> bool:
    """``--stream``: 'on', 'off', or 'auto' = when the weights in ``dtype`` exceed ``share`` of the
    memory available now on ``device`` (host memory for the CPU, the GPU's free memory for a GPU;
    then one decoder layer at a time)."""
    from ..device import free_bytes

    if mode not in ("auto", "on", "off"):
        raise ValueError(unknown_choice("--stream", mode, ("auto", "on", "off")))
    if mode != "auto":
        return mode == "on"
    ckpt = Checkpoint(path)
    need = ckpt.nbytes() / stored_dtype(path).itemsize * dtype.itemsize
    free = free_bytes(device if device is not None else torch.device("cpu"))
    return free is not None and need > share * free
