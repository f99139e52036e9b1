"""Resolve a model name to a local checkpoint and load it. Never touches a hub."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

from .paths import REFERENCE_DIR, bundled_name, resolve_model_path  # noqa: F401  (re-exported)
from .sidecars import DISTILL_PLAN_FILE, DISTILL_SIDECAR, SPLIT_SIDECAR, DistillSidecar, Sidecars, SplitSidecar


def load_model(name: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               placement=None):
    """Load a supported MoE causal LM (fp32 by default: fastest for decode on CPU). Safetensors checkpoints
    are read tensor by tensor (``checkpoint.load_whole``): resident memory is the weights, not twice them.
    The weights then go where ``placement`` (``device.Placement``; default: one for ``device``) puts them.
    The model carries where it came from (``moetailor_source``) and what transforms recorded beside it
    (``moetailor_sidecars``, see ``sidecars.py``)."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    from ..device import Placement
    from .architectures import arch_spec

    placement = placement or Placement.of(device)
    path = resolve_model_path(name)
    arch_spec(read_config(path))  # clear error before loading weights
    try:
        if (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file():
            from .checkpoint import load_whole  # plain reads: resident memory = the weights
            model = load_whole(path, dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except (OSError, SafetensorError, ValueError, KeyError) as e:   # incl. a truncated or incomplete checkpoint
        raise ValueError(f"cannot read the weights of {name} ({_first_line(e)}); a weights file may be truncated or "
                         "missing: copy or export the checkpoint again") from None
    model = placement.model(model)
    model.eval()
    model.moetailor_source = str(path)
    model.moetailor_sidecars = read_sidecars(path)
    return model


def read_split_sidecar(path: str | Path) -> dict | None:
    """The split record of a checkpoint directory, or None for a model that was not split."""
    p = Path(path) / SPLIT_SIDECAR
    return read_json(p, "split sidecar") if p.exists() else None


def read_distill_sidecar(path: str | Path) -> dict | None:
    """The distillation record of a checkpoint directory, or None for a model that was not distilled."""
    p = Path(path) / DISTILL_SIDECAR
    return read_json(p, "distillation sidecar") if p.is_file() else None


def read_sidecars(path: str | Path) -> Sidecars:
    """Every transform record in a checkpoint directory (``load_model`` attaches the result)."""
    split = read_split_sidecar(path)
    distill = read_distill_sidecar(path)
    plan_file = Path(path) / DISTILL_PLAN_FILE
    return Sidecars(
        split=SplitSidecar(int(split["parts"]), split) if split else None,
        distill=DistillSidecar(read_json(plan_file, "distilled decoder's plan"), plan_file, distill.get("source_path"),
                               distill) if distill else None)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:200]


def read_config(name: str | Path):
    """The checkpoint's transformers config, or a one-line error naming the broken config.json."""
    from transformers import AutoConfig

    path = resolve_model_path(name)
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read {path / 'config.json'} ({_first_line(e)}); it is malformed or from an "
                         "unsupported transformers version: restore the checkpoint's config.json") from None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def load_tokenizer(name: str | Path):
    """The checkpoint's tokenizer; FileNotFoundError when its folder has no tokenizer files (transformers
    would otherwise build an empty tokenizer from config.json that turns every text into no tokens)."""
    from transformers import AutoTokenizer

    path = resolve_model_path(name)
    if not any((path / f).exists() for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"the model folder {path.name!r} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
                                "copy the tokenizer of the model it came from into it")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    # moetailor tokenizes whole documents (calibration, held-out KL) and cuts windows itself, and the engine
    # checks every request against the model's own context: the tokenizer's limit only printed a warning
    tokenizer.model_max_length = sys.maxsize
    return tokenizer


def source_name(path: str | Path | None) -> str | None:
    """How a plan or statistics file names the checkpoint it was made from: its name for a
    bundled model (``reference``, ``reference-qwen3``), otherwise the checkpoint's directory name — never a machine path, so a plan can
    ship and move between machines (the router hash, not the name, is what identifies the model)."""
    if path is None:
        return None
    path = Path(path)
    return bundled_name(path) or path.name or str(path)


def fingerprint(config, routers: dict[int, torch.Tensor], source: str | Path | None = None) -> dict:
    """Identity of a model for plans and statistics: shape facts from its config (grouped routing's
    ``n_group`` / ``topk_group`` when grouped) plus a hash of the router weights [E, H] by MoE layer
    index. The one definition: ``model_fingerprint`` (a built model) and the vLLM plugin's
    ``checkpoint_fingerprint`` (safetensors files, no model) both call it."""
    from .adapters import semantics_for
    from .architectures import arch_spec

    sem = semantics_for(config, arch_spec(config))
    h = hashlib.sha256()
    for i in sorted(routers):
        h.update(routers[i].detach().float().cpu().numpy().tobytes())
    fp = {
        "model_type": config.model_type,
        "moe_layers": sorted(routers),
        "num_experts": sem.num_experts,
        "top_k": sem.top_k,
        "router_hash": h.hexdigest()[:16],
        "source": source_name(source),
    }
    if sem.n_group > 1:  # grouped routing (DeepSeek): plans choose kept experts per group
        fp.update(n_group=sem.n_group, topk_group=sem.topk_group)
    return fp


def model_fingerprint(model) -> dict:
    """``fingerprint`` of a built model (or a routers-only skeleton)."""
    from .adapters import moe_layers

    routers = {layer.index: layer.router.weight for layer in moe_layers(model)}
    return fingerprint(model.config, routers, getattr(model, "moetailor_source", None))


def weights_hash(model) -> str:
    """Hash of every parameter and buffer (names, dtypes, shapes, values): two models hash alike only
    when they compute the same function. Reads all weights once (about 1 GB/s)."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def fingerprint_mismatch(expected: dict, actual: dict) -> str | None:
    """A sentence naming the first difference, or None when the fingerprints agree."""
    for key in ("model_type", "moe_layers", "num_experts", "top_k", "n_group", "topk_group", "router_hash"):
        if key in expected and expected[key] != actual.get(key):
            return f"{key}: file says {expected[key]!r}, model has {actual.get(key)!r}"
    return None


def load_checked(value, kind, model):
    """``value`` as a ``kind`` (a ``Plan`` or ``ExpertStats``; loaded when it is a path), checked against
    ``model`` (``kind.check_model`` raises naming the mismatch). None stays None."""
    if value is None:
        return None
    if not isinstance(value, kind):
        value = kind.load(value)
    value.check_model(model)
    return value


def read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} file {path} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"{what} file {path} is a folder; give the path of the {what} file in it") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} file {path} is not UTF-8 text (byte {e.start}); it is not a {what} file or it is "
                         "corrupt — regenerate it") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} file {path} is not valid JSON ({e}); it may be truncated — regenerate it") from None
    except RecursionError:
        raise ValueError(f"{what} file {path} nests too deeply to be a {what} file; regenerate it") from None
