"""Options several verbs share, defined once so they are spelled, defaulted and described alike.

Not a verb (no ``register``). ``--dtype`` takes auto | fp32 | bf16 | fp16 everywhere (float32,
bfloat16 and float16 are accepted as the same values); ``--overwrite`` replaces an existing output
(``--force`` is the same flag).
"""
from __future__ import annotations

import argparse
import shlex
import sys

DTYPE_SPELLINGS = {"auto": "auto", "fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16",
                   "fp16": "fp16", "float16": "fp16"}
TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def dtype_value(allowed: tuple[str, ...]):
    """An argparse ``type`` that reads any spelling of a dtype and returns its short name."""
    def parse(text: str) -> str:
        name = DTYPE_SPELLINGS.get(str(text).strip().lower())
        if name is None or name not in allowed:
            raise argparse.ArgumentTypeError(f"invalid dtype {text!r}; choose from {', '.join(allowed)} (float32, "
                                             "bfloat16 and float16 are accepted for fp32, bf16, fp16)")
        return name
    return parse


def add_dtype_option(parser, what: str, default: str, flag: str = "--dtype",
                     allowed: tuple[str, ...] = ("auto", "fp32", "bf16", "fp16"), default_words: str | None = None) -> None:
    """``--dtype`` with the one spelling; ``auto`` = the checkpoint's stored dtype. ``default_words``: what
    a ``None`` default means, where it is not "off"."""
    words = (default_words or "default: off") if default is None else f"default {default}" + (
        " (the checkpoint's stored dtype)" if default == "auto" else "")
    if "auto" in allowed and default != "auto":
        words += "; auto: the checkpoint's stored dtype"
    parser.add_argument(flag, type=dtype_value(allowed), default=default, metavar="{" + ",".join(allowed) + "}",
                        help=f"{what} ({words}; float32/bfloat16/float16 accepted too)")


def torch_name(name: str | None) -> str | None:
    """The torch spelling of a short dtype name ('bf16' -> 'bfloat16'); 'auto' and None unchanged."""
    return TORCH_NAMES.get(name, name) if name is not None else None


def invocation(verb: str | None = None) -> str | None:
    """This process's command line (``moetailor ...``, shell-quoted) for an output's record; None when
    ``verb`` is given and the process is not `moetailor VERB` (a verb called from Python)."""
    if verb is not None and sys.argv[1:2] != [verb]:
        return None
    return "moetailor " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def add_overwrite_option(parser, help: str = "replace --out if it exists") -> None:
    parser.add_argument("--overwrite", "--force", dest="overwrite", action="store_true", help=help + " (--force: the same)")


def device_value(text: str) -> str:
    """An argparse ``type`` for ``--device``: the spelling only (whether torch sees that GPU is checked
    when the verb starts, before any model loads: ``resolve_device_option``)."""
    from ..device import parse_device

    try:
        return parse_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--device ")) from None


def add_device_option(parser, default: str = "auto", what: str = "where the model's weights run") -> None:
    """``--device {auto,cpu,cuda,cuda:N}``; auto = the first GPU torch sees, else the CPU."""
    parser.add_argument("--device", type=device_value, default=default, metavar="{auto,cpu,cuda,cuda:N}",
                        help=f"{what} (default {default}; auto: a GPU when torch sees one, else the CPU; "
                             "docs/scale.md#devices)")


def resolve_device_option(args) -> None:
    """``args.device`` as a torch device; a GPU torch does not see is a one-line error (exit 2) here,
    before the verb loads a model or writes anything."""
    from ..device import resolve_device

    if isinstance(getattr(args, "device", None), str):
        args.device = resolve_device(args.device)


def add_backend_options(parser) -> None:
    """``--backend`` / ``--vllm-url`` of the verbs that score plans (eval, tune): where candidates run."""
    parser.add_argument("--backend", choices=("engine", "vllm"), default="engine",
                        help="where candidate plans run: engine (moetailor's embedded engine, default) or vllm (one "
                             "vLLM engine with moetailor's plugin, plans switched between candidates: vllm.LLM in this "
                             "process from .venv-vllm/bin/moetailor, or the server at --vllm-url)")
    parser.add_argument("--vllm-url", default=None, metavar="URL",
                        help="with --backend vllm: a running `moetailor serve MODEL --backend vllm` (e.g. "
                             "http://127.0.0.1:8000) instead of an engine in this process")
