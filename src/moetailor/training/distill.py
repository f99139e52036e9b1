"""Repair the pruned decoder by distillation from the full model's KV cache (SlimWise §1).

Per sequence of length L a split point s ~ U[0, L) is drawn (s = 0 is ordinary distillation). The
frozen teacher (the full model) runs the whole sequence once: its KV cache over [0, s) is the prefill
the deployed decoder receives, its next-token distributions over [s, L) the targets. The student (the
plan's decode policy plus the trainables below) continues over [s, L) from that cache:

    loss = alpha * CE(next token) + (1 - alpha) * KL(teacher || student)

over the teacher's top-64 tokens plus one bucket for the rest. Teacher and student are ONE model
(one copy of the experts): router weights and norms train as copies swapped in only for the student
pass (``torch.func.functional_call``); SE2, an MLP shaped like the shared expert SE1 (gate/up copied,
down zero), is added to SE1's output by a hook on only in the student pass (inside Qwen2-MoE's
sigmoid shared-expert gate; DeepSeek-V3's is ungated), so SE1 + SE2 merge exactly.
``experts=True`` (``--train-experts``) also trains copies of the kept experts: a model without a
shared expert has nothing else with capacity to absorb what the dropped experts did.

Export merges SE1 and SE2 into one shared expert of twice the width: a stock checkpoint of the same
architecture, meant as the DECODE model (prefill stays on the original: router and norms were trained
for decode only).
"""
from __future__ import annotations

import copy
import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..models.adapters import moe_layers
from ..models.architectures import arch_spec
from ..models.loading import model_fingerprint
from ..models.sidecars import DISTILL_PLAN_FILE, DISTILL_SIDECAR
from ..outputs import atomic_path, save_figure
from ..plans.plan import Plan
from ..routing.controller import RoutingController
from ..routing.policy import PhasePolicy
from ..transforms.artifacts import checkpoint_directory, copy_tokenizer, model_from_state, refuse_existing

STATE_FILE = "state.pt"


@dataclass
class DistillConfig:
    steps: int
    alpha: float = 0.1               # weight of CE; KD gets 1 - alpha
    lr: float = 1e-4
    router_lr_scale: float = 0.1     # router learning rate = lr * this
    batch_size: int = 8
    seq_len: int = 256               # tokens the model sees per sequence (targets are one further)
    split_point: str = "uniform"     # "uniform" (s ~ U[0, L)), "zero" (s = 0) or a fraction f in [0, 1)
    kd_top: int = 64                 # teacher tokens kept exactly in the KL; the rest is one bucket
    warmup: int = 10
    weight_decay: float = 0.01       # SE2 matrices only (router and norms: none)
    grad_clip: float = 1.0
    checkpoint_every: int = 50
    seed: int = 0
    se2: bool = True
    experts: bool = False            # train copies of the routed experts' weights as well
    expert_lr_scale: float = 0.1     # their learning rate = lr * this (pre-trained matrices)
    bf16: bool = False               # bf16 autocast for teacher and student matmuls (CPU: AMX)

    def validate(self) -> None:
        """ValueError naming the flag; every float must be finite (NaN passes every comparison, and
        ``--lr nan`` trained a checkpoint of NaN weights)."""
        for name, flag in (("alpha", "--alpha"), ("lr", "--lr"), ("router_lr_scale", "router_lr_scale"),
                           ("weight_decay", "weight_decay"), ("grad_clip", "grad_clip")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{flag} must be a finite number (got {value!r})")
        if not isinstance(self.steps, int):
            raise ValueError(f"--steps must be at least 1 (got {self.steps})")
        for flag, value, low in (("--steps", self.steps, 1), ("--warmup", self.warmup, 0),
                                 ("--batch-size", self.batch_size, 1), ("--seq-len", self.seq_len, 2),
                                 ("kd_top", self.kd_top, 1), ("--checkpoint-every", self.checkpoint_every, 1)):
            if value < low:
                raise ValueError(f"{flag} must be at least {low} (got {value})")
        if self.weight_decay < 0 or self.grad_clip <= 0:
            raise ValueError(f"weight_decay (got {self.weight_decay}) must be >= 0 and grad_clip (got "
                             f"{self.grad_clip}) positive")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"--alpha must be in [0, 1] (got {self.alpha}): it weights CE against KD")
        split_fraction(self.split_point)
        if self.lr <= 0 or self.router_lr_scale < 0:
            raise ValueError(f"--lr must be positive (got {self.lr}) and the router scale non-negative")


