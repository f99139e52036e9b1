"""Measure the reference model for its card: expert usage per domain against the same-domain noise floor.

    python -m moetailor.training.model_card --model reference
    python -m moetailor.training.model_card --model reference-qwen3

Writes docs/img/expert-usage.png (expert-usage-<model>.png for another model) and prints the
numbers (as JSON) that docs/reference-model.md reports. Accuracy and the pruning drop come from `moetailor eval` (commands in the card).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from ..data.corpus import DOMAIN_NAMES


def expert_usage(model, tokenizer, tokens: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Per data domain (text domains + the task suite): share of routes per layer and expert [L, E]."""
    from ..calibration import calibrate

    usage = {}
    for domain in [*DOMAIN_NAMES, "tasks"]:
        spec = "tasks" if domain == "tasks" else f"text:{domain}"
        stats = calibrate(model, tokenizer, spec, tokens, seed=seed, progress=False)
        freq = np.stack([stats.layers[i].frequency.numpy() for i in sorted(stats.layers)])  # [L, E]
        usage[domain] = freq / freq.sum(axis=1, keepdims=True)
    return usage


def js_divergence(p: np.ndarray, q: np.ndarray) -> float:
    """Jensen-Shannon divergence (bits) between two distributions over experts, mean over layers."""
    m = (p + q) / 2
    def kl(a, b):
        return np.where(a > 0, a * np.log2(np.where(a > 0, a, 1) / np.where(b > 0, b, 1)), 0).sum(axis=-1)
    return float(((kl(p, m) + kl(q, m)) / 2).mean())


def usage_contrast(model, tokenizer, tokens: int) -> dict:
    """Between-domain divergence against the same-domain noise floor (two disjoint samples)."""
    a = expert_usage(model, tokenizer, tokens, seed=0)
    b = expert_usage(model, tokenizer, tokens, seed=1)
    names = list(a)
    between = [js_divergence(a[x], a[y]) for i, x in enumerate(names) for y in names[i + 1:]]
    within = [js_divergence(a[x], b[x]) for x in names]
    return {"usage": a, "between_domains_js": float(np.mean(between)), "within_domain_js": float(np.mean(within))}


def plot_usage(usage: dict[str, np.ndarray], path: Path, label: str = "reference model") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(usage)
    layers = next(iter(usage.values())).shape[0]
    fig, axes = plt.subplots(layers, 1, figsize=(12, 2.0 * layers), sharex=True)
    for layer, ax in enumerate(np.atleast_1d(axes)):
        grid = np.stack([usage[n][layer] for n in names])  # [domains, E]
        im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.set_ylabel(f"layer {layer}", fontsize=8)
        fig.colorbar(im, ax=ax, fraction=0.015, pad=0.01)
    np.atleast_1d(axes)[-1].set_xlabel("routed expert")
    fig.suptitle(f"Share of routes per expert, per data domain ({label})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    from ..models import load_model, load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="reference")
    parser.add_argument("--usage-tokens", type=int, default=12000)
    parser.add_argument("--out", type=Path, default=Path("docs"))
    args = parser.parse_args()
    model, tokenizer = load_model(args.model), load_tokenizer(args.model)
    t0 = time.time()
    contrast = usage_contrast(model, tokenizer, args.usage_tokens)
    (args.out / "img").mkdir(parents=True, exist_ok=True)
    name = "expert-usage.png" if args.model == "reference" else f"expert-usage-{Path(args.model).name}.png"
    plot_usage(contrast.pop("usage"), args.out / "img" / name, label=f"{Path(args.model).name}")
    contrast["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(contrast, indent=1))


if __name__ == "__main__":
    main()
