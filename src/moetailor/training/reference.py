"""Reproduce the bundled reference model end to end: corpus -> tokenizer -> training -> export.

    python -m moetailor.training.reference --out build/reference-run
    python -m moetailor.training.reference --family qwen3_moe --out build/reference-qwen3-run

The bundled ``reference`` is a stock ``Qwen2MoeForCausalLM`` shaped like the fine-grained MoEs the
papers study (64 routed experts, top-8, a sigmoid-gated shared expert, ``norm_topk_prob=True``);
``reference-qwen3`` is a ``Qwen3MoeForCausalLM`` of 64 experts, top-8 and no shared expert
(``training/config.py``). Both are trained with the same recipe on a mixture of real text domains
and the task suite's training stream. Everything is seeded.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .. import kernels
from ..data.corpus import DOMAIN_NAMES, build_corpus
from ..data.tasks import TASKS, training_rng
from ..models.paths import REFERENCE_DIR
from .config import FAMILIES, model_class, model_config
from .diagnostics import drill_row, symbol_tokens

EOS = "<|endoftext|>"
PAD = "<|pad|>"


# The model is trained on bare task prompts, so its chat format is the turns' text as written.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


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
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


class Mixture:
    """Packs training sequences: a share of task examples, the rest text windows by domain weight.
    Domains are sampled uniformly (not by size), so no single source dominates."""

    def __init__(self, tokenizer, corpus_dir: Path, seq_len: int, task_share: float, seed: int,
                 mask_prompts: bool = False, task_weights: dict[str, float] | None = None, drill_share: float = 0.0):
        self.tok, self.seq_len, self.task_share, self.mask_prompts = tokenizer, seq_len, task_share, mask_prompts
        self.task_weights, self.drill_share = task_weights, drill_share
        self.symbols = symbol_tokens(tokenizer)
        self.rng = random.Random(seed)
        self.task_rng = training_rng(seed)
        self.eos = tokenizer.eos_token_id
        self.streams = {}
        for name in DOMAIN_NAMES:
            docs = [json.loads(l)["text"] for l in (corpus_dir / "train" / f"{name}.jsonl").read_text().splitlines()]
            ids = tokenizer(docs, add_special_tokens=False)["input_ids"]
            self.streams[name] = np.fromiter((t for d in ids for t in (*d, self.eos)), dtype=np.int32)

    def _task_sequence(self) -> tuple[list[int], list[int]]:
        """Packed task examples; with ``mask_prompts`` only completions (+ EOS) carry loss, since
        prompts are random draws the model cannot predict."""
        ids: list[int] = []
        labels: list[int] = []
        tasks = list(TASKS.values())
        weights = [self.task_weights.get(t.name, 1.0) for t in tasks] if self.task_weights else None
        while len(ids) < self.seq_len:
            task = self.rng.choices(tasks, weights)[0] if weights else self.rng.choice(tasks)
            ex = task.generate(self.task_rng, self.rng.choice(task.difficulties))
            prompt = self.tok(ex.prompt, add_special_tokens=False)["input_ids"]
            completion = self.tok(ex.completion, add_special_tokens=False)["input_ids"] + [self.eos]
            ids += prompt + completion
            labels += ([-100] * len(prompt) if self.mask_prompts else prompt) + completion
        return ids[: self.seq_len], labels[: self.seq_len]

    def _text_sequence(self) -> tuple[list[int], list[int]]:
        stream = self.streams[self.rng.choice(DOMAIN_NAMES)]
        start = self.rng.randrange(0, len(stream) - self.seq_len - 1)
        ids = stream[start:start + self.seq_len].tolist()
        return ids, ids

    def _drill_sequence(self, lengths: tuple[int, int] = (4, 24)) -> tuple[list[int], list[int]]:
        """A random letter/digit string repeated to fill the row, loss on every token: the cheapest
        data that rewards an induction head, which lookup needs (``training/diagnostics.py``)."""
        ids = drill_row(self.rng, self.symbols, lengths, self.seq_len)
        return ids, ids

    def _row(self) -> tuple[list[int], list[int]]:
        draw = self.rng.random()
        if draw < self.drill_share:
            return self._drill_sequence()
        if draw < self.drill_share + self.task_share:
            return self._task_sequence()
        return self._text_sequence()

    def batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self._row() for _ in range(batch_size)]
        ids = torch.tensor([r[0] for r in rows], dtype=torch.long)     # [B, T]
        labels = torch.tensor([r[1] for r in rows], dtype=torch.long)  # [B, T]; -100 = no loss
        return ids, labels


@dataclass(frozen=True)
class Stage:
    """One training stage: the recipe changes between stages, the model carries over."""

    steps: int
    lr: float
    warmup: int
    task_share: float
    mask_prompts: bool
    task_weights: tuple[tuple[str, float], ...] = ()     # relative draw weight per task (default 1)
    drill_share: float = 0.0                              # rows of repeated random strings; text gets the rest


# The recipe that produced the bundled weights (docs/reference-model.md measures each stage). Stage 1
# puts loss on every token (recipes that masked prompts from step 0 never learned to copy from them)
# and gives a third of its rows to the induction drill; stages 2-4 spend their tokens on task
# completions, prompts masked, with a little drill kept and the weak tasks drawn more often.
STAGES = (Stage(steps=650, lr=1.5e-3, warmup=50, task_share=0.45, mask_prompts=False, drill_share=0.35),
          Stage(steps=650, lr=1e-3, warmup=30, task_share=0.8, mask_prompts=True, drill_share=0.1),
          Stage(steps=300, lr=5e-4, warmup=20, task_share=0.85, mask_prompts=True, drill_share=0.05,
                task_weights=(("expressions", 3.0), ("lookup", 2.0), ("sorting", 2.0), ("brackets", 0.5),
                              ("reverse", 0.5))),
          Stage(steps=180, lr=5e-4, warmup=10, task_share=0.9, mask_prompts=True, drill_share=0.05,
                task_weights=(("expressions", 5.0), ("sorting", 1.5), ("brackets", 0.5), ("reverse", 0.5))))


def train(out: Path, stages: tuple[Stage, ...] = STAGES, batch_size: int = 24, seq_len: int = 256, seed: int = 0,
          threads: int = 2, start_stage: int = 1, family: str = "qwen2_moe", fresh: bool = False) -> Path:
    """Run ``stages`` from ``start_stage`` (1-based); a later start resumes from out/checkpoint,
    which every stage writes at its end. A run that was stopped resumes from out/resume.pt (written
    every ``RESUME_EVERY`` steps) on the same batches it would have drawn, unless ``fresh``."""
    from transformers import AutoTokenizer

    model_cls = model_class(family)
    torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    corpus_dir = out / "corpus"
    bundled_family = family == "qwen2_moe"   # the bundled model's run owns the shipped text and tokenizer
    if not (corpus_dir / "train").exists():
        summary = build_corpus(corpus_dir, seed, bundle=bundled_family)
        (out / "corpus_summary.json").write_text(json.dumps(summary, indent=1))
    tok_dir = out / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        if bundled_family:
            train_tokenizer(corpus_dir, tok_dir, seed=seed)
        else:  # the same tokenizer as the bundled model, so the two are evaluated on the same token ids
            AutoTokenizer.from_pretrained(REFERENCE_DIR).save_pretrained(tok_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(seed)
    run = RunIdentity(family, batch_size, seq_len, seed)
    resume = None if fresh or start_stage != 1 else load_resume(out, run)
    if resume is not None:
        model = model_cls(model_config(len(tokenizer), family))
        model.load_state_dict(resume["model"])
        log, evals, start_stage = resume["log"], resume["evals"], resume["stage"]
        print(f"resuming {out / RESUME_FILE}: stage {start_stage}, step {resume['step']} ({len(log)} steps done)")
    elif start_stage == 1:
        model = model_cls(model_config(len(tokenizer), family))
        log, evals = [], []
    else:
        model = model_cls.from_pretrained(out / "checkpoint", dtype=torch.float32)
        log = [r for r in json.loads((out / "train_log.json").read_text()) if r.get("stage", 1) < start_stage]
        evals = [r for r in json.loads((out / "stage_evals.json").read_text()) if r["stage"] < start_stage]
    model.train()
    print(f"parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M")
    for number, stage in enumerate(stages, start=1):
        if number < start_stage:
            continue
        torch.manual_seed(seed + number)
        mixture = Mixture(tokenizer, corpus_dir, seq_len, stage.task_share, seed + number - 1, stage.mask_prompts,
                          dict(stage.task_weights), stage.drill_share)
        within = resume if resume is not None and resume["stage"] == number and resume["step"] > 0 else None
        _run_stage(model, mixture, stage, number, batch_size, seq_len, log, out, evals, run, within)
        evals.append({"stage": number, "step": len(log), **progress_check(model, tokenizer, n_per_task=24)})
        (out / "stage_evals.json").write_text(json.dumps(evals, indent=1))
        save_resume(out, run, model, None, None, number + 1, 0, log, evals)
        print(f"after stage {number}: " + ", ".join(f"{k} {evals[-1][k]:.0%}" for k in (*TASKS, "mean")) + "; probes: "
              + ", ".join(f"{k} {v:.2f}" for k, v in evals[-1].items() if k.endswith("_nats")))
    export_dir = out / "model"
    model.config.dtype = "bfloat16"
    model.to(torch.bfloat16).save_pretrained(export_dir)
    tokenizer.save_pretrained(export_dir)
    plot_loss(log, out / "loss.png")
    (out / RESUME_FILE).unlink(missing_ok=True)   # the run is complete; a new one starts fresh
    minutes = sum(r["step_s"] for r in log) / 60
    print(f"trained {len(log)} steps, {sum(r['batch_tokens'] for r in log):,} tokens in {minutes:.1f} min -> {export_dir}")
    return export_dir


RESUME_FILE = "resume.pt"
RESUME_EVERY = 100   # steps between resume points


@dataclass(frozen=True)
class RunIdentity:
    """What a resume point must agree on with the run that continues it."""

    family: str
    batch_size: int
    seq_len: int
    seed: int


def save_resume(out: Path, run: RunIdentity, model, opt, mixture: "Mixture | None", stage: int, step: int,
                log: list, evals: list) -> None:
    """One file, replaced atomically: the weights, the optimizer and every random state, so the run
    continues on the batches it would have drawn (a training run can outlast a 3-hour job limit)."""
    state = {"run": run, "stage": stage, "step": step, "model": model.state_dict(), "log": log, "evals": evals,
             "optimizer": None if opt is None else opt.state_dict(), "torch_rng": torch.get_rng_state(),
             "rng": None if mixture is None else (mixture.rng.getstate(), mixture.task_rng.getstate())}
    partial = out / (RESUME_FILE + ".partial")
    torch.save(state, partial)
    partial.replace(out / RESUME_FILE)


def load_resume(out: Path, run: RunIdentity) -> dict | None:
    path = out / RESUME_FILE
    if not path.exists():
        return None
    state = torch.load(path, weights_only=False)
    if state["run"] != run:
        raise SystemExit(f"{path} belongs to another run ({state['run']}), not {run}: pass the same --family, "
                         f"--batch-size, --seq-len and --seed to continue it, or --fresh to start over")
    return state


def _run_stage(model, mixture: Mixture, stage: Stage, number: int, batch_size: int, seq_len: int, log: list,
               out: Path, evals: list, run: RunIdentity, resume: dict | None = None, eval_every: int = 500) -> None:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=stage.lr, betas=(0.9, 0.95))
    first = 0
    if resume is not None:
        opt.load_state_dict(resume["optimizer"])
        mixture.rng.setstate(resume["rng"][0])
        mixture.task_rng.setstate(resume["rng"][1])
        torch.set_rng_state(resume["torch_rng"])
        first = resume["step"]
    bar = tqdm(range(first, stage.steps), desc=f"training stage {number}", mininterval=10, initial=first,
               total=stage.steps)
    for step in bar:
        t0 = time.time()
        scale = min(1.0, (step + 1) / stage.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / stage.steps)))
        for group in opt.param_groups:
            group["lr"] = stage.lr * scale
        ids, labels = mixture.batch(batch_size)                              # [B, T] each
        lm_loss, aux_loss = causal_lm_loss(model, ids, labels)
        opt.zero_grad(set_to_none=True)
        (lm_loss + model.config.router_aux_loss_coef * aux_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        aux, lm_loss = float(aux_loss.detach()), float(lm_loss.detach())
        log.append({"stage": number, "step": len(log), "loss": lm_loss, "aux": aux, "lr": stage.lr * scale,
                    "step_s": time.time() - t0, "batch_tokens": batch_size * seq_len})
        bar.set_postfix(loss=f"{lm_loss:.3f}", tok_s=f"{batch_size * seq_len / log[-1]['step_s']:.0f}", refresh=False)
        if (step + 1) % eval_every == 0 and step + 1 < stage.steps:   # progress check, not timed as training
            evals.append({"stage": number, "step": len(log), **progress_check(model, mixture.tok, n_per_task=8)})
            (out / "stage_evals.json").write_text(json.dumps(evals, indent=1))
        if (step + 1) % 200 == 0 or step + 1 == stage.steps:
            (out / "train_log.json").write_text(json.dumps(log))
            model.save_pretrained(out / "checkpoint")
        if (step + 1) % RESUME_EVERY == 0 and step + 1 < stage.steps:
            save_resume(out, run, model, opt, mixture, number, step + 1, log, evals)


def bf16_matmuls_are_fast() -> bool:
    """Autocast to bf16 only where the processor multiplies bf16 in hardware (AVX512-BF16 or AMX):
    elsewhere torch's bf16 GEMM is slower than fp32 (``kernels.cpu_has_bf16_matmul``)."""
    return kernels.cpu_has_bf16_matmul()