def split_fraction(split_point: str | float) -> float | None:
    """None for "uniform", 0.0 for "zero", else a fixed fraction in [0, 1) of the sequence (or an error)."""
    if split_point == "uniform":
        return None
    if split_point == "zero":
        return 0.0
    try:
        f = float(split_point)
    except (TypeError, ValueError):
        raise ValueError(f"--split-point {split_point!r} is not understood; use 'uniform' (s ~ U[0, L)), 'zero' "
                         "(ordinary distillation, the ablation) or a fraction in [0, 1)") from None
    if not 0.0 <= f < 1.0:
        raise ValueError(f"--split-point {f} is outside [0, 1); the split must leave at least one token to the "
                         "student (use 'uniform', 'zero' or a fraction such as 0.5)")
    return f


def draw_split(length: int, split_point: str, gen: torch.Generator) -> int:
    f = split_fraction(split_point)
    if f is None:
        return int(torch.randint(0, length, (1,), generator=gen))
    return int(f * length)


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower() and any(True for _ in module.parameters(recurse=False))


class Student:
    """The pruned decoder as a view of ``model``: the plan's decode policy, trainable copies of the
    router weights and norms, and an SE2 per MoE layer. ``teacher(...)`` runs the untouched full model.

    The model's own parameters are frozen (requires_grad False) and never written to."""

    def __init__(self, model: nn.Module, plan: Plan, se2: bool = True, experts: bool = False):
        plan.check_model(model)
        if plan.decode.is_identity:
            raise ValueError("the plan's decode phase runs the full router, so the student would equal the teacher; "
                             "distil a pruning plan (`moetailor plan ... --keep 0.5`)")
        self.model = model
        self.plan = plan
        self.spec = arch_spec(model.config)
        self.controller = RoutingController.of(model)
        self.layers = moe_layers(model)
        model.requires_grad_(False)

        self.names = names = {id(m): n for n, m in model.named_modules()}
        self.router_names = [f"{names[id(l.router)]}.weight" for l in self.layers]
        self.norm_names = [f"{n}.{pn}" for n, m in model.named_modules() if _is_norm(m)
                           for pn, _ in m.named_parameters(recurse=False)]
        self.expert_names = [f"{names[id(l.experts)]}.{pn}" for l in self.layers
                             for pn, _ in l.experts.named_parameters()] if experts else []
        own = dict(model.named_parameters())
        self.params: dict[str, nn.Parameter] = {
            n: nn.Parameter(own[n].detach().clone()) for n in self.router_names + self.norm_names + self.expert_names}

        self.se2 = nn.ModuleDict()
        self._se2_on = False
        self._hooks = []
        if se2:
            if self.spec.shared_expert is None:
                raise ValueError(
                    f"{self.spec.model_type} has no shared expert, so there is no SE1 to add an SE2 residual to, and a "
                    f"stock {self.spec.model_type} checkpoint cannot hold a new always-on MLP; pass --no-se2 to train "
                    "the router and norms only")
            for layer in self.layers:
                se1 = layer.shared_expert
                new = copy.deepcopy(se1)           # same class, shape, dtype and device as SE1
                new._forward_hooks.clear()         # not another student's SE2 hook
                new.requires_grad_(True)
                with torch.no_grad():
                    new.down_proj.weight.zero_()   # SE2 starts at zero: the student starts as the masked model
                self.se2[str(layer.index)] = new
                self._hooks.append(se1.register_forward_hook(self._se2_hook(layer.index)))

    def _se2_hook(self, index: int):
        def hook(module, args, output):
            if not self._se2_on:
                return output
            return output + self.se2[str(index)](args[0])  # inside Qwen2-MoE's shared-expert gate
        return hook

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [*self.params.items(), *((f"se2.{n}", p) for n, p in self.se2.named_parameters())]

    def counts(self) -> dict:
        """Parameter counts: trainable share of the student (model + SE2) and of the original model."""
        model_total = sum(p.numel() for p in self.model.parameters())
        se2 = sum(p.numel() for p in self.se2.parameters())
        router = sum(self.params[n].numel() for n in self.router_names)
        norms = sum(self.params[n].numel() for n in self.norm_names)
        experts = sum(self.params[n].numel() for n in self.expert_names)
        trainable = router + norms + se2 + experts
        return {"model": model_total, "se2": se2, "router": router, "norms": norms, "experts": experts,
                "trainable": trainable,
                "trainable_share": trainable / (model_total + se2)}

    def teacher(self, input_ids: torch.Tensor, **kwargs):
        """The full model exactly as loaded: full router, original router/norms, SE2 off."""
        with self.controller.policy(None):
            return self.model(input_ids=input_ids, **kwargs)

    def __call__(self, input_ids: torch.Tensor, policy: PhasePolicy | None | str = "decode", **kwargs):
        """The student: the plan's decode policy (``policy=None``: full router), trainable copies, SE2 on."""
        policy = self.plan.decode if policy == "decode" else policy
        self._se2_on = True
        try:
            with self.controller.policy(policy):
                return torch.func.functional_call(self.model, dict(self.params), args=(),
                                                  kwargs=dict(input_ids=input_ids, **kwargs))
        finally:
            self._se2_on = False

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def merged_model(self) -> nn.Module:
        """A stock model of the same architecture computing the student (without a routing policy):
        trained router/norms written in, SE1 and SE2 concatenated into one shared expert of twice the width."""
        config = type(self.model.config).from_dict(self.model.config.to_dict())
        state = {k: v.detach().clone() for k, v in {**self.model.state_dict(), **self.params}.items()}
        if len(self.se2):
            key = self.spec.shared_width_key
            setattr(config, key, 2 * int(getattr(config, key)))
            for layer in self.layers:
                prefix = self.names[id(layer.shared_expert)]
                se2 = self.se2[str(layer.index)]
                for proj in ("gate_proj", "up_proj"):      # weight [I, H]: stack rows
                    state[f"{prefix}.{proj}.weight"] = torch.cat(
                        [state[f"{prefix}.{proj}.weight"], getattr(se2, proj).weight.detach()], dim=0)
                state[f"{prefix}.down_proj.weight"] = torch.cat(  # [H, I]: stack columns
                    [state[f"{prefix}.down_proj.weight"], se2.down_proj.weight.detach()], dim=1)
        merged = model_from_state(config, state, next(self.model.parameters()).dtype, "merged (doubled experts)")
        merged.moetailor_source = getattr(self.model, "moetailor_source", None)
        return merged


