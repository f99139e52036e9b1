"""Where a model name points: a bundled reference model or a local checkpoint directory."""
from __future__ import annotations

from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
REFERENCE_DIR = ASSETS / "reference"
# The bundled models, by name: two families trained here on the same corpus and tasks
# (training/config.py), so a conclusion drawn on one can be checked on the other.
BUNDLED = {"reference": (REFERENCE_DIR, "make train-reference"),
           "reference-qwen3": (ASSETS / "reference-qwen3", "make train-reference-qwen3")}


def is_bundled(name: str | Path) -> bool:
    """Whether ``name`` is a bundled model's name (whose traffic is its own task suite)."""
    return str(name) in BUNDLED


def resolve_model_path(name: str | Path) -> Path:
    """'reference' / 'reference-qwen3' -> the bundled model; otherwise a local checkpoint directory."""
    if is_bundled(name):
        path, recipe = BUNDLED[str(name)]
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"the bundled model {name!r} is missing from {path}; reinstall moetailor or "
                                    f"run `{recipe}`")
        return path
    path = Path(name)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{name!r} is neither a bundled model ({', '.join(BUNDLED)}) nor a local checkpoint "
                                "directory with a config.json (moetailor never downloads from a hub: pass a local path)")
    return path


def bundled_name(path: str | Path) -> str | None:
    """The bundled model's name if ``path`` is its directory, else None."""
    try:
        resolved = Path(path).resolve()
    except OSError:
        return None
    return next((name for name, (where, _) in BUNDLED.items() if resolved == where), None)