def causal_lm_loss(model, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token loss and the router's load-balancing loss, projecting onto the vocabulary only
    the positions whose next token carries a label (with prompts masked, most carry none)."""
    import torch.nn.functional as F

    targets = labels[:, 1:]                                                    # [B, T-1]; position t predicts t+1
    keep = torch.zeros_like(labels, dtype=torch.bool)                          # [B, T]
    keep[:, :-1] = targets != -100
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_matmuls_are_fast()):
        result = model(input_ids=ids, output_router_logits=True, logits_to_keep=keep)  # logits [N, V]
    loss = F.cross_entropy(result.logits.float(), targets[keep[:, :-1]])
    return loss, result.aux_loss


def progress_check(model, tokenizer, n_per_task: int) -> dict[str, float]:
    """Task accuracy and the copy probes (``training/diagnostics.py``): a recipe that will never
    learn lookup shows it here, as no look-back on repeated text, long before accuracy says so."""
    from .diagnostics import diagnose

    result = {**stage_accuracy(model, tokenizer, n_per_task), **diagnose(model, tokenizer)}
    model.train()
    return result


def stage_accuracy(model, tokenizer, n_per_task: int = 12, seed: int = 7) -> dict[str, float]:
    """Greedy held-out accuracy per task (and the mean) on an fp32 copy through the engine: a
    progress check between stages, on a seed the model card's evaluation does not use."""
    import copy

    from ..data.tasks import eval_examples, score
    from ..eval.runner import task_budget
    from ..serving.llm import LLM
    from ..serving.sampling import SamplingParams

    engine = LLM(copy.deepcopy(model).float().eval(), tokenizer=tokenizer)
    accuracy = {}
    with torch.no_grad():
        for task in TASKS.values():
            examples = eval_examples(task, n_per_task, seed=seed)
            outputs = engine.generate([ex.prompt for ex in examples],
                                      SamplingParams(max_tokens=task_budget(task, tokenizer), temperature=0.0))
            accuracy[task.name] = sum(score(ex, out.text) for ex, out in zip(examples, outputs)) / len(examples)
    accuracy["mean"] = sum(accuracy.values()) / len(TASKS)
    model.train()
    return accuracy


def plot_loss(log: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(len(log)))
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
    parser.add_argument("--batch-size", type=int, default=24)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-stage", type=int, default=1, help="resume at this stage from out/checkpoint")
    parser.add_argument("--fresh", action="store_true", help=f"ignore out/{RESUME_FILE} and start over")
    parser.add_argument("--family", choices=FAMILIES, default="qwen2_moe",
                        help="qwen2_moe: the bundled `reference`; qwen3_moe: `reference-qwen3` (no shared expert)")
    args = parser.parse_args()
    train(args.out, STAGES, args.batch_size, args.seq_len, args.seed, start_stage=args.start_stage,
          family=args.family, fresh=args.fresh)


if __name__ == "__main__":
    main()