def teacher_targets(logits: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher logits [..., V] -> (top ids [..., k], top log-probs [..., k], rest log-mass [...])."""
    logits = logits.float()
    lse = logits.logsumexp(-1, keepdim=True)                                 # [..., 1]
    top_logits, top_ids = logits.topk(min(top, logits.shape[-1]), dim=-1)    # [..., k]
    return top_ids, top_logits - lse, _rest_logmass(logits, top_ids, lse)


def _rest_logmass(logits: torch.Tensor, top_ids: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """log of the probability mass outside ``top_ids`` [..., k], computed stably from the logits."""
    rest = logits.scatter(-1, top_ids, float("-inf")).logsumexp(-1)         # [...]
    return rest - lse[..., 0]


def bucket_kl(student_logits: torch.Tensor, top_ids: torch.Tensor, t_top: torch.Tensor,
              t_rest: torch.Tensor) -> torch.Tensor:
    """Per-position KL(teacher || student) over the teacher's top-k tokens plus one rest bucket. [N]"""
    z = student_logits.float()                                               # [N, V]
    lse = z.logsumexp(-1, keepdim=True)
    s_top = z.gather(-1, top_ids) - lse                                      # [N, k]
    s_rest = _rest_logmass(z, top_ids, lse)                                  # [N]
    kl = (t_top.exp() * (t_top - s_top)).sum(-1)                             # [N]
    p_rest = t_rest.exp()
    # 0 * log 0 = 0 when the teacher's top-k holds all the mass (V <= k or saturated)
    kl_rest = torch.where(p_rest > 0, p_rest * (t_rest - s_rest), torch.zeros_like(p_rest))
    return kl + kl_rest


def row_cache(cache, row: int, length: int, config):
    """A DynamicCache with batch row ``row`` of ``cache`` cropped to its first ``length`` positions."""
    from transformers import DynamicCache

    data = [(l.keys[row:row + 1, :, :length].detach(), l.values[row:row + 1, :, :length].detach())
            for l in cache.layers]
    return DynamicCache(ddp_cache_data=data, config=config)


def distill_loss(student: Student, batch: torch.Tensor, splits: list[int], cfg: DistillConfig,
                 backward: bool = True) -> dict:
    """One batch [B, L+1]: teacher pass, then the student from each row's split point. With
    ``backward`` the gradients of the mean per-token loss are accumulated row by row (bounded memory)."""
    inputs, targets = batch[:, :-1], batch[:, 1:]                            # [B, L] each
    B, L = inputs.shape
    autocast = torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=cfg.bf16)
    with torch.no_grad(), autocast:
        out = student.teacher(inputs, use_cache=True)
        top_ids, t_top, t_rest = teacher_targets(out.logits, cfg.kd_top)     # [B, L, k], [B, L, k], [B, L]
        cache = out.cache
    n_total = sum(L - s for s in splits)
    ce_sum = kd_sum = 0.0
    for i, s in enumerate(splits):
        kwargs = {"use_cache": True, "cache": row_cache(cache, i, s, student.model.config)} if s > 0 else {"use_cache": False}
        with autocast:
            logits = student(inputs[i:i + 1, s:], **kwargs).logits[0]        # [L-s, V]
        ce = F.cross_entropy(logits.float(), targets[i, s:], reduction="sum")
        kd = bucket_kl(logits, top_ids[i, s:], t_top[i, s:], t_rest[i, s:]).sum()
        loss = (cfg.alpha * ce + (1 - cfg.alpha) * kd) / n_total
        if backward:
            loss.backward()
        ce_sum += float(ce.detach())
        kd_sum += float(kd.detach())
    ce, kd = ce_sum / n_total, kd_sum / n_total
    return {"loss": cfg.alpha * ce + (1 - cfg.alpha) * kd, "ce": ce, "kd": kd, "student_tokens": n_total,
            "tokens": B * L}


