"""Reproduce the bundled reference model end to end: corpus -> tokenizer -> training -> export.

    python -m moetailor.training.reference --out build/reference-run

The model is a stock ``Qwen2MoeForCausalLM`` shaped like the fine-grained MoEs the papers study
(64 routed experts, top-8, a sigmoid-gated shared expert, ``norm_topk_prob=True``), trained on a
mixture of real text domains and the task suite's training stream. Everything is seeded.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..data.corpus import DOMAIN_NAMES, build_corpus
from ..eval.tasks import TASKS, training_rng

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def train_tokenizer(corpus_dir: Path, out_dir: Path, vocab_size: int = 8192, seed: int = 0) -> None:
    """Byte-level BPE with digits split one per token (arithmetic stays learnable)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    samples: list[str] = []
    for name in DOMAIN_NAMES:
        lines = (corpus_dir / "train" / f"{name}.jsonl").read_text().splitlines()
        rng.shuffle(lines)
        samples += [json.loads(l)["text"] for l in lines[:500]]  # ~1.5 MB per domain
    task_rng = training_rng(10**6)
    for task in TASKS.values():
        for i in range(3000):
            ex = task.generate(task_rng, task.difficulties[i % len(task.difficulties)])
            samples.append(ex.prompt + ex.completion)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(samples, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, bos_token=None)
    fast.model_max_length = 1024
    fast.save_pretrained(out_dir)


def model_config(vocab_size: int):
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        vocab_size=vocab_size, hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=1024, moe_intermediate_size=48, shared_expert_intermediate_size=256,
        num_experts=64, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=1024, rope_theta=10000.0, tie_word_embeddings=True, output_router_logits=False,
        router_aux_loss_coef=0.01, bos_token_id=None, eos_token_id=0, pad_token_id=1,
    )


class Mixture:
    """Packs training sequences: a share of task examples, the rest text windows by domain weight.

    Domains are sampled uniformly (not by size), so no single source dominates.
    """

    def __init__(self, tokenizer, corpus_dir: Path, seq_len: int, task_share: float, seed: int):
        self.tok, self.seq_len, self.task_share = tokenizer, seq_len, task_share
        self.rng = random.Random(seed)
        self.task_rng = training_rng(seed)
        self.eos = tokenizer.eos_token_id
        self.streams = {}
        for name in DOMAIN_NAMES:
            docs = [json.loads(l)["text"] for l in (corpus_dir / "train" / f"{name}.jsonl").read_text().splitlines()]
            ids = tokenizer(docs, add_special_tokens=False)["input_ids"]
            self.streams[name] = np.fromiter((t for d in ids for t in (*d, self.eos)), dtype=np.int32)

    def _task_sequence(self) -> list[int]:
        out: list[int] = []
        tasks = list(TASKS.values())
        while len(out) < self.seq_len + 1:
            task = self.rng.choice(tasks)
            ex = task.generate(self.task_rng, self.rng.choice(task.difficulties))
            out += self.tok(ex.prompt + ex.completion, add_special_tokens=False)["input_ids"] + [self.eos]
        return out[: self.seq_len + 1]

    def _text_sequence(self) -> list[int]:
        stream = self.streams[self.rng.choice(DOMAIN_NAMES)]
        start = self.rng.randrange(0, len(stream) - self.seq_len - 1)
        return stream[start:start + self.seq_len + 1].tolist()

    def batch(self, batch_size: int) -> torch.Tensor:
        rows = [self._task_sequence() if self.rng.random() < self.task_share else self._text_sequence()
                for _ in range(batch_size)]
        return torch.tensor(rows, dtype=torch.long)  # [B, T+1]


def train(out: Path, steps: int, batch_size: int = 12, seq_len: int = 512, lr: float = 1e-3, warmup: int = 100,
          task_share: float = 0.7, seed: int = 0, threads: int = 2) -> Path:
    from transformers import AutoTokenizer, Qwen2MoeForCausalLM

    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    corpus_dir = out / "corpus"
    if not (corpus_dir / "train").exists():
        (out / "corpus_summary.json").write_text(json.dumps(build_corpus(corpus_dir, seed), indent=1))
    tok_dir = out / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        train_tokenizer(corpus_dir, tok_dir, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    mixture = Mixture(tokenizer, corpus_dir, seq_len, task_share, seed)
    model = Qwen2MoeForCausalLM(model_config(len(tokenizer)))
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params / 1e6:.1f}M")
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    log = []
    t0 = time.time()
    bar = tqdm(range(steps), desc="training", mininterval=10)
    for step in bar:
        scale = min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        batch = mixture.batch(batch_size)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            result = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone(), output_router_logits=True)
        # transformers shifts labels internally; labels = inputs is the causal LM convention.
        loss = result.loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lm_loss = float(loss) - float(result.aux_loss or 0) * model.config.router_aux_loss_coef
        log.append({"step": step, "loss": lm_loss, "aux": float(result.aux_loss or 0), "lr": lr * scale,
                    "elapsed_s": time.time() - t0, "tokens": (step + 1) * batch_size * seq_len})
        bar.set_postfix(loss=f"{lm_loss:.3f}", tok_s=f"{log[-1]['tokens'] / log[-1]['elapsed_s']:.0f}")
        if (step + 1) % 200 == 0 or step + 1 == steps:
            (out / "train_log.json").write_text(json.dumps(log))
            model.save_pretrained(out / "checkpoint")
    export_dir = out / "model"
    model.config.dtype = "bfloat16"
    model.to(torch.bfloat16).save_pretrained(export_dir)
    tokenizer.save_pretrained(export_dir)
    (out / "train_log.json").write_text(json.dumps(log))
    plot_loss(log, out / "loss.png")
    print(f"trained {steps} steps, {log[-1]['tokens']:,} tokens in {log[-1]['elapsed_s'] / 60:.1f} min -> {export_dir}")
    return export_dir


def plot_loss(log: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in log]
    loss = np.array([r["loss"] for r in log])
    smooth = np.convolve(loss, np.ones(20) / 20, mode="valid") if len(loss) > 20 else loss
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, loss, alpha=0.3, label="loss")
    ax.plot(steps[len(steps) - len(smooth):], smooth, label="20-step mean")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token cross-entropy")
    ax.set_title("reference model training")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("build/reference-run"))
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    train(args.out, args.steps, args.batch_size, args.seq_len, args.lr, seed=args.seed)


if __name__ == "__main__":
    main()
