"""Writing outputs safely: one check before the work, one atomic file writer.

Every verb that writes calls ``check_output`` before it starts any work: an existing output needs
``--overwrite``, an output is never one of the verb's own inputs (not even with ``--overwrite``;
paths are compared after resolving symlinks), a file output is not a directory (and the reverse),
and the folder it goes into can be created and written. Files are written with ``atomic_path``
(or ``write_json`` / ``write_text`` on top of it): a temporary file beside the target, renamed
over it once complete, so an interrupted write leaves neither half a file nor a stray temporary
file, and the result gets the permissions of any new file (the umask), not a temporary file's
0600. Whole checkpoint directories are written the same way by
``transforms.artifacts.checkpoint_directory``.
"""
from __future__ import annotations

import json
import os
import secrets
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def _inside(path: Path, folder: Path) -> bool:
    return folder in path.parents


def _same(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)   # hard links
    except OSError:
        return False


def check_output(out: str | Path, *, overwrite: bool = False, inputs=(), directory: bool = False,
                 replaces: bool = True, flag: str = "--out") -> Path:
    """Raise a one-line error when ``out`` cannot or must not be written; return it as a Path.

    ``inputs``: the paths the verb reads (None entries are skipped). ``directory``: the output is a
    folder (else a file). ``replaces``: a directory output is replaced as a whole (prune, split,
    distill), so no input may live inside it; eval and bench write files into their folder instead.
    Raises FileExistsError when ``out`` exists and ``overwrite`` is false.
    """
    out = Path(out)
    if out.exists():
        if directory and not out.is_dir():
            raise ValueError(f"{flag} {out} is an existing file, but this writes a directory there; choose another "
                             f"{flag} (a folder path)")
        if not directory and out.is_dir():
            raise ValueError(f"{flag} {out} is a directory, but this writes a file; pass a file path, e.g. "
                             f"{flag} {out / 'NAME'}")
    ancestor = out.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"{flag} {out}: {ancestor} is a file, not a folder; choose another {flag}")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {out}: the folder {ancestor} is not writable; choose another {flag}")
    real = out.resolve()
    for given in inputs:
        if given is None:
            continue
        source = Path(given)
        if not source.exists():
            continue
        src = source.resolve()
        if _same(out, source):
            problem = "is the same path as the input"
        elif directory and replaces and _inside(src, real):
            problem = "would replace a folder that holds the input"
        elif not directory and source.is_dir() and _inside(real, src) and out.exists():
            problem = "is a file of the input"
        else:
            continue
        raise ValueError(f"{flag} {out} {problem} {given}; a verb never writes over its own input, even with "
                         f"--overwrite: choose another {flag}")
    if out.exists() and not overwrite:
        raise FileExistsError(f"{flag} {out} already exists; pass --overwrite to replace it or choose another {flag}")
    return out


def normal_permissions(folder: str | Path) -> None:
    """Give every file under ``folder`` the permissions a new file gets (0o666 less the umask):
    safetensors (so ``save_pretrained``) creates its files 0600."""
    folder = Path(folder)
    probe = folder / f".probe-{os.getpid()}-{secrets.token_hex(4)}"
    os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
    try:
        mode = stat.S_IMODE(os.stat(probe).st_mode)
    finally:
        probe.unlink()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; when the block succeeds it replaces ``path`` in one
    rename. The temporary file is removed however the block ends (an exception, or SIGTERM, which
    `moetailor` turns into SystemExit)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        mode = stat.S_IMODE(os.stat(tmp).st_mode)       # 0o666 less the umask: what a new file gets
        yield tmp
        os.chmod(tmp, mode)                             # some writers (safetensors) create files 0600
        os.replace(tmp, path)
    finally:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass


def write_text(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def write_json(path: str | Path, data, indent: int | None = None, **kwargs) -> Path:
    """Write ``data`` as JSON to ``path`` atomically (a killed run never leaves half a file)."""
    return write_text(path, json.dumps(data, indent=indent, **kwargs))


def save_figure(fig, path: str | Path, **kwargs) -> Path:
    """``fig.savefig(path)`` through the atomic writer (a killed run never leaves half a plot)."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=Path(path).suffix.lstrip(".") or "png", **kwargs)
    return Path(path)
