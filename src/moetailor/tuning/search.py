"""The staged search behind `moetailor tune`: cheap proxies first, task accuracy on the few best.

Stages (each candidate's evidence is cached in ``OUT/candidates/KEY.json``, so a rerun resumes):

1. calibrate on the traffic once (``calibration.calibrate``, with fold tables; streamed layer by layer
   for a checkpoint that does not fit): ``OUT/stats.safetensors``. A traffic file of prompt/answer
   lines (the ``eval --tasks`` format) is calibrated on the full model's own decode traces: each
   prompt with the full model's greedy completion (``OUT/traces.jsonl``), since the decode pool
   must reproduce what the full model decodes, not the prompts;
2. score every criterion at coarse uniform pool sizes by next-token KL to the full model on held-out
   traffic windows (the traffic stream after the calibration tokens; ``eval.metrics.HeldoutScorer``:
   first half prefilled by the full model, KL on the decode half under the candidate);
3. for the best criterion: every pool size on the fine grid, masked and folded; per-layer sizes
   under a fixed total from measured layer sensitivity (``tuning.sensitivity``); top-k reduction
   on the proxy front where the batch makes it pay; near the target, novice pools (MoNE score and
   the best criterion; uniform, and per-layer from each layer's novice sensitivity, refined at the target by
   coordinate descent), merged experts (HC-SMoE, M-SMoE; scored on their merged checkpoints, by the
   embedded engine whatever ``--backend``: a plan switch on one vLLM engine cannot give another
   checkpoint) and each of those and the masked pool with the model's super experts protected;
4. task accuracy on the user's prompts (``eval`` scorers, through the engine) for the full model and
   the few proxy-front candidates nearest the target, walking the front until the floor is bracketed.
   A point meets an accuracy floor only when the paired 95% interval of its share of the full model's
   accuracy lies above it (``eval.metrics.floor_verdict``); one whose interval straddles the floor is
   "not enough prompts to tell", never chosen, and named with the prompts that would decide. The plans
   this names (the choice, the cheapest meeting the floor, the best at the target) then run a second,
   disjoint prompt set of the same size, and their verdicts are that set's: picked as the best of
   several on one set, a plan looks better there than it is;
5. optionally distil the best plan at the target (``training.distill``) and evaluate it served as
   deployed (prefill on the original model, decode on the distilled checkpoint).
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..eval.runner import content_digest
from ..models.paths import is_bundled
from ..outputs import write_json
from .candidates import Candidate, candidate_plan
from .front import Choice, choose, paired, pareto

CRITERIA = ("frequency", "mass", "ean", "reap")
SERVABLE = ("engine", "vllm")
CACHE_VERSION = 1


@dataclass
class TuneSettings:
    model: str
    data: str                           # the traffic: a calibration data spec (``calibrate --data``)
    out: Path
    tasks: str | None = None            # prompts with answers for --min-quality (None: from data when it has them)
    min_quality: float | None = None    # share of the full model's task accuracy
    max_kl: float | None = None         # bound on held-out traffic KL (nats per token)
    budget: float | None = None         # target: share of expert weights a decode step reads
    min_tok_s: float | None = None      # target: decode tokens/s (engine-measured, or projected with gpu)
    gpu: str | None = None
    model_shape: str | None = None
    context: int = 1024                 # mean context for the projection
    batch: int = 64                     # decode batch the budget and speed are taken at
    criteria: tuple[str, ...] = CRITERIA
    fold: bool = True
    novice: bool | None = None          # novice pools (dropped experts replaced by their mean outputs): None
                                        # where the evaluator runs them (else skipped, with a note), True asked
                                        # for (refused where it cannot), False left out
    merge: bool = True                  # merged experts (HC-SMoE, M-SMoE), served as merged checkpoints
    protect_super: int = 8              # super experts protected as a search dimension (0: never)
    allocation: bool = True
    top_k: bool = True
    servable: str = "engine"
    calib_tokens: int = 200_000
    kl_tokens: int = 4096
    kl_window: int = 128
    n: int = 50                         # prompts per task (built-in) or the first n lines (a file)
    evaluate: int = 8                   # candidates given the full task evaluation (besides the full model)
    confirm: bool = True                # verdicts of the named plans on fresh prompts (``Tuner._confirm``)
    distill_steps: int = 0
    distill_lr: float = 1e-3
    seed: int = 0
    stream: str = "auto"
    dtype: str | None = None            # None: fp32 (what eval and serve compute in), or the stored dtype where only it fits
    device: str = "cpu"                # --device: where the weights run (``device.Placement``)
    overwrite: bool = False
    command: str = ""
    backend: str = "engine"             # where candidates run (eval/backends.py): engine | vllm
    vllm_url: str | None = None         # --backend vllm: a running `moetailor serve --backend vllm`

    def validate(self) -> None:
        from ..calibration.data import parse_data_spec
        from ..eval.backends import check_backend
        from ..plans.criteria import CRITERIA as KNOWN

        served = check_backend(self.backend, self.vllm_url, self.model)
        if served is not None and self.novice and not served.get("novice"):
            raise ValueError(f"--novice: the vLLM server at {self.vllm_url} adds no novice constants, so novice plans "
                             f"cannot switch in; restart it with `moetailor serve {self.model} --backend vllm "
                             "--vllm-no-prefix-caching --vllm-novice`, or drop --novice")
        if self.backend == "vllm":
            if self.servable != "vllm":
                raise ValueError("--backend vllm scores the plans vLLM's plugin runs: add --servable vllm")
            if self.stream == "on":
                raise ValueError("--backend vllm reads the model in memory for its plans; drop --stream on")
            if self.min_tok_s is not None and self.gpu is None:
                raise ValueError("--backend vllm does not time candidates: give --budget, or project --min-tok-s with "
                                 "--gpu/--model-shape (time vLLM with `moetailor bench vllm`)")
        parse_data_spec(self.data)
        if self.min_quality is None and self.max_kl is None:
            raise ValueError("give a quality floor: --min-quality SHARE (of the full model's task accuracy) "
                             "and/or --max-kl NATS (held-out KL on the traffic)")
        if self.min_quality is not None and not 0 < self.min_quality <= 1:
            raise ValueError(f"--min-quality {self.min_quality} must be a share in (0, 1], e.g. 0.97")
        if self.max_kl is not None and self.max_kl < 0:
            raise ValueError(f"--max-kl {self.max_kl} must be >= 0 nats")
        if self.budget is not None and self.min_tok_s is not None:
            raise ValueError("give one target: --budget SHARE or --min-tok-s N, not both")
        if self.budget is not None and not 0 < self.budget <= 1:
            raise ValueError(f"--budget {self.budget} must be a share in (0, 1], e.g. 0.5")
        if self.min_tok_s is not None and self.min_tok_s <= 0:
            raise ValueError(f"--min-tok-s {self.min_tok_s} must be positive")
        if (self.gpu is None) != (self.model_shape is None):
            raise ValueError("a projected speed needs both --gpu and --model-shape (as `moetailor bench project`)")
        if self.gpu is not None and self.min_tok_s is None:
            raise ValueError("--gpu/--model-shape project a speed target: also give --min-tok-s N")
        if self.gpu is not None:
            from ..bench.roofline import GPUS, SHAPES
            if self.gpu not in GPUS or self.model_shape not in SHAPES:
                raise ValueError(f"unknown --gpu {self.gpu!r} or --model-shape {self.model_shape!r}; GPUs: "
                                 f"{', '.join(GPUS)}; shapes: {', '.join(SHAPES)}")
        bad = [c for c in self.criteria if c not in KNOWN]
        if bad or not self.criteria:
            raise ValueError(f"unknown criterion {bad[0] if bad else ''!r}; valid: {', '.join(KNOWN)}")
        if self.servable not in SERVABLE:
            raise ValueError(f"--servable {self.servable!r}: choose from {', '.join(SERVABLE)}")
        if self.servable == "vllm" and self.distill_steps:
            raise ValueError("--distill makes a distilled decoder, which moetailor's engine serves and vLLM's plugin "
                             "does not; drop --distill or --servable vllm")
        for name in ("batch", "calib_tokens", "kl_tokens", "n"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.kl_window < 8:
            raise ValueError(f"--kl-window must be at least 8 tokens, got {self.kl_window}")
        if self.kl_tokens < self.kl_window:
            raise ValueError(f"--kl-tokens {self.kl_tokens} is less than one --kl-window of {self.kl_window}")
        if self.evaluate < 0 or self.distill_steps < 0 or self.protect_super < 0:
            raise ValueError("--evaluate, --distill and --protect-super must be >= 0")


@dataclass
class TuneResult:
    points: list[dict]                  # every scored candidate's evidence (full model first)
    front: list[dict]                   # the Pareto front the choice was made on
    choice: Choice
    quality: str                        # "accuracy" or "kl"
    full: dict
    plan_path: Path | None
    summary: dict = field(default_factory=dict)


def is_task_traffic(spec) -> bool:
    """Whether a traffic file holds prompt/answer lines (the ``eval --tasks`` format) rather than text."""
    from ..calibration.data import parse_data_spec

    spec = parse_data_spec(spec)
    if spec.kind != "file" or spec.path.suffix != ".jsonl":
        return False
    with spec.path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    return False       # calibrate's reader names the bad line
                return isinstance(row, dict) and "answer" in row and "text" not in row and "completion" not in row
    return False


def heldout_traffic_windows(tokenizer, data: str, skip: int, tokens: int, window: int) -> list[list[int]]:
    """Full windows of the traffic stream after the first ``skip`` tokens (what calibration read):
    text the statistics did not see, as long as the traffic holds more than ``skip + tokens`` tokens."""
    from ..calibration.data import iter_token_windows

    drop = -(-skip // window)
    out = [w for i, w in enumerate(iter_token_windows(tokenizer, data, (drop * window) + tokens, window))
           if i >= drop and len(w) == window]
    if not out:
        raise ValueError(f"--kl-tokens {tokens} give no full window of {window} tokens; raise --kl-tokens")
    return out


class Tuner:
    """One `moetailor tune` run (see the module docstring). ``log`` receives one line per step."""

    def __init__(self, settings: TuneSettings, log=None, progress: bool = True):
        settings.validate()
        self.s = settings
        self.log = log or (lambda m: print(m, file=sys.stderr))
        self.progress = progress
        self.out = Path(settings.out)
        self.scored: dict[str, dict] = {}
        self.plans: dict[str, object] = {}
        self.notes: list[str] = []      # what the search left out or scored elsewhere, and why (printed, front.json)
        self._sets: dict[str, tuple[list, str]] = {}   # "tasks" / "fresh": (examples, identity) (``_examples``)

    # ---- set-up ----------------------------------------------------------------------------------
    def _setup(self) -> None:
        from ..calibration.data import iter_documents, parse_data_spec
        from ..models import load_tokenizer, resolve_model_path
        from ..models.checkpoint import should_stream
        from ..outputs import check_output

        s = self.s
        self.path = resolve_model_path(s.model)
        check_output(self.out, overwrite=True, directory=True, replaces=False,
                     inputs=(self.path, parse_data_spec(s.data).path))
        self.tokenizer = load_tokenizer(s.model)
        self.task_traffic = is_task_traffic(s.data)
        if not self.task_traffic:
            next(iter_documents(s.data, s.seed, self.tokenizer))   # a bad traffic file fails here, as in calibrate
        self.tasks = self._tasks()
        if s.min_quality is not None and not self.tasks:
            raise ValueError("--min-quality needs prompts with answers: pass --tasks FILE.jsonl (lines with "
                             "\"prompt\" and \"answer\", as for `moetailor eval --tasks`) or use --max-kl")
        from ..device import Placement
        self.placement = Placement.of(s.device)
        self.dtype = self._working_dtype()
        self.streamed = should_stream(self.path, self.dtype, s.stream, device=self.placement.device)
        if self.streamed and self.tasks and s.min_quality is not None:
            raise ValueError("this checkpoint is evaluated layer by layer (it does not fit in memory), where the "
                             "engine cannot run tasks; use --max-kl NATS as the floor (or --stream off)")
        if self.streamed and s.backend != "engine":
            raise ValueError("this checkpoint does not fit in memory, where --backend vllm cannot make its plans yet; "
                             "use --backend engine (layer-streamed scoring)")
        if self.streamed and s.min_tok_s is not None and s.gpu is None:
            raise ValueError("a layer-streamed checkpoint cannot be timed by the engine; project the speed with "
                             "--gpu and --model-shape, or use --budget")
        for sub in ("candidates", "plans"):
            (self.out / sub).mkdir(parents=True, exist_ok=True)
        if self.streamed:
            from ..models.streamed import LayerStream
            self.model = LayerStream(self.path, self.dtype, self.placement).model   # meta skeleton: fingerprint, routers
        else:
            from ..models import load_model
            self.model = load_model(s.model, dtype=self.dtype, placement=self.placement)
        from ..models.loading import model_fingerprint, weights_hash
        self.fp = model_fingerprint(self.model)
        self.E, self.k, self.layers = self.fp["num_experts"], self.fp["top_k"], list(self.fp["moe_layers"])
        from ..models.groups import fingerprint_semantics, min_per_group
        sem = fingerprint_semantics(self.fp)
        n_group = sem.n_group if sem is not None else 1
        step = max(1, self.E // 16)
        self.step = -(-step // n_group) * n_group     # grouped routers: the same count in every group
        self.min_pool = max(self.k, n_group * min_per_group(sem)) if sem is not None else self.k
        self.weights = weights_hash(self.model) if not self.streamed else content_digest(
            [self.fp, sorted((p.name, p.stat().st_size) for p in self.path.glob("*.safetensors"))])
        if not self.streamed:
            from ..eval.backends import make_backend
            self.backend = make_backend(s.backend, self.model, self.tokenizer, self.path, url=s.vllm_url,
                                        novice=s.novice is not False)
            if s.novice is None and not self.backend.novice:
                self._note(f"novice pools not searched: the vLLM server at {s.vllm_url} adds no novice constants "
                           f"(restart it with `moetailor serve {s.model} --backend vllm --vllm-no-prefix-caching "
                           "--vllm-novice` to search them)")

    def _note(self, line: str) -> None:
        if line not in self.notes:
            self.notes.append(line)
            self.log(line)

    def _working_dtype(self):
        """``--dtype``, or by default float32: what `eval`'s generation and the engine verbs compute in, so
        a verdict of tune's is the one `eval` reproduces (in the stored bf16 a near-tie prompt can flip:
        278 against eval's 279 of 300 on reference-qwen3). A checkpoint that fits in memory only in its
        stored dtype is computed in that dtype (said in one line) rather than scored layer by layer."""
        import torch

        from ..models.checkpoint import should_stream, working_dtype

        if self.s.dtype is not None:
            return working_dtype(self.s.dtype, self.path)
        stored = working_dtype("auto", self.path)
        device = self.placement.device
        if (stored != torch.float32 and self.s.stream == "auto" and should_stream(self.path, torch.float32, device=device)
                and not should_stream(self.path, stored, device=device)):
            self.log(f"computing in the checkpoint's {str(stored).replace('torch.', '')}: float32 does not fit in memory "
                     f"(`eval` computes in float32, so a near-tie prompt may score differently there)")
            return stored
        return torch.float32

    def _tasks(self) -> list:
        from ..eval.user_tasks import select_tasks

        spec = self.s.tasks
        if spec is None and self.task_traffic:
            spec = self.s.data
        if spec is None and is_bundled(self.s.model):   # a bundled model's traffic is its own task suite
            head, _, names = self.s.data.partition(":")
            spec = (names or "all") if head == "tasks" else None
        return select_tasks(spec) if spec else []

    # ---- stage 1: calibration (and decode traces) -------------------------------------------------
    def _traces(self) -> str:
        """For prompt/answer traffic: each prompt with the full model's greedy completion, as text lines."""
        from ..eval.runner import task_budget
        from ..eval.user_tasks import load_user_tasks

        path = self.out / "traces.jsonl"
        tasks = load_user_tasks(self.s.data)
        ident = content_digest([self.weights, [t.digest for t in tasks]])
        marker = self.out / "traces.identity"
        if path.is_file() and marker.is_file() and marker.read_text().strip() == ident:
            return str(path)
        examples = [ex for t in tasks for ex in t.examples(None, self.tokenizer)]
        self.log(f"decode traces: the full model answers the {len(examples)} traffic prompts (calibration text)")
        outs = self._generate(None, [ex.prompt for ex in examples], [task_budget(t, self.tokenizer) for t in tasks
                                                                     for _ in t.items])
        lines = [json.dumps({"text": ex.prompt + o.text}) for ex, o in zip(examples, outs)]
        from ..outputs import write_text
        write_text(path, "\n".join(lines) + "\n")
        write_text(marker, ident + "\n")
        return str(path)

    def _stats(self):
        """The traffic's statistics (``eval.runner.calibrated_stats``), with fold tables where the model is in
        memory: computed once into OUT/stats.safetensors, streamed layer by layer where it does not fit."""
        from ..eval.runner import calibrated_stats

        def compute():
            if self.streamed:
                from ..calibration.streaming import calibrate_streamed
                return calibrate_streamed(self.path, self.tokenizer, self.calib_data, self.s.calib_tokens,
                                          dtype=self.dtype, seed=self.s.seed, progress=self.progress,
                                          command=self.s.command, placement=self.placement)
            from ..calibration import calibrate
            return calibrate(self.model, self.tokenizer, self.calib_data, self.s.calib_tokens, seed=self.s.seed,
                             fold=self.s.fold, progress=self.progress, command=self.s.command)

        path = self.out / "stats.safetensors"
        return calibrated_stats(self.model, path, self.calib_data, self.s.calib_tokens, self.log, compute,
                                overwrite=self.s.overwrite, fold=not self.streamed), path

    # ---- scoring ---------------------------------------------------------------------------------
    def _identity(self) -> dict:
        ident = {"version": CACHE_VERSION, "weights": self.weights, "stats": self.stats.meta.get("data_sha256"),
                 "windows": content_digest(self.windows), "kind": "streamed" if self.streamed else "phase-aware"}
        if self.s.backend != "engine":   # the engine's caches keep their identity (no backend field)
            ident["backend"] = self.s.backend
        return ident

    def plan(self, c: Candidate):
        if c.key not in self.plans:
            self.plans[c.key] = candidate_plan(c, self.stats, self.fp, str(self.stats_path.resolve()),
                                               model=self.model, tune_data=self.s.data)
        return self.plans[c.key]

    def merged_dir(self, c: Candidate) -> Path:
        """The merged decoder of a merge candidate, written once into OUT/merged/KEY-<plan hash> (a stock
        checkpoint; the hash covers the statistics, so other statistics never reuse it)."""
        from ..plans.plan import plan_hash
        from ..transforms.streaming import prune_checkpoint_streamed

        out = self.out / "merged" / f"{c.key}-{plan_hash(self.plan(c))[:8]}"
        if not (out / "config.json").is_file():
            out.parent.mkdir(exist_ok=True)
            prune_checkpoint_streamed(self.path, self.plan(c), out, overwrite=True, progress=False,
                                      command=self.s.command)
        return out

    def _cache(self, c: Candidate) -> Path:
        return self.out / "candidates" / f"{c.key}.json"

    def _read(self, c: Candidate) -> dict | None:
        path = self._cache(c)
        if not path.is_file():
            return None
        try:
            record = json.loads(path.read_text())
        except json.JSONDecodeError:
            return None
        if record.get("identity") == self.identity:
            return record
        if self.s.overwrite:
            return None
        raise ValueError(f"{path} was computed for another model, traffic or setting; pass --overwrite to "
                         "recompute, or choose a fresh --out")

    def score(self, c: Candidate) -> dict:
        """The candidate's proxy evidence (cached): budget and held-out traffic KL."""
        if c.key in self.scored:
            return self.scored[c.key]
        record = self._read(c)
        if record is None:
            t0 = time.time()
            if c.is_full(self.E):
                kl = 0.0
            elif self.streamed:
                from ..eval.streamed_kl import heldout_kl_streamed
                kl = heldout_kl_streamed(self.path, self.windows, plan=self.plan(c), dtype=self.dtype,
                                         progress=False, placement=self.placement).kl
            elif c.checkpoint:   # full prefill on the model, decode on the merged checkpoint (the engine)
                kl = self._engine_scorer().score(None, None, self._load(self.merged_dir(c))).kl
            else:
                plan = self.plan(c)
                kl = self.backend.heldout(plan.with_phases(None, plan.decode), self.windows).kl
            record = {"identity": self.identity, "candidate": c.to_json(), "kl": kl,
                      "kl_seconds": round(time.time() - t0, 2)}
            write_json(self._cache(c), record)
        if c.checkpoint:
            record = {**record, "merged": str(self.merged_dir(c))}
        record = {**record, "key": c.key, "label": c.describe(self.E),
                  "budget": round(c.read_share(self.E, self.k, self.s.batch), 6),
                  "pool_share": round(c.pool_share(self.E), 6), "vllm": c.runs_on_vllm(),
                  "scored_by": "engine" if c.checkpoint else self.s.backend}   # a merged decoder: its own checkpoint
        self.scored[c.key] = record
        return record

    def _engine_scorer(self):
        """The embedded engine's held-out scorer of the traffic windows (the full model's predictions
        computed once): merged and distilled decoders are scored by it whatever --backend."""
        if not hasattr(self, "scorer"):
            from ..eval.metrics import HeldoutScorer
            self.scorer = HeldoutScorer(self.model, self.windows)
        return self.scorer

    def _score_all(self, cands: list[Candidate], desc: str) -> list[dict]:
        from tqdm import tqdm

        return [self.score(c) for c in tqdm(cands, desc=desc, unit="plan", disable=not self.progress,
                                            file=sys.stderr, leave=False)]

    # ---- stages 2-3: the proxy search -----------------------------------------------------------
    def _allowed(self, c: Candidate) -> bool:
        return self.s.servable == "engine" or c.runs_on_vllm()

    def _uniform(self, criterion: str, size: int, mode: str = "mask") -> Candidate:
        return Candidate(criterion, (size,) * len(self.layers), mode)

    def _proxy_target(self) -> float:
        """The budget the proxy search centres on: --budget, or the full pool for a speed target."""
        return self.s.budget if self.s.budget is not None else 0.5

    def search(self) -> None:
        from .sensitivity import allocate, grid, measure_curves, measured_sizes

        fine = [m for m in grid(self.E, self.min_pool, self.step) if m < self.E]
        coarse_step = max(self.step, -(-self.E // 8 // self.step) * self.step)
        coarse = [m for m in grid(self.E, self.min_pool, coarse_step) if m < self.E] or fine
        # stage 2: criteria at coarse sizes
        by_criterion = {crit: self._score_all([self._uniform(crit, m) for m in coarse], f"criterion {crit}")
                        for crit in self.s.criteria}
        nearest = min(coarse, key=lambda m: abs(m / self.E - self._proxy_target()))
        at_nearest = {c: next(r["kl"] for r in rs if r["candidate"]["sizes"][0] == nearest)
                      for c, rs in by_criterion.items()}
        best = min(self.s.criteria, key=lambda c: (at_nearest[c], sum(r["kl"] for r in by_criterion[c])))
        self.best_criterion = best
        self.log(f"best criterion on the traffic: {best} (KL at {nearest}/{self.E}: "
                 + ", ".join(f"{c} {at_nearest[c]:.4f}" for c in self.s.criteria) + ")")
        modes = ["mask"] + (["fold"] if self.s.fold and not self.streamed else [])
        cands = [self._uniform(best, m, mode) for m in fine for mode in modes]
        self._score_all(cands, f"{best} pools")
        # stage 3: per-layer sizes from measured sensitivity, every total on the fine grid
        if self.s.allocation and len(self.layers) > 1 and not self.streamed:
            sizes = measured_sizes(self.E, self.min_pool, self.step)
            from tqdm import tqdm
            bar = tqdm(total=len(sizes) * len(self.layers), desc="layer sensitivity", unit="plan",
                       disable=not self.progress, file=sys.stderr, leave=False)

            def kl_of(alloc: list[int]) -> float:
                return self.score(Candidate(best, tuple(alloc), "mask", allocation="uniform"))["kl"]
            curves = measure_curves(kl_of, len(self.layers), self.E, sizes, progress=bar.update)
            bar.close()
            self.sensitivity = {"criterion": best, "sizes": sizes,
                                "curves": [{str(m): round(v, 6) for m, v in c.items()} for c in curves]}
            allocs = []
            for m in fine:
                alloc = allocate(curves, m * len(self.layers), self.E, self.min_pool, self.step)
                if alloc is not None and len(set(alloc)) > 1:
                    allocs += [Candidate(best, tuple(alloc), mode, allocation="sensitivity") for mode in modes]
            self._score_all(allocs, "sensitivity allocations")
        # stage 3c: novice pools, merged experts and protected super experts near the target
        self._score_all(self._replacements(best, fine), "novice / merged / super experts")
        # stage 3b: top-k reduction where the decode batch makes it read fewer experts
        if self.s.top_k:
            front = self.proxy_front()
            extra = []
            for r in front:
                c = Candidate.from_json(r["candidate"])
                if c.top_k is not None or c.is_full(self.E) or c.pool_mode in ("novice", "merge"):
                    continue     # novice and merged pools keep the model's k (their routes are the full router's)
                for k2 in range(self.k - 1, max(1, self.k // 2) - 1, -1):
                    c2 = Candidate(c.criterion, c.sizes, c.pool_mode, k2, c.allocation, c.protect_super)
                    if c.read_share(self.E, self.k, self.s.batch) - c2.read_share(self.E, self.k, self.s.batch) >= 0.01:
                        extra.append(c2)
            self._score_all(extra, "top-k reduction")

    def _replacements(self, best: str, fine: list[int]) -> list[Candidate]:
        """The candidates that replace dropped experts instead of masking them, at the fine sizes nearest
        the target (two either side): novice pools (the MoNE score and ``best``), merged experts (HC-SMoE,
        M-SMoE), and each of those and ``best``'s masked pool with the super experts protected."""
        s = self.s
        if self.streamed:   # built from the model in memory
            return []
        near = sorted(fine, key=lambda m: abs(m / self.E - self._proxy_target()))[:5]
        grouped = (self.fp.get("n_group") or 1) > 1      # merging and protection are refused there (plans say why)
        protect = [0] + ([s.protect_super] if s.protect_super and self.stats.has_outputs and not grouped else [])
        novice = s.novice is not False and self.backend.novice and self.stats.has_outputs
        out = []
        for m in sorted(near):
            sizes = (m,) * len(self.layers)
            for p in protect:
                if p >= m:
                    continue
                kinds = [Candidate(best, sizes, "mask", protect_super=p)] if p else []
                if novice:
                    kinds += [Candidate(c, sizes, "novice", protect_super=p) for c in dict.fromkeys(("mone", best))]
                if s.merge and self.stats.has_outputs and not grouped:
                    kinds += [Candidate("frequency", sizes, "merge", protect_super=p, merge=g) for g in ("hcsmoe", "msmoe")]
                out += kinds
        if novice and s.allocation and len(self.layers) > 1:
            out += self._novice_allocations(tuple(dict.fromkeys(("mone", best))), sorted(near), near[0])
        if s.backend != "engine" and any(c.checkpoint for c in out):
            self._note("merged experts are scored on moetailor's engine (prefill on the model, decode on the merged "
                       "checkpoint): vLLM's evaluator switches plans on one engine, and a merged decoder is another "
                       "checkpoint (\"scored on\": engine in the table and front.json)")
        return out

    def _novice_allocations(self, criteria: tuple[str, ...], totals: list[int], target: int) -> list[Candidate]:
        """Per-layer novice pool sizes at each of ``totals`` (experts per layer on average), from each
        layer's own novice sensitivity curve (stage 3's additive model): a layer whose dropped experts
        are close to their constants needs fewer kept places than one that loses them outright, so the
        masked curves would misplace them. At ``target`` the additive allocation is refined by the
        coordinate descent of `plan --layers search` (``eval.search_k.descend``) on the traffic KL,
        since layers' novice errors interact; and so is the uniform pool, where `plan --layers search`
        starts (the two descents can end in different local optima). Every probe is cached as stage 3's
        are."""
        from ..eval.search_k import descend
        from .sensitivity import allocate, measure_curves, measured_sizes

        n, sizes, out = len(self.layers), measured_sizes(self.E, self.min_pool, self.step), []
        for crit in criteria:
            def kl_of(alloc: list[int]) -> float:
                return self.score(Candidate(crit, tuple(alloc), "novice", allocation="uniform"))["kl"]
            curves = measure_curves(kl_of, n, self.E, sizes)
            for m in totals:
                alloc = allocate(curves, m * n, self.E, self.min_pool, self.step)
                if alloc is not None and len(set(alloc)) > 1:
                    out.append(Candidate(crit, tuple(alloc), "novice", allocation="sensitivity"))
            additive = allocate(curves, target * n, self.E, self.min_pool, self.step) or [target] * n
            for start in dict.fromkeys((tuple(additive), (target,) * n)):
                refined = descend(kl_of, list(start), low=self.min_pool, high=self.E, step=self.step,
                                  progress=False, log=lambda m: None).ks
                if len(set(refined)) > 1:
                    out.append(Candidate(crit, tuple(refined), "novice", allocation="sensitivity"))
        return list(dict.fromkeys(out))

    def proxy_front(self) -> list[dict]:
        """Lowest held-out KL for each budget, among servable candidates (probes excluded)."""
        pts = [r for r in self.scored.values() if self._allowed(Candidate.from_json(r["candidate"]))
               and not self._is_probe(r)]
        return pareto(pts, cost=lambda r: r["budget"], quality=lambda r: -r["kl"])

    def _is_probe(self, r: dict) -> bool:
        c = Candidate.from_json(r["candidate"])
        return c.allocation == "uniform" and len(set(c.sizes)) > 1

    # ---- speed ----------------------------------------------------------------------------------
    def speed(self, r: dict) -> float | None:
        """Decode tokens/s of a point at --batch: projected on --gpu, or measured by the engine."""
        if self.s.min_tok_s is None:
            return None
        if "tok_s" in r:
            return r["tok_s"]
        if self.s.gpu is not None:
            from ..bench.roofline import GPUS, SHAPES, step_cost
            cost = step_cost(SHAPES[self.s.model_shape], GPUS[self.s.gpu], self.s.batch, self.s.context,
                             keep=min(1.0, r["pool_share"]))
            r["tok_s"], r["tok_s_kind"] = round(cost.throughput, 1), f"projected {self.s.gpu} {self.s.model_shape}"
        else:
            from ..bench.measure import engine_decode, make_llm
            if not hasattr(self, "_bench_llm"):
                self._bench_llm = make_llm(self.model, self.s.batch, 16 + 10 + 4)
            c = Candidate.from_json(r["candidate"])
            self._bench_llm.set_plan(None if c.is_full(self.E) else self._speed_plan(c))
            result = engine_decode(self._bench_llm, self.s.batch, 16, 10)
            self._bench_llm.set_plan(None)
            r["tok_s"], r["tok_s_kind"] = round(result.tokens_per_s, 1), "measured (engine, this machine)"
        return r["tok_s"]

    def _speed_plan(self, c: Candidate):
        """The plan timed for ``c``: its own; a merged pool reads as many experts as the masked pool of
        its representatives, which is timed in its place."""
        plan = self.plan(c)
        if not c.checkpoint:
            return plan
        from ..routing.policy import LayerPolicy, PhasePolicy
        return plan.with_phases(None, PhasePolicy({i: LayerPolicy(keep=p.keep) for i, p in plan.decode.layers.items()}))

    def at_target(self, r: dict) -> bool:
        if self.s.min_tok_s is not None:
            return self.speed(r) >= self.s.min_tok_s
        if self.s.budget is not None:
            return r["budget"] <= self.s.budget + 1e-9
        return True

    # ---- stage 4: task accuracy on the few best ----------------------------------------------------
    def _generate(self, plan, prompts: list[str], budgets: list[int]):
        return self.backend.generate(plan, prompts, self._params(prompts, budgets))

    def _params(self, prompts: list[str], budgets: list[int]) -> list:
        """Greedy sampling within each task's length budget and the model's context (a user task's default
        budget may exceed a small model's context)."""
        from ..serving import SamplingParams

        limit = self.backend.max_model_len
        room = [limit - len(self.tokenizer(p)["input_ids"]) - 1 for p in prompts]
        if min(room) < 1:
            raise ValueError(f"a prompt leaves no room to generate within the model's {limit} tokens; shorten it")
        return [SamplingParams(max_tokens=min(b, r), temperature=0.0) for b, r in zip(budgets, room)]

    def _examples(self, fresh: bool = False) -> list:
        """(example, token budget) pairs: the prompts candidates are picked by (``--n`` per task, ``--seed``),
        or with ``fresh`` the confirmation set: as many other prompts (a built-in task's next seed, without
        any prompt of the first set; a task file's next N lines, none where it has fewer)."""
        from ..eval.runner import task_budget
        from ..data.tasks import Task
        from ..eval.user_tasks import task_examples

        key = "fresh" if fresh else "tasks"
        if key not in self._sets:
            n, seed = self.s.n, self.s.seed
            budgets = {t.name: task_budget(t, self.tokenizer) for t in self.tasks}
            if fresh:
                picked = {ex.prompt for ex, _ in self._examples()}
                chosen = {t.name: [ex for ex in task_examples(t, n, seed + 1, self.tokenizer)
                                   if ex.prompt not in picked]
                          if isinstance(t, Task) else task_examples(t, 2 * n, seed, self.tokenizer)[n:]
                          for t in self.tasks}
                files = [t for t in self.tasks if not isinstance(t, Task)]
                if any(len(chosen[t.name]) < len(t.examples(n)) for t in files):
                    chosen = {}     # a file without N more lines: fewer prompts would prove less than the first set
            else:
                chosen = {t.name: task_examples(t, n, seed, self.tokenizer) for t in self.tasks}
            examples = [(ex, budgets[name]) for name, exs in chosen.items() for ex in exs]
            self._sets[key] = (examples, content_digest([[(ex.task, ex.prompt, ex.answer) for ex, _ in examples],
                                                         budgets]))
        return self._sets[key][0]

    def evaluate(self, r: dict, decode_model: str | None = None, fresh: bool = False) -> dict:
        """Greedy accuracy on the tasks (cached in the candidate's file), paired against the full model;
        ``fresh``: on the confirmation prompts (``r["fresh_tasks"]``)."""
        from ..eval.metrics import accuracy, length_stats, score_output

        examples = self._examples(fresh)
        identity = self._sets["fresh" if fresh else "tasks"][1]
        key = "fresh_tasks" if fresh else "tasks"
        cached = r.get(key)
        if not (cached and cached.get("identity") == identity):
            t0 = time.time()
            prompts, budgets = [ex.prompt for ex, _ in examples], [b for _, b in examples]
            c = Candidate.from_json(r["candidate"])
            if decode_model is None and c.checkpoint:
                decode_model = str(self.merged_dir(c))
            if decode_model is not None:
                from ..serving.disagg import DisaggregatedLLM
                with DisaggregatedLLM(str(self.path), decode_model=decode_model, tokenizer=self.tokenizer,
                                      max_num_seqs=64) as llm:
                    outs = llm.generate(prompts, self._params(prompts, budgets))
            else:
                outs = self._generate(None if c.is_full(self.E) else self.plan(c), prompts, budgets)
            gens = [score_output(ex, o, b) for (ex, b), o in zip(examples, outs)]
            lengths = length_stats(gens)
            per_task = {t.name: round(accuracy([g for g in gens if g.task == t.name]), 4) for t in self.tasks}
            cached = {"identity": identity, "accuracy": accuracy(gens), "correct": [g.correct for g in gens],
                      "per_task": per_task, "p50": lengths.p50, "p90": lengths.p90, "budget_hit": lengths.budget_hit,
                      "prompts": len(gens), "seconds": round(time.time() - t0, 1)}
            r[key] = cached
            stored = {k: v for k, v in r.items() if k not in ("key", "label", "budget", "pool_share", "vllm",
                                                               "scored_by", "tok_s", "tok_s_kind", "fresh")}
            write_json(self.out / "candidates" / f"{r['key']}.json", stored)
        if not fresh:
            r["accuracy"] = cached["accuracy"]
        return r

    def _with_full(self, r: dict, fresh: bool = False) -> dict:
        """The point's share of the full model's accuracy, paired counts and floor verdict, on the prompts it
        was picked by, or with ``fresh`` on the confirmation set (then under ``r["fresh"]``)."""
        from ..eval.metrics import PairedCounts, floor_verdict

        key = "fresh_tasks" if fresh else "tasks"
        mine, full = r[key], self.full[key]
        out = r.setdefault("fresh", {"prompts": mine["prompts"]}) if fresh else r
        out["accuracy"] = mine["accuracy"]
        out["of_full"] = mine["accuracy"] / full["accuracy"] if full["accuracy"] else float("nan")
        g, l, p = paired(mine["correct"], full["correct"])
        out["vs_full"] = {"gained": g, "lost": l, "p": round(p, 4)}
        if self.s.min_quality is not None:
            out["floor"] = floor_verdict(PairedCounts.of(mine["correct"], full["correct"]),
                                         self.s.min_quality).to_json()
        return r

    def _confirm(self, choice: Choice, points: list[dict]) -> Choice:
        """The named plans' verdicts on prompts that did not pick them. The best of several candidates on
        one prompt set looks better there than it is: on ``reference-qwen3`` at budget 0.5 the choice kept
        99.6% of the full model on the 300 prompts that picked it and 98.2% on 900 others. So the full
        model and each named plan run the confirmation set (``_examples(fresh=True)``); a plan stays
        chosen only if that set proves it; the cheapest meeting the floor is the cheapest of those that
        met it on the first set which the second set proves too (the full model at the latest); the
        verdicts shown are the second set's."""
        from ..eval.metrics import MEETS

        if not self._examples(fresh=True):
            self._note(f"the task file has fewer than --n {self.s.n} lines after the first {self.s.n}, so the "
                       "verdicts are on the prompts that picked the plans (optimistic: the best of several on one "
                       "set looks better there than it is); give twice as many lines, or a smaller --n, to confirm "
                       "them")
            return choice
        met_first = sorted((r for r in points if self.floor_verdict(r) == MEETS), key=lambda r: r["budget"])
        self.evaluate(self.full, fresh=True)
        full = self.full["fresh_tasks"]     # the reference: its own share is exactly 1
        self.full["fresh"] = {"prompts": full["prompts"], "accuracy": full["accuracy"], "of_full": 1.0,
                              "vs_full": {"gained": 0, "lost": 0, "p": 1.0}, "floor": self.full["floor"]}

        def proven(r: dict | None) -> dict | None:
            if r is not None and "fresh" not in r:
                self._with_full(self.evaluate(r, decode_model=r.get("distilled"), fresh=True), fresh=True)
            return r if r is not None and self.floor_verdict(r) == MEETS else None

        chosen = proven(choice.chosen)
        cheapest = next((r for r in met_first if proven(r) is not None), None)
        proven(choice.best_at_target)
        return Choice(chosen, cheapest, choice.best_at_target, choice.quality_name)

    def floor_verdict(self, r: dict) -> str:
        """"meets", "misses" or "not enough prompts to tell": the accuracy floor from the paired 95%
        interval of the point's share of the full model's accuracy (``eval.metrics.floor_verdict``; the
        full model is the reference and meets it by definition), the KL floor on the held-out value; a
        point not evaluated on the tasks is undecided."""
        from ..eval.metrics import MEETS, MISSES, UNDECIDED

        verdicts = []
        if self.s.min_quality is not None:
            floor = (r.get("fresh") or r).get("floor")     # confirmed on fresh prompts, where it was
            verdicts.append(floor["verdict"] if floor else UNDECIDED)
        if self.s.max_kl is not None:
            verdicts.append(MEETS if r["kl"] <= self.s.max_kl + 1e-12 else MISSES)
        return MISSES if MISSES in verdicts else UNDECIDED if UNDECIDED in verdicts else MEETS

    def _walk(self, front: list[dict]) -> list[dict]:
        """Evaluate the proxy-front points nearest the target until the floor is bracketed: the best at
        the target first; if it meets the floor, cheaper points until one fails; else dearer ones until
        one passes; a second candidate at the target where the proxy ranks closely."""
        from ..eval.metrics import MEETS

        done: list[dict] = []
        left = self.s.evaluate

        def run(r: dict) -> bool:
            nonlocal left
            left -= 1
            self._with_full(self.evaluate(r))
            done.append(r)
            return self.floor_verdict(r) == MEETS   # proven: an undecided point does not meet it

        cands = [r for r in front if not Candidate.from_json(r["candidate"]).is_full(self.E)]
        inside = [r for r in cands if self.at_target(r)]
        above = [r for r in cands if not self.at_target(r)]
        if inside and left > 0 and run(inside[-1]):
            for r in reversed(inside[:-1]):
                if left <= 0 or not run(r):
                    break
        else:
            for r in above:
                if left <= 0 or run(r):
                    break
        # second opinions at the target, where KL may rank techniques unlike accuracy does: the best
        # of each kind (masked / folded, uniform / per-layer sizes, top-k) first, then the next best by KL
        pool = sorted((r for r in self.scored.values() if self.at_target(r) and r not in done and not self._is_probe(r)
                       and self._allowed(Candidate.from_json(r["candidate"]))
                       and not Candidate.from_json(r["candidate"]).is_full(self.E)
                       and (not inside or r["budget"] >= inside[-1]["budget"] - self.step / self.E - 1e-9)),
                      key=lambda r: r["kl"])
        kind = lambda r: (r["candidate"]["pool_mode"], r["candidate"]["allocation"], r["candidate"]["top_k"],  # noqa
                          r["candidate"].get("merge"), bool(r["candidate"].get("protect_super")))
        seen = {kind(r) for r in done}
        firsts = [r for i, r in enumerate(pool) if kind(r) not in seen | {kind(q) for q in pool[:i]}]
        for r in (firsts + [r for r in pool if r not in firsts])[:max(0, left)]:
            run(r)
        return done

    # ---- stage 5: distillation -----------------------------------------------------------------------
    def distill(self, r: dict) -> dict:
        from ..training.distill import DistillConfig, distill_checkpoint

        c = Candidate.from_json(r["candidate"])
        out = self.out / "distilled" / f"{c.key}-{self.s.distill_steps}"
        if not (out / "config.json").is_file():
            plan_path = self.out / "plans" / f"{c.key}.json"
            self.plan(c).save(plan_path)
            from ..models.adapters import moe_layers
            cfg = DistillConfig(steps=self.s.distill_steps, lr=self.s.distill_lr, seed=self.s.seed,
                                se2=moe_layers(self.model)[0].shared_expert is not None)
            self.log(f"distilling the decoder of {c.key} for {self.s.distill_steps} steps on {self.calib_data}")
            distill_checkpoint(str(self.path), plan_path, self.calib_data, cfg, out, overwrite=True,
                               progress=self.progress, command=self.s.command)
        d = {**r, "key": f"{c.key}+distilled{self.s.distill_steps}",
             "label": f"{r['label']} distilled {self.s.distill_steps}", "distilled": str(out), "vllm": False,
             "scored_by": "engine"}
        d.pop("tasks", None)
        cache = self.out / "candidates" / f"{d['key']}.json"
        if cache.is_file():
            stored = json.loads(cache.read_text())
            if stored.get("identity") == self.identity and "tasks" in stored:
                d["tasks"] = stored["tasks"]
        d["kl"] = self._engine_scorer().score(None, self.plan(c).decode, self._load(out)).kl
        return self._with_full(self.evaluate(d, decode_model=str(out)))

    def _load(self, path: Path):
        from ..models import load_model
        return load_model(path, device=self.placement.device)

    # ---- the whole run ---------------------------------------------------------------------------
    def run(self) -> TuneResult:
        try:
            return self._run()
        finally:
            if hasattr(self, "backend"):
                self.backend.close()

    def _run(self) -> TuneResult:
        t0 = time.time()
        self._setup()
        self.calib_data = self._traces() if self.task_traffic else self.s.data
        if self.task_traffic and self.streamed:
            raise ValueError("prompt/answer traffic needs the engine to draw the full model's decode traces; pass "
                             "a text traffic file for a checkpoint that does not fit in memory")
        self.stats, self.stats_path = self._stats()
        self.stats.check_model(self.model)
        self.windows = heldout_traffic_windows(self.tokenizer, self.calib_data, self.s.calib_tokens, self.s.kl_tokens,
                                               self.s.kl_window)
        self.identity = self._identity()
        if not self.streamed:
            from ..plans.techniques import attach_fold_tables
            if self.backend.name == "engine":
                self.scorer = self.backend.scorer(self.windows)   # the distilled decoder's KL reads it too
            if self.stats.has_fold:
                attach_fold_tables(self.model, str(self.stats_path.resolve()))
        full = self.score(Candidate("reap", (self.E,) * len(self.layers)))
        full["label"] = "full model"
        self.search()
        front = self.proxy_front()
        quality = "accuracy" if self.s.min_quality is not None else "kl"
        if quality == "accuracy":
            self.full = self.evaluate(full)
            self.full["of_full"], self.full["vs_full"] = 1.0, {"gained": 0, "lost": 0, "p": 1.0}
            from ..eval.metrics import MEETS, FloorVerdict  # the reference itself: its own share is exactly 1
            self.full["floor"] = FloorVerdict(1.0, 1.0, 1.0, self.s.min_quality, MEETS, self.full["tasks"]["prompts"],
                                              0, 0, None).to_json()
            evaluated = self._walk(front)
            points = [self.full] + evaluated
            if self.s.distill_steps:
                # the student routes with the plan's masked pool (fold tables are not part of a checkpoint)
                at = [r for r in evaluated if self.at_target(r) and r["candidate"]["pool_mode"] == "mask"]
                base = max(at, key=lambda r: r["accuracy"]) if at else None
                if base is None:   # the evaluated points at the target replace experts: the best masked pool by KL
                    masked = [r for r in self.scored.values() if self.at_target(r) and not self._is_probe(r)
                              and r["candidate"]["pool_mode"] == "mask"
                              and not Candidate.from_json(r["candidate"]).is_full(self.E)]
                    base = min(masked, key=lambda r: r["kl"]) if masked else None
                if base is not None:
                    points.append(self.distill(base))
            qf = lambda r: r["accuracy"]  # noqa: E731
            shown = pareto(points, cost=lambda r: r["budget"], quality=qf)
        else:
            self.full = full
            points = [full] + [r for r in front if r is not full]
            qf = lambda r: -r["kl"]  # noqa: E731
            shown = list(front)
        for r in points:
            self.speed(r)
        if self.full not in shown:
            shown.append(self.full)      # the reference row, even where a cheaper plan ties it
        choice = choose(points, self.floor_verdict, self.at_target, qf, quality)
        if quality == "accuracy" and self.s.confirm and self.s.min_quality is not None:
            choice = self._confirm(choice, points)
        plan_path = None
        for name, r in (("plan.json", choice.chosen), ("cheapest-meeting-floor.json", choice.cheapest_meeting_floor),
                        ("best-at-target.json", choice.best_at_target)):
            target = self.out / name
            target.unlink(missing_ok=True)
            # a distilled point is served as a checkpoint: --decode-model DIR
            if r is None or r.get("distilled") or Candidate.from_json(r["candidate"]).is_full(self.E):
                continue
            c = Candidate.from_json(r["candidate"])
            plan = self.plan(c)
            plan.meta["tune_evidence"] = {k: v for k, v in r.items()
                                          if k not in ("identity", "tasks", "fresh_tasks", "candidate")}
            if c.checkpoint:
                plan.meta["merged_checkpoint"] = str(self.merged_dir(c))
            plan.save(target)
            if name == "plan.json":
                plan_path = target
        for r in points:
            c = Candidate.from_json(r["candidate"])
            if not c.is_full(self.E) and not r.get("distilled"):
                self.plan(c).save(self.out / "plans" / f"{c.key}.json")
        summary = {"seconds": round(time.time() - t0, 1), "candidates_scored": len(self.scored),
                   "best_criterion": getattr(self, "best_criterion", None),
                   "sensitivity": getattr(self, "sensitivity", None), "streamed": self.streamed,
                   "traffic": self.s.data, "calibration_data": self.calib_data,
                   "calibration": self.stats.meta.get("data_sha256"), "kl_tokens": len(self.windows) * self.s.kl_window,
                   "task_traffic": self.task_traffic, "tasks": [t.name for t in self.tasks],
                   "prompts": len(self._sets["tasks"][0]) if "tasks" in self._sets else 0,
                   "fresh_prompts": self.full.get("fresh", {}).get("prompts", 0),
                   "floor_confidence": 0.95 if quality == "accuracy" else None, "notes": list(self.notes)}
        result = TuneResult(points, shown, choice, quality, self.full, plan_path, summary)
        from .report import write_report
        write_report(self, result)
        return result