@dataclass
class DistillResult:
    student: Student
    log: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    resumed_from: int = 0


def make_optimizer(student: Student, cfg: DistillConfig) -> torch.optim.AdamW:
    router = [student.params[n] for n in student.router_names]
    norms = [student.params[n] for n in student.norm_names]
    groups = [{"params": router, "lr": cfg.lr * cfg.router_lr_scale, "weight_decay": 0.0, "name": "router"},
              {"params": norms, "lr": cfg.lr, "weight_decay": 0.0, "name": "norms"}]
    if len(student.se2):
        groups.append({"params": list(student.se2.parameters()), "lr": cfg.lr, "weight_decay": cfg.weight_decay,
                       "name": "se2"})
    if student.expert_names:   # no decay: the experts outside the pool get no gradient and must stay as they are
        groups.append({"params": [student.params[n] for n in student.expert_names],
                       "lr": cfg.lr * cfg.expert_lr_scale, "weight_decay": 0.0, "name": "experts"})
    for g in groups:
        g["base_lr"] = g["lr"]
    return torch.optim.AdamW(groups, betas=(0.9, 0.95))


def lr_scale(step: int, cfg: DistillConfig) -> float:
    """Linear warm-up, then cosine decay to 10%."""
    warm = min(1.0, (step + 1) / max(1, cfg.warmup))
    return warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / max(1, cfg.steps))))


