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

``induction_drill`` trains a fresh model on nothing but repeated random symbol strings, to learn
how many steps induction heads take to form here before a whole recipe depends on them:

    python -m moetailor.training.diagnostics --drill dense --steps 2000
    python -m moetailor.training.diagnostics --drill reference --steps 400 --batch 8 --seq 256
"""
from __future__ import annotations

import argparse
import json
import random
import string
from typing import Callable

import torch

from ..data.corpus import BUNDLED_DIR, DOMAIN_NAMES
from ..tables import unknown_choice


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


def symbol_tokens(tokenizer) -> list[int]:
    """Ids of the single-letter and single-digit tokens, with or without a leading space."""
    symbols = set(string.ascii_lowercase + string.digits)
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return [i for i, piece in enumerate(pieces) if piece.removeprefix("Ġ") in symbols]


def drill_row(rng: random.Random, symbols: list[int], lengths: tuple[int, int], seq: int) -> list[int]:
    """One drill row: a random string of ``symbols`` (length drawn from [lo, hi)) repeated to fill
    ``seq`` tokens; every copy after the first is predictable only by looking back."""
    pattern = [rng.choice(symbols) for _ in range(rng.randrange(*lengths))]
    return (pattern * (seq // len(pattern) + 1))[:seq]


def drill_model(kind: str, vocab_size: int, layers: int = 2):
    """A fresh model for the drill: the reference shape, or a cheap dense Qwen2 of the same width."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2MoeForCausalLM

    from .config import model_config

    if kind == "reference":
        return Qwen2MoeForCausalLM(model_config(vocab_size))
    if kind == "dense":
        return Qwen2ForCausalLM(Qwen2Config(
            vocab_size=vocab_size, hidden_size=256, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=512, max_position_embeddings=1024, tie_word_embeddings=True,
            bos_token_id=None, eos_token_id=0, pad_token_id=1))
    raise ValueError(unknown_choice("drill model", kind, ("reference", "dense")))


def induction_drill(model, tokenizer, steps: int, batch: int = 8, seq: int = 256, lengths: tuple[int, int] = (16, 64),
                    lr: float = 1e-3, bf16: bool = True, log_every: int = 50, seed: int = 0,
                    report: Callable[[dict], None] | None = None) -> list[dict]:
    """Train ``model`` on rows of a random symbol string repeated to fill ``seq`` tokens.
    Loss starts at ln(#symbols); guessing among the symbols
    already in the row gives ~ln(string length); induction gives ~ln(#symbols) x length / seq.
    Returns the mean training loss per ``log_every`` steps, each also handed to ``report`` as it
    is measured (a drill runs for minutes)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    symbols = symbol_tokens(tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    moe = hasattr(model.config, "num_experts")
    curve, window = [], []
    model.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 50)
        ids = torch.tensor([drill_row(rng, symbols, lengths, seq) for _ in range(batch)])   # [B, seq]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids, **({"output_router_logits": True} if moe else {})).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        window.append(float(loss.detach()))
        if (step + 1) % log_every == 0 or step + 1 == steps:
            curve.append({"step": step + 1, "loss": sum(window) / len(window)})
            window = []
            if report:
                report(curve[-1])
    return curve


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
    parser.add_argument("--drill", choices=("dense", "reference"), default=None,
                        help="instead: train a fresh model of this kind on the induction drill")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--lengths", default="16,64", help="string lengths drawn from [lo, hi)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--layers", type=int, default=2, help="layers of the dense drill model")
    parser.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    args = parser.parse_args()
    torch.set_num_threads(2)
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    if args.drill:
        lo, hi = (int(v) for v in args.lengths.split(","))
        model = drill_model(args.drill, len(tokenizer), args.layers)
        induction_drill(model, tokenizer, args.steps, args.batch, args.seq, (lo, hi), args.lr, bf16=not args.fp32,
                        report=lambda point: print(json.dumps(point), flush=True))
        return
    print(json.dumps(diagnose(load_model(args.model), tokenizer), indent=1))


if __name__ == "__main__":
    main()
