"""Writing outputs safely (docs/reliability.md): ``check_output`` before any work (which also claims
the output against a second run), ``atomic_path`` for every file (temporary file + rename).
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import secrets
import stat
import tempfile
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Iterator

MARKER = ".moetailor-output"   # written into every directory moetailor replaces as a whole
OWN_FILES = (MARKER, "moetailor_pruning.json", "moetailor_split.json", "moetailor_distill.json",
             "moetailor_synthetic.json")   # the sidecars mark checkpoints written before the marker existed
LOCK_DIR = Path(tempfile.gettempdir()) / "moetailor-locks"
_claims: dict[str, Path] = {}   # resolved output path -> the lock file this process holds


def _lock_file(out: Path) -> Path:
    key = os.path.realpath(out)
    return LOCK_DIR / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ancestors() -> set[int]:
    """The pids of this process's parents, up to init (from /proc; empty where there is none)."""
    found, pid = set(), os.getppid()
    while pid > 1 and pid not in found:
        found.add(pid)
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            pid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        except (OSError, StopIteration, ValueError):
            break
    return found


def claim_output(out: str | Path, flag: str = "--out", shared_with_parents: bool = False) -> None:
    """Hold ``out`` for this process until ``release_outputs`` (or exit): a lock file created with
    O_EXCL, so a second moetailor run given the same output fails at once instead of racing this
    one to the final rename. A lock whose process has died is taken over. ``shared_with_parents``: a
    worker process of a run (a vLLM engine's worker) accepts the claim one of its parents holds."""
    key = os.path.realpath(out)
    if key in _claims:
        return
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    with suppress(PermissionError):
        os.chmod(LOCK_DIR, 0o1777)   # every user's runs share it, like /tmp
    lock = _lock_file(Path(out))
    for _ in range(3):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = int(lock.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                holder = None   # being written this instant, or unreadable: treat as held
            if holder is not None and not _alive(holder):
                lock.unlink(missing_ok=True)   # its run was killed (SIGKILL): nothing holds it
                continue
            if shared_with_parents and holder is not None and holder in _ancestors():
                return                         # the run this worker process belongs to holds it
            raise FileExistsError(f"{flag} {out} is being written by another moetailor run (pid {holder or '?'}); "
                                  f"wait for it to finish or choose another {flag}") from None
        with os.fdopen(fd, "w") as f:
            f.write(f"{os.getpid()} {key}\n")
        _claims[key] = lock
        return
    raise FileExistsError(f"{flag} {out} is being claimed by another moetailor run; try again or choose another {flag}")


def release_outputs() -> None:
    """Give up every output this process claimed (the verb is done, or failed)."""
    while _claims:
        _, lock = _claims.popitem()
        with suppress(OSError, IndexError):
            if lock.read_text().split()[0] == str(os.getpid()):
                lock.unlink()


atexit.register(release_outputs)


def written_by_moetailor(folder: Path) -> bool:
    """An empty folder, or one a moetailor verb wrote (its marker or a checkpoint sidecar)."""
    return not any(folder.iterdir()) or any((folder / name).is_file() for name in OWN_FILES)


def mark_output(folder: str | Path, command: str | None = None) -> None:
    """Write the marker that lets a later ``--overwrite`` replace this folder."""
    (Path(folder) / MARKER).write_text(json.dumps({"written_by": "moetailor", "command": command}) + "\n")


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
    Raises FileExistsError when ``out`` exists and ``overwrite`` is false, or another moetailor
    run holds it (``claim_output``)."""
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
    for given in (g for g in inputs if g is not None and Path(g).exists()):
        source = Path(given)
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
    claim_output(out, flag)   # first claim, then look: a run that finished meanwhile has written it
    if out.exists() and not overwrite:
        raise FileExistsError(f"{flag} {out} already exists; pass --overwrite to replace it or choose another {flag}")
    if out.is_dir() and directory and replaces and not written_by_moetailor(out):
        names = sorted(p.name for p in out.iterdir())
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise ValueError(f"{flag} {out} is a folder moetailor did not write (it holds {shown}); --overwrite replaces "
                         f"only moetailor's own outputs: choose another {flag}, or empty or remove it yourself")
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
        tmp.unlink(missing_ok=True)


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