def save_state(state_dir: Path, student: Student, opt, step: int, gen: torch.Generator, log: list[dict],
               cfg: DistillConfig) -> None:
    """Atomic: a crash while saving keeps the previous checkpoint."""
    state = {"step": step, "config": asdict(cfg), "params": {n: p.detach().clone() for n, p in student.params.items()},
             "se2": {k: v.clone() for k, v in student.se2.state_dict().items()}, "optimizer": opt.state_dict(),
             "split_rng": gen.get_state(), "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
             "log": log, "fingerprint": model_fingerprint(student.model)}
    with atomic_path(state_dir / STATE_FILE) as tmp:
        torch.save(state, tmp)


RESUME_KEYS = ("alpha", "lr", "router_lr_scale", "batch_size", "seq_len", "split_point", "kd_top", "seed", "se2",
               "experts", "expert_lr_scale")
STATE_KEYS = ("step", "config", "params", "se2", "optimizer", "split_rng", "torch_rng", "python_rng", "log",
              "fingerprint")


def read_state(path: Path) -> dict:
    """A resumable checkpoint, read with ``torch.load(weights_only=True)``: tensors and plain
    containers only, so a planted file cannot run code; anything else is a one-line error."""
    import pickle
    import re

    try:
        state = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        what = f"it refers to {found.group(1)}" if found else "it holds more than tensors and plain data"
        raise ValueError(f"--resume: {path} is not a readable distillation checkpoint ({what}; refused unread, since "
                         "loading it could run code): start over with --overwrite") from None
    except (RuntimeError, EOFError, OSError, ValueError, TypeError, AttributeError) as e:
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()
        first = text.splitlines()[0].split(". ")[0] if text else type(e).__name__
        raise ValueError(f"--resume: {path} is not a readable distillation checkpoint ({first[:120]}); it may be "
                         "truncated or not written by `moetailor distill`: start over with --overwrite") from None
    missing = [k for k in STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(f"--resume: {path} lacks {missing}; it was not written by this `moetailor distill`: start "
                         "over with --overwrite")
    return state


def load_state(state_dir: Path, student: Student, opt, gen: torch.Generator, cfg: DistillConfig) -> tuple[int, list]:
    path = state_dir / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"--resume: no checkpoint at {path}; start without --resume")
    state = read_state(path)
    if state["fingerprint"].get("router_hash") != model_fingerprint(student.model)["router_hash"]:
        raise ValueError(f"--resume: the checkpoint in {state_dir} was made for another model; start over with "
                         "--overwrite or pick the model it was made for")
    saved = {**asdict(DistillConfig(steps=0)), **state["config"]}     # a key added since the run: its default
    changed = {k: (saved[k], getattr(cfg, k)) for k in RESUME_KEYS if saved[k] != getattr(cfg, k)}
    if changed:
        raise ValueError(f"--resume: settings differ from the interrupted run ({changed}, as checkpoint -> now); "
                         "rerun with the original settings or start over with --overwrite")
    with torch.no_grad():
        for n, p in student.params.items():
            p.copy_(state["params"][n])
    student.se2.load_state_dict(state["se2"])
    opt.load_state_dict(state["optimizer"])
    gen.set_state(state["split_rng"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    return int(state["step"]), list(state["log"])


def train(student: Student, batches: Callable[[int], Iterator[torch.Tensor]], cfg: DistillConfig,
          state_dir: str | Path | None = None, resume: bool = False, progress: bool = True,
          callback: Callable[[int, dict], None] | None = None) -> DistillResult:
    """Run ``cfg.steps`` optimizer steps. ``batches(start_step)`` yields LongTensor [B, L+1] from
    batch ``start_step`` on (deterministic, so a resumed run sees the same data). A checkpoint is
    written to ``state_dir`` every ``cfg.checkpoint_every`` steps and at the end."""
    from tqdm import tqdm

    cfg.validate()
    state_dir = Path(state_dir) if state_dir is not None else None
    opt = make_optimizer(student, cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    start, log = 0, []
    if resume:
        if state_dir is None:
            raise ValueError("--resume needs a state directory")
        start, log = load_state(state_dir, student, opt, gen, cfg)
    params = [p for _, p in student.trainable()]
    t0 = time.time() - (log[-1]["elapsed_s"] if log else 0.0)
    data = batches(start)
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="distilling", disable=not progress,
               mininterval=5)
    device = next(student.model.parameters()).device
    for step in bar:
        batch = next(data).to(device)
        if batch.shape[1] != cfg.seq_len + 1:
            raise ValueError(f"batch of {batch.shape[1]} tokens per row; expected seq_len + 1 = {cfg.seq_len + 1}")
        for g in opt.param_groups:
            g["lr"] = g["base_lr"] * lr_scale(step, cfg)
        splits = [draw_split(cfg.seq_len, cfg.split_point, gen) for _ in range(batch.shape[0])]
        opt.zero_grad(set_to_none=True)
        rec = distill_loss(student, batch, splits, cfg)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip) if cfg.grad_clip > 0 else torch.tensor(0.0)
        opt.step()
        done = (log[-1]["tokens"] if log else 0) + rec["tokens"]
        rec.update(step=step + 1, lr=opt.param_groups[-1]["lr"], grad_norm=float(grad_norm),
                   elapsed_s=time.time() - t0, tokens=done, mean_split=sum(splits) / len(splits))
        log.append(rec)
        bar.set_postfix(loss=f"{rec['loss']:.3f}", kd=f"{rec['kd']:.3f}", tok_s=f"{done / max(rec['elapsed_s'], 1e-9):.0f}")
        if state_dir is not None and ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps):
            save_state(state_dir, student, opt, step + 1, gen, log, cfg)
            plot_loss(log, state_dir / "loss_curve.png")
        if callback is not None:
            callback(step + 1, rec)
    return DistillResult(student, log, log[-1]["elapsed_s"] if log else 0.0, start)


