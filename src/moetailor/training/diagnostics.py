"""Can a model copy? Two teacher-forced probes that explain a stuck lookup task.

    python -m moetailor.training.diagnostics --model reference
    python -m moetailor.training.diagnostics --model build/reference-run/model

Lookup (content-addressed retrieval) needs induction heads: "find the earlier copy of this token,
read what followed it". ``repeat_gap`` measures them directly: a held-out text window written
twice, mean next-token loss on the second copy against the first (induction heads make the second
copy nearly free). ``copy_loss`` measures copying from a prompt in the task suite's ``copy``
format, for letters (the format trained) and digits (untrained): a model with a general copy
mechanism copies both, a task-specific circuit only the first. Uniform guessing costs ln 26 = 3.26
nats per letter and ln 10 = 2.30 per digit.
"""
from __future__ import annotations

import argparse
import json
import random
import string

import torch

from ..data.corpus import BUNDLED_DIR, DOMAIN_NAMES


@torch.no_grad()
def _token_losses(model, ids: list[int]) -> torch.Tensor:
    """Next-token loss (nats) at every position but the last: [T-1]."""
    x = torch.tensor([ids])                                                   # [1, T]
    logprobs = model(input_ids=x).logits[0, :-1].float().log_softmax(-1)      # [T-1, V]
    return -logprobs.gather(1, x[0, 1:, None])[:, 0]                          # [T-1]


def repeat_gap(model, tokenizer, window: int = 128, docs_per_domain: int = 1) -> dict[str, float]:
    """Mean loss on the first and the second copy of held-out windows written twice."""
    first, second = [], []
    for name in DOMAIN_NAMES:
        lines = (BUNDLED_DIR / "heldout" / f"{name}.jsonl").read_text().splitlines()[:docs_per_domain]
        for line in lines:
            ids = tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"][:window]
            losses = _token_losses(model, ids + ids)                         # [2W-1]
            first.append(losses[: len(ids) - 1].mean())                       # predicts tokens 1..W-1
            second.append(losses[len(ids):].mean())                           # predicts copy tokens 1..W-1
    return {"first_copy_nats": float(torch.stack(first).mean()), "second_copy_nats": float(torch.stack(second).mean())}


def copy_loss(model, tokenizer, alphabet: str, n: int = 20, length: int = 8, seed: int = 0) -> float:
    """Mean loss per copied symbol for ``copy a b c ...`` prompts over ``alphabet``."""
    rng = random.Random(seed)
    losses = []
    for _ in range(n):
        symbols = " ".join(rng.choice(alphabet) for _ in range(length))
        prompt = tokenizer(f"copy {symbols}\n", add_special_tokens=False)["input_ids"]
        completion = tokenizer(f"#### {symbols}", add_special_tokens=False)["input_ids"]
        per_token = _token_losses(model, prompt + completion)[len(prompt):]   # the symbols after "####"
        losses.append(per_token.mean())
    return float(torch.stack(losses).mean())


def diagnose(model, tokenizer) -> dict[str, float]:
    model.eval()
    return {**repeat_gap(model, tokenizer),
            "copy_letters_nats": copy_loss(model, tokenizer, string.ascii_lowercase),
            "copy_digits_nats": copy_loss(model, tokenizer, string.digits)}


def main() -> None:
    from ..models import load_model, load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="reference", help="checkpoint directory or 'reference'")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    args = parser.parse_args()
    model = load_model(args.model)
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    print(json.dumps(diagnose(model, tokenizer), indent=1))


if __name__ == "__main__":
    main()
