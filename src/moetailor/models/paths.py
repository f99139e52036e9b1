"""Where a model name points: the bundled reference model or a local checkpoint directory."""
from __future__ import annotations

from pathlib import Path

REFERENCE_DIR = Path(__file__).resolve().parent.parent / "assets" / "reference"


def resolve_model_path(name: str | Path) -> Path:
    """'reference' -> the bundled model; otherwise a local checkpoint directory."""
    if str(name) == "reference":
        if not (REFERENCE_DIR / "config.json").exists():
            raise FileNotFoundError(f"the bundled reference model is missing from {REFERENCE_DIR}; "
                                    "reinstall moetailor or run `make train-reference`")
        return REFERENCE_DIR
    path = Path(name)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{name!r} is neither 'reference' nor a local checkpoint directory with a config.json "
                                "(moetailor never downloads from a hub: pass a local path)")
    return path