def plot_loss(log: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in log]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for key, label in (("loss", "loss"), ("kd", "KD (top-64 + rest)"), ("ce", "CE")):
        ax.plot(steps, [r[key] for r in log], label=label, lw=1)
    ax.set_xlabel("step")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    ax.set_title("distillation from the teacher's KV cache")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def export(student: Student, out: str | Path, result: DistillResult | None = None, overwrite: bool = False,
           source: Path | None = None, extra: dict | None = None) -> Path:
    """Write the merged stock checkpoint, its plan (re-fingerprinted for the distilled weights, with a
    meta note), the log and the loss curve. Temp directory + rename: never half an output."""
    out = refuse_existing(out, overwrite, (source,))
    merged = student.merged_model()
    merged.moetailor_source = str(out)
    counts = student.counts()
    note = {"distilled": True, "distilled_from": model_fingerprint(student.model),
            "note": "decode model: serve with this plan's decode policy; prefill runs on the original model "
                    "(distilled_from), whose KV cache this decoder was trained to continue from",
            "trainable": counts, **(extra or {})}
    bad = [name for name, t in merged.state_dict().items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise ValueError(f"distillation diverged: {len(bad)} tensors of the trained decoder hold NaN or infinite "
                         f"values ({', '.join(bad[:3])}...); nothing was written — lower --lr or --alpha and rerun")
    plan = Plan(model=model_fingerprint(merged), prefill=student.plan.prefill, decode=student.plan.decode,
                meta={**student.plan.meta, "distillation": note}, fold_stats=student.plan.fold_stats)
    with checkpoint_directory(out, overwrite, (source,)) as tmp:
        merged.save_pretrained(tmp)
        copy_tokenizer(source, tmp)
        plan.save(tmp / DISTILL_PLAN_FILE)
        side = {"format": "moetailor-distill", "version": 1, "source_model": note["distilled_from"],
                "source_path": str(source) if source is not None else None, "plan_meta": student.plan.meta,
                "trainable": counts, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), **(extra or {})}
        if result is not None:
            side.update(steps=len(result.log), tokens=result.log[-1]["tokens"] if result.log else 0,
                        seconds=round(result.seconds, 1), final=result.log[-1] if result.log else None)
            (tmp / "train_log.json").write_text(json.dumps(result.log))
            if result.log:
                plot_loss(result.log, tmp / "loss_curve.png")
        (tmp / DISTILL_SIDECAR).write_text(json.dumps(side, indent=1))
    return out


