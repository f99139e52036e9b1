"""Writing model artifacts safely: a directory appears whole or not at all.

Refuse an existing output unless told to overwrite (never one of the run's inputs), build in a hidden
temporary directory beside it, then rename it into place: an exception, Ctrl-C or SIGTERM never leaves
half a checkpoint or the temporary directory behind.
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..models.loading import read_distill_sidecar, resolve_model_path
from ..models.sidecars import DISTILL_PLAN_FILE, DISTILL_SIDECAR
from ..outputs import check_output, mark_output, normal_permissions
from ..plans.plan import Plan

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "vocab.txt",
                   "merges.txt", "tokenizer.model", "chat_template.jinja", "added_tokens.json")

COPIED = ("generation_config.json",)   # files copied beside the weights of a checkpoint written from another


def refuse_existing(out: str | Path, overwrite: bool, inputs=()) -> Path:
    """The checks before a transform starts: see ``outputs.check_output`` (a directory output)."""
    return check_output(out, overwrite=overwrite, inputs=inputs, directory=True)


@contextmanager
def checkpoint_directory(out: str | Path, overwrite: bool = False, inputs=()) -> Iterator[Path]:
    """Yield a temporary directory; when the block succeeds it replaces ``out`` in one rename."""
    out = refuse_existing(out, overwrite, inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    old = None
    try:
        yield tmp
        mark_output(tmp)   # a later --overwrite may replace it: moetailor wrote it
        normal_permissions(tmp)
        # no signal between the two renames: out is always either the old or the new checkpoint
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            if out.exists() and not overwrite:   # made meanwhile by something that is not moetailor
                raise FileExistsError(f"--out {out} appeared while this ran; pass --overwrite to replace it or "
                                      "choose another --out")
            if out.exists():
                old = out.parent / f".{out.name}.old-{os.getpid()}"
                os.replace(out, old)
            os.replace(tmp, out)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def checkpoint_source(model) -> Path | None:
    """The checkpoint directory behind ``model`` (a path, a bundled name or a loaded model), if any."""
    if isinstance(model, (str, Path)):
        return resolve_model_path(model)
    return Path(model.moetailor_source) if getattr(model, "moetailor_source", None) else None


def model_from_state(config, state: dict, dtype, what: str):
    """A stock model of ``config`` holding ``state`` (a rewritten state dict): every transform builds
    its output this way. Fails loudly when the state and the config disagree (a slicing bug)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if "rotary" not in k and k not in getattr(model, "_tied_weights_keys", {})]
    if missing or unexpected:
        raise RuntimeError(f"{what} state does not fit its config: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


def tensor_bar(names, desc: str, progress: bool):
    """A progress bar over a checkpoint's tensors on stderr (closed however the loop ends, so an error
    prints after it, on its own line)."""
    from tqdm import tqdm

    return tqdm(total=len(names), unit="tensor", desc=desc, disable=not progress, file=sys.stderr, mininterval=2)


def finish_streamed(ckpt, writer, config, tmp: Path) -> None:
    """Close the output shards and the source, then write the config and ``COPIED`` beside them (the
    writer copies the tokenizer last)."""
    writer.close()
    ckpt.close()
    config.save_pretrained(tmp)
    for extra in COPIED:
        if (ckpt.path / extra).is_file():
            shutil.copy2(ckpt.path / extra, tmp / extra)


def copy_tokenizer(source: str | Path | None, dest: Path) -> None:
    """Copy whatever tokenizer files ``source`` has (a checkpoint is only usable with its tokenizer)."""
    if source is None:
        return
    for name in TOKENIZER_FILES:
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, dest / name)


@dataclass(frozen=True)
class Distilled:
    """A distilled decoder on disk: ``model_path`` (stock checkpoint) to decode with ``plan.decode``;
    ``prefill_model`` is the original model the prefill (and its KV cache) should come from."""

    model_path: Path
    plan: Plan
    prefill_model: str | None
    meta: dict

    def __iter__(self):  # model_path, plan = load_distilled(dir)
        return iter((self.model_path, self.plan))


def load_distilled(path: str | Path) -> Distilled:
    """Read a ``moetailor distill`` output directory (for evaluation and serving)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist; write it first with `moetailor distill MODEL PLAN --out {path}`")
    side = read_distill_sidecar(path)
    if side is None:
        raise FileNotFoundError(f"{path} is not a `moetailor distill` output (no {DISTILL_SIDECAR}); run `moetailor distill`")
    return Distilled(path, Plan.load(path / DISTILL_PLAN_FILE), side.get("source_path"), side)