def token_batches(tokenizer, spec: str, cfg: DistillConfig) -> Callable[[int], Iterator[torch.Tensor]]:
    """Training batches [B, L+1] from a calibration data spec (``calibration.data``: 'mix' = the task
    training stream + bundled calibration text, never the evaluation seeds), restartable at a step."""
    from ..calibration.data import iter_token_windows, parse_data_spec

    parse_data_spec(spec)

    def batches(start: int) -> Iterator[torch.Tensor]:
        windows = iter_token_windows(tokenizer, spec, tokens=10**15, seq_len=cfg.seq_len + 1, seed=cfg.seed)
        for _ in range(start * cfg.batch_size):  # skip what the interrupted run already saw
            next(windows)
        while True:
            yield torch.tensor([next(windows) for _ in range(cfg.batch_size)], dtype=torch.long)
    return batches


def distill_checkpoint(model_name: str | Path, plan: str | Path | Plan, data: str, cfg: DistillConfig, out: str | Path,
                       overwrite: bool = False, resume: bool = False, progress: bool = True,
                       command: str | None = None, device="cpu") -> tuple[Path, DistillResult]:
    """The `moetailor distill` pipeline: load (onto ``device``), check, train (resumable from
    ``OUT.partial``), export."""
    from ..calibration.data import data_file, parse_data_spec
    from ..models.loading import load_model, load_tokenizer, resolve_model_path

    cfg.validate()
    parse_data_spec(data)
    source = resolve_model_path(model_name)
    inputs = (source, None if isinstance(plan, Plan) else plan, data_file(data))
    out = refuse_existing(out, overwrite, inputs)   # before any work
    state_dir = out.parent / f"{out.name}.partial"
    if resume:
        if not (state_dir / STATE_FILE).is_file():
            raise FileNotFoundError(f"--resume: no interrupted run at {state_dir}; start without --resume")
        read_state(state_dir / STATE_FILE)   # unreadable: say so before loading the model
    elif (state_dir / STATE_FILE).is_file():
        if not overwrite:
            raise FileExistsError(f"an interrupted run exists at {state_dir}; pass --resume to continue it or "
                                  "--overwrite to start over")
        shutil.rmtree(state_dir)
    from ..device import Placement

    model = load_model(source, placement=Placement.of(device, spread=True))   # training runs HF forwards only
    plan = plan if isinstance(plan, Plan) else Plan.load(plan)
    student = Student(model, plan, se2=cfg.se2, experts=cfg.experts)
    tokenizer = load_tokenizer(source)
    result = train(student, token_batches(tokenizer, data, cfg), cfg, state_dir=state_dir, resume=resume,
                   progress=progress)
    extra = {"config": asdict(cfg), "data": data, "command": command}
    path = export(student, out, result, overwrite=overwrite, source=source, extra=extra)
    shutil.rmtree(state_dir, ignore_errors=True)
    student.close()
    return path, result
