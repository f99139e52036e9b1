"""The evaluation sweep: plans x configurations x sampling x seeds, generated through the engine.

A sweep calibrates once per model and makes one plan per criterion and keep ratio (both cached in
OUT: ``stats.safetensors``, ``plans/``), then evaluates each configuration of each plan. The unit of
work is a *cell* (one configuration, sampling mode and seed: every task's prompts in one batched
``llm.generate``; held-out KL/perplexity is one more cell), written to ``OUT/cells/`` as it completes,
so an interrupted sweep resumes; ``results.json``, ``results.md`` and plots come last.

A cell is reused only when its *identity* matches: the hashes of everything that decides its result
(weights, tokenizer, the plan's content, the prompts and answers or held-out windows), the
configuration, sampling, seed, tasks, n and token budgets. A cell in OUT with another identity is an
error naming the field that differs, unless ``overwrite=True`` (``--overwrite``). Cached statistics
are checked the same way against the model, the calibration data and the token count.
"""
from __future__ import annotations

import hashlib
import json
import math
import platform
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..data.tasks import TASKS, Task, eval_rng
from ..models.loading import load_checked, model_fingerprint, read_config, weights_hash
from ..outputs import MARKER, write_json
from ..plans import Plan
from ..plans.plan import plan_hash  # noqa: F401  (cells are keyed by it)
from ..runtime.runner import default_max_model_len
from ..tables import unknown_choice
from .configurations import ConfigSpec, Serving
from .metrics import (Generation, HeldoutScorer, accuracy, heldout_windows, length_stats, mean_std, score_output,
                      versus_full)
from .user_tasks import DEFAULT_BUDGET, check_prompts_fit, select_tasks, task_examples

SAMPLING_MODES = ("greedy", "sample")
ENGINE_ONLY_CONFIGURATIONS = ("guarded", "distilled")   # served by moetailor's engine only
DEFAULT_KEEPS = (0.75, 0.5, 0.25)
# Named sweeps: (criteria, keep ratios). "paper" is what docs/results.md reports.
SWEEPS = {
    "paper": (("frequency", "reap", "ean", "mass"), (0.5, 0.25)),
    "full": (None, DEFAULT_KEEPS),  # None = every criterion moetailor knows
}
BUDGET_FACTOR = 2.0     # max new tokens = 2x the longest reference completion at trained difficulties
BUDGET_SAMPLES = 64     # reference completions measured per difficulty to set the budget


DOMAINS_SHORTHAND = "domains"   # data=domains: the whole task suite, each task alone, the bundled text, mix


def sweep_data(spec: str) -> tuple[str, ...] | None:
    """The calibration-data axis of a sweep (``data=tasks|text|tasks:addition``, ``|``-separated since a
    spec may hold commas; ``data=domains`` = tasks, each task, text and mix), or None when absent."""
    parts = dict(p.split("=", 1) for p in spec.split(";") if "=" in p)
    if "data" not in parts:
        return None
    from ..calibration.data import parse_data_spec
    values = [v.strip() for v in parts["data"].split("|") if v.strip()]
    if values == [DOMAINS_SHORTHAND]:
        values = ["tasks", *[f"tasks:{t}" for t in TASKS], "text", "mix"]
    if not values:
        raise ValueError(f"sweep {spec!r}: data= lists no calibration data; e.g. data=tasks|text|mix or data=domains")
    for v in values:
        parse_data_spec(v)
    return tuple(dict.fromkeys(values))


def parse_sweep(spec: str) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """A named sweep ('paper', 'full') or 'criteria=frequency,reap;keep=0.5,0.25' -> (criteria, keeps).
    An optional ``data=...`` part (see ``sweep_data``) adds calibration domains as a third axis."""
    from ..plans.criteria import CRITERIA

    valid = tuple(CRITERIA)
    if spec in SWEEPS:
        criteria, keeps = SWEEPS[spec]
        criteria = criteria or valid
    else:
        parts = dict(p.split("=", 1) for p in spec.split(";") if "=" in p)
        if not parts or set(parts) - {"criteria", "keep", "data"} or len(parts) != len(spec.split(";")):
            raise ValueError(f"cannot read sweep {spec!r}; use a named sweep ({', '.join(SWEEPS)}) or "
                             "'criteria=frequency,reap;keep=0.5,0.25' (optionally ';data=tasks|text|mix')")
        sweep_data(spec)
        criteria = tuple(c.strip() for c in parts.get("criteria", ",".join(valid)).split(",") if c.strip())
        try:
            keeps = tuple(float(k) for k in parts.get("keep", ",".join(map(str, DEFAULT_KEEPS))).split(","))
        except ValueError:
            raise ValueError(f"keep ratios in {spec!r} must be numbers like 0.5") from None
    unknown = [c for c in criteria if c not in valid]
    if unknown:
        raise ValueError(unknown_choice("criterion", unknown[0], valid))
    bad = [k for k in keeps if not 0.0 < k < 1.0]
    if bad:
        raise ValueError(f"keep ratio {bad[0]} must be between 0 and 1 (a share of experts, e.g. 0.5)")
    return tuple(criteria), tuple(keeps)


@dataclass
class EvalSettings:
    model: str
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    n: int = 200
    seeds: int = 3
    first_seed: int = 0                # the prompt sets are seeds first_seed .. first_seed + seeds - 1
    floor: float | None = None         # share of the baseline's accuracy each configuration must keep
    sampling: list[str] = field(default_factory=lambda: ["greedy"])
    configs: list[ConfigSpec] = field(default_factory=list)
    plan: str | None = None
    sweep: str | None = None
    max_tokens: int | None = None      # None = per task, BUDGET_FACTOR x longest reference completion
    kl_docs: int = 2                   # held-out documents per text domain
    kl_window: int = 256               # tokens per held-out window (KL measured on its second half)
    calib_tokens: int = 32768
    calib_data: str | None = None      # calibration data spec (moetailor.calibration.data); None = the
                                       # bundled model's task domain (required for other models)
    max_num_seqs: int = 64
    device: str = "cpu"                # --device: where the model (and the engine) run
    temperature: float = 1.0
    top_p: float = 0.95
    backend: str = "engine"            # where the cells run (eval/backends.py): engine | vllm
    vllm_url: str | None = None        # --backend vllm: a running `moetailor serve --backend vllm`

    def validate(self) -> list[Task]:
        from .backends import check_backend
        check_backend(self.backend, self.vllm_url, self.model,
                      self.plan if any(c.definition.uses_plan for c in self.configs) else None)
        engine_only = [c.label for c in self.configs if c.name in ENGINE_ONLY_CONFIGURATIONS]
        if self.backend != "engine" and engine_only:
            raise ValueError(f"configurations {engine_only} run on moetailor's engine only (the collapse guard, a "
                             "distilled decoder); drop them or use --backend engine")
        tasks = select_tasks(self.tasks)
        if self.n <= 0:
            raise ValueError(f"--n must be a positive number of prompts per task, got {self.n}")
        if self.seeds <= 0:
            raise ValueError(f"--seeds must be at least 1, got {self.seeds}")
        if self.first_seed < 0:
            raise ValueError(f"--first-seed must be 0 or more, got {self.first_seed}")
        if self.floor is not None and not 0 < self.floor <= 1:
            raise ValueError(f"--floor is a share of the full model's accuracy, between 0 and 1 (e.g. 0.97), got "
                             f"{self.floor}")
        if self.floor is not None and "baseline" not in {c.name for c in self.configs}:
            raise ValueError("--floor compares each configuration with the full model on the same prompts: add "
                             "baseline to --configs")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ValueError(f"--max-tokens must be positive, got {self.max_tokens}")
        bad = [s for s in self.sampling if s not in SAMPLING_MODES]
        if bad or not self.sampling:
            raise ValueError(unknown_choice("sampling mode", bad[0] if bad else "", SAMPLING_MODES))
        if self.plan and self.sweep:
            raise ValueError("pass either --plan or --sweep, not both")
        if not self.configs:
            raise ValueError("no configurations to evaluate (--configs)")
        needing = [c.label for c in self.configs if c.definition.uses_plan]
        if not (self.plan or self.sweep) and needing:
            raise ValueError(f"configurations {needing} need a plan; pass --plan PLAN or --sweep SPEC "
                             "(or --configs baseline)")
        if self.sweep and parse_sweep(self.sweep) and sweep_data(self.sweep) is None:
            from ..calibration.data import default_data_spec, parse_data_spec
            parse_data_spec(default_data_spec(self.model, self.calib_data, "--calib-data"))
        if self.kl_window < 4:
            raise ValueError(f"--kl-window must be at least 4 tokens, got {self.kl_window}")
        return tasks


def task_budget(task: Task, tokenizer, factor: float = BUDGET_FACTOR) -> int:
    """Max new tokens for a task: ``factor`` x the longest reference completion (+ EOS) among
    held-out samples at each trained difficulty, so over-long generation shows up as budget hits.
    A user task has no reference completions: it gets ``user_tasks.DEFAULT_BUDGET``."""
    if not isinstance(task, Task):
        return DEFAULT_BUDGET
    rng = eval_rng(task.name, 10**6)  # a stream no evaluation seed uses
    longest = max((len(tokenizer(task.generate(rng, level).completion, add_special_tokens=False)["input_ids"]) + 1
                   for level in task.difficulties for _ in range(BUDGET_SAMPLES)), default=0)
    return int(math.ceil(factor * longest))


def _versions(backend: str = "engine") -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import torch
    import transformers
    try:
        mt = version("moetailor")
    except PackageNotFoundError:
        mt = "unknown"
    out = {"moetailor": mt, "torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version()}
    if backend == "vllm":
        import importlib.util
        if importlib.util.find_spec("vllm") is not None:
            import vllm
            out["vllm"] = vllm.__version__
    return out


CELL_IDENTITY_VERSION = 1


def content_digest(data) -> str:
    """16 hex digits of the sha256 of ``data`` as canonical JSON: what cached results are keyed by."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def tokenizer_hash(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return hashlib.sha256(backend.to_str().encode()).hexdigest()[:16]
    return content_digest(sorted(tokenizer.get_vocab().items()))


class CellMismatch(ValueError):
    pass


# identity fields in the order a mismatch names them, with the words used for each
IDENTITY_FIELDS = {"version": "cell format", "model": "model (weights hash)", "tokenizer": "tokenizer (hash)",
                   "plan": "plan (content hash)", "configuration": "configuration",
                   "serving": "serving (guard, decode model)", "sampling": "sampling",
                   "seed": "seed", "tasks": "tasks", "n": "n", "max_tokens": "max tokens", "backend": "backend",
                   "heldout": "held-out settings", "data": "prompts/data (hash)"}


def identity_difference(stored: dict | None, wanted: dict) -> str | None:
    """A phrase naming the first field where a cell's stored identity differs, or None."""
    if not isinstance(stored, dict):
        return "cell format (written by an older moetailor, without a cell identity)"
    for key, words in IDENTITY_FIELDS.items():
        if stored.get(key) != wanted.get(key):
            old, new = json.dumps(stored.get(key), default=str), json.dumps(wanted.get(key), default=str)
            return f"{words}: {old[:60]} there, {new[:60]} now"
    return None


@dataclass(frozen=True)
class Variant:
    """One configuration of one base plan: the thing a result row describes."""

    key: str                 # e.g. "reap-0.5/phase-aware" or "baseline"
    config: str              # configuration label
    criterion: str | None
    keep: float | None
    serving: Serving
    calibration: dict | None = None   # the base plan's calibration record (data, tokens, sha256)

    @property
    def plan(self) -> Plan:
        return self.serving.plan


@dataclass(frozen=True)
class PlanSource:
    """One base plan of an evaluation: ``label`` prefixes its variants (``reap-0.5``, or
    ``reap-0.5@tasks:addition`` when the sweep has a calibration-data axis)."""

    label: str | None
    criterion: str | None
    keep: float | None
    plan: Plan | None


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def _plan_sources(settings: EvalSettings, model, tokenizer, out: Path, log,
                  overwrite: bool = False) -> list[PlanSource]:
    """The base plans: the given plan, the sweep's plans (per calibration domain), or none."""
    if settings.plan:
        plan = load_checked(settings.plan, Plan, model)
        criterion = plan.meta.get("criterion", Path(settings.plan).stem)
        keep = plan.meta.get("keep_ratio")
        return [PlanSource(f"{criterion}-{keep:g}" if keep is not None else str(criterion), criterion, keep, plan)]
    if not settings.sweep:
        return [PlanSource(None, None, None, None)]
    from ..calibration import calibrate
    from ..calibration.data import default_data_spec
    from ..plans.criteria import make_plan
    criteria, keeps = parse_sweep(settings.sweep)
    datas = sweep_data(settings.sweep)
    axis = datas is not None
    sources = []
    for data in datas or (default_data_spec(settings.model, settings.calib_data, "--calib-data"),):
        stats_path = out / (f"stats-{_slug(data)}.safetensors" if axis else "stats.safetensors")
        stats = calibrated_stats(model, stats_path, data, settings.calib_tokens, log,
                                 lambda: calibrate(model, tokenizer, data, settings.calib_tokens, progress=False),
                                 overwrite=overwrite)
        for criterion in criteria:
            for keep in keeps:
                path = out / "plans" / (_slug(data) if axis else "") / f"{criterion}-{keep:g}.json"
                plan = make_plan(stats, model, criterion, keep=keep, stats_path=str(stats_path))  # cheap: from stats
                cached = Plan.load(path) if path.exists() else None
                if cached is not None and plan_hash(cached) == plan_hash(plan):
                    plan = cached                      # unchanged: keep the file (and its creation time)
                else:
                    plan.save(path)
                plan.check_model(model)
                sources.append(PlanSource(f"{criterion}-{keep:g}" + (f"@{data}" if axis else ""), criterion, keep,
                                          plan))
    return sources


def calibrated_stats(model, path: Path, data: str, tokens: int, log, compute, overwrite: bool = False,
                     fold: bool = False):
    """Calibration statistics for this model: loaded from ``path`` when an earlier run cached them
    (for this model, data and token count; with fold tables where ``fold``), else ``compute()`` once
    and cached there. Cached statistics made otherwise are an error, or recomputed with ``overwrite``."""
    from ..calibration import ExpertStats, StatsMismatch
    from ..calibration.data import parse_data_spec

    if path.exists():
        stats = ExpertStats.load(path)
        try:
            stats.check_model(model)
            problem = None
        except StatsMismatch as e:
            problem = str(e).split(";")[0]
        made = (stats.meta.get("data"), stats.meta.get("tokens"))
        if problem is None and made != (parse_data_spec(data).name, tokens):
            problem = f"calibrated on {made[1]} tokens of {made[0]!r}, this run asks for {tokens} of {data!r}"
        if problem is None and fold and not stats.has_fold:
            problem = "calibrated without fold tables"
        if problem is None:
            log(f"reusing {path} ({made[1]:,} tokens of {made[0]})")
            return stats
        if not overwrite:
            raise CellMismatch(f"{path} holds statistics this run cannot use ({problem}); pass --overwrite to "
                               "recalibrate, or choose a fresh --out")
        log(f"cached statistics do not fit ({problem}); recalibrating")
    log(f"calibrating on {tokens:,} tokens of {data!r} (once per model) ...")
    t0 = time.time()
    stats = compute()
    stats.save(path)
    log(f"calibrated in {time.time() - t0:.1f} s -> {path}")
    return stats


def variants(settings: EvalSettings, sources: list[PlanSource], model) -> list[Variant]:
    """One variant per base plan of each configuration that uses it, one of each other configuration."""
    out = {}
    for src in sources:
        calibration = src.plan.meta.get("calibration") if src.plan is not None else None
        for spec in settings.configs:
            if not spec.definition.uses_plan:
                if spec.label not in out:
                    out[spec.label] = Variant(spec.label, spec.label, None, None, spec.build(model, src.plan))
                continue
            key = f"{src.label}/{spec.label}"
            out[key] = Variant(key, spec.label, src.criterion, src.keep, spec.build(model, src.plan), calibration)
    return list(out.values())


def _guard_summary(snapshots: list[dict | None]) -> dict | None:
    """Decode steps by pool, trips and rescues of the guarded configurations, summed over seeds.
    ``fallback_share``: decode steps of evaluated requests sent back to the full pool;
    ``shadow_share``: extra full-pool decode steps spent on shadows (relative to the same total)."""
    policies = [p for s in snapshots if s for p in s["policies"].values()]
    if not policies:
        return None
    steps = {k: sum(p["decode_steps"][k] for p in policies) for k in ("reduced", "fallback", "shadow")}
    served = steps["reduced"] + steps["fallback"]
    rescued: dict[str, int] = {}
    for p in policies:
        for k, n in p["rescued"].items():
            rescued[k] = rescued.get(k, 0) + n
    return {"decode_steps": steps, "fallback_share": steps["fallback"] / served if served else 0.0,
            "shadow_share": steps["shadow"] / served if served else 0.0, "trips": sum(p["trips"] for p in policies),
            "rescued": rescued, "reasons": [p["reason"] for p in policies if p["reason"]]}


def _cell_file(out: Path, key: str) -> Path:
    return out / "cells" / (key.replace("/", "__").replace(":", "_").replace("|", "_") + ".json")


class Sweep:
    """Runs the cells of one evaluation; ``run()`` returns the results dict written to results.json."""

    def __init__(self, settings: EvalSettings, out: str | Path, *, model=None, tokenizer=None,
                 command: str | None = None, log=print, overwrite: bool = False):
        self.tasks = settings.validate()
        self.settings, self.out, self.log, self.overwrite = settings, Path(out), log, overwrite
        self.command = command or " ".join(["moetailor", *sys.argv[1:]])
        if model is None:
            from ..models import load_tokenizer
            tokenizer = load_tokenizer(settings.model)
        if tokenizer is None:
            raise ValueError("a tokenizer is needed to evaluate; pass the model as a checkpoint directory with one")
        self.budgets = {t.name: settings.max_tokens or task_budget(t, tokenizer) for t in self.tasks}
        config = model.config if model is not None else read_config(settings.model)
        check_prompts_fit(self.tasks, tokenizer, self.budgets, default_max_model_len(config), settings.n,
                          settings.max_tokens is not None)
        if model is None:
            from ..models import load_model
            model = load_model(settings.model, device=settings.device)
        self.model, self.tokenizer = model, tokenizer
        for t in self.tasks:
            if not isinstance(t, Task) and len(t.items) > settings.n:
                log(f"task {t.name} ({t.path}): evaluating the first {settings.n} of {len(t.items)} prompts (--n)")
        self.fingerprint = model_fingerprint(model)
        # what every cell shares; each cell adds its plan, configuration, sampling, seed and data
        # a user task is named with its file's hash: an edited file is evaluated afresh
        tasks = [t.name if isinstance(t, Task) else f"{t.name}@{t.digest}" for t in self.tasks]
        self.identity = {"version": CELL_IDENTITY_VERSION, "model": weights_hash(model),
                         "tokenizer": tokenizer_hash(tokenizer), "tasks": tasks,
                         "n": settings.n, "max_tokens": self.budgets}
        if settings.backend != "engine":   # the engine's cells keep their identity (no backend field)
            self.identity["backend"] = settings.backend
        from .backends import make_backend
        self.backend = make_backend(settings.backend, model, tokenizer, settings.model,
                                    url=settings.vllm_url, max_num_seqs=settings.max_num_seqs)
        self._windows = None

    # -- engine and held-out windows, built on first use ---------------------------------------
    @property
    def llm(self):
        """The embedded engine (the guard's cells drive it step by step)."""
        return self.backend.llm

    @property
    def windows(self) -> list[list[int]]:
        if self._windows is None:
            from ..data.corpus import bundled_documents
            self._windows = heldout_windows(self.tokenizer, bundled_documents("heldout"), self.settings.kl_docs,
                                            self.settings.kl_window)
        return self._windows

    @property
    def scorer(self) -> HeldoutScorer:
        return self.backend.scorer(self.windows)

    # -- cells -----------------------------------------------------------------------------------
    def cell_identity(self, variant: Variant, mode: str, seed: int | None) -> dict:
        """Everything that decides one cell's result (see the module docstring)."""
        ident = {**self.identity, "plan": plan_hash(variant.plan), "configuration": variant.config,
                 "serving": {"guard": variant.serving.guard, "decode_model": variant.serving.decode_model}}
        if mode == "heldout":
            return {**ident, "heldout": [self.settings.kl_docs, self.settings.kl_window],
                    "data": content_digest(self.windows)}
        sampling = "greedy" if mode == "greedy" else {"temperature": self.settings.temperature,
                                                      "top_p": self.settings.top_p}
        examples = [(ex.task, ex.prompt, ex.completion) for task in self.tasks
                    for ex in task_examples(task, self.settings.n, seed, self.tokenizer)]
        return {**ident, "sampling": sampling, "seed": seed, "data": content_digest(examples)}

    def _load_cell(self, key: str, identity: dict):
        """The stored cell when it has this identity; None when there is none (or it is unreadable:
        a cell is written atomically, so only a foreign file can be); CellMismatch otherwise."""
        path = _cell_file(self.out, key)
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError:
            return None
        problem = identity_difference(data.get("identity") if isinstance(data, dict) else None, identity)
        if problem is None:
            return data
        if self.overwrite:
            return None
        raise CellMismatch(f"{path} was computed for another {problem}; it is not this run's result: pass "
                           "--overwrite to recompute such cells, or choose a fresh --out")

    def _sampling_params(self, mode: str, seed: int, task: str, index: int):
        from ..serving import SamplingParams
        if mode == "greedy":
            return SamplingParams(max_tokens=self.budgets[task], temperature=0.0)
        return SamplingParams(max_tokens=self.budgets[task], temperature=self.settings.temperature,
                              top_p=self.settings.top_p, seed=seed * 1_000_003 + index)

    def generation_cell(self, variant: Variant, mode: str, seed: int) -> dict:
        """Every task's n prompts for one seed in one batched generate call."""
        examples = [ex for task in self.tasks for ex in task_examples(task, self.settings.n, seed, self.tokenizer)]
        params = [self._sampling_params(mode, seed, ex.task, i) for i, ex in enumerate(examples)]
        prompts = [ex.prompt for ex in examples]
        t0 = time.time()
        if variant.serving.decode_model:
            outputs, extra = self._generate_disaggregated(variant, prompts, params), {}
        else:
            outputs, extra = self._generate(variant, prompts, params)
        seconds = time.time() - t0
        gens = [score_output(ex, o, p.max_tokens) for ex, o, p in zip(examples, outputs, params)]
        return {"generations": [g.to_json() for g in gens], "seconds": seconds,
                "tokens": sum(g.length for g in gens), "prompts": len(examples), **extra}

    def _generate(self, variant: Variant, prompts: list[str], params) -> tuple[list, dict]:
        if not variant.serving.guard:   # the guarded:CONFIG configurations run on the engine only
            return self.backend.generate(variant.plan, prompts, params), {}
        self.llm.enable_guard()
        self.llm.set_plan(variant.plan)
        outputs = self.llm.generate(prompts, params)
        while self.llm.has_unfinished():   # the last shadows: their cost belongs to this cell
            self.llm.step()
        snapshot = self.llm.guard.snapshot()
        self.llm.guard = None
        return outputs, {"guard": snapshot}

    def _generate_disaggregated(self, variant: Variant, prompts: list[str], params) -> list:
        """Prefill on the evaluated model, decode on the variant's own decoder (a distilled one) in
        the disaggregated engine: the decoder continues the KV cache the original model wrote."""
        from ..serving.disagg import DisaggregatedLLM

        with DisaggregatedLLM(self.settings.model, decode_model=variant.serving.decode_model,
                              tokenizer=self.tokenizer,                 # the decoder brings its own plan
                              max_num_seqs=self.settings.max_num_seqs) as llm:
            return llm.generate(prompts, params)

    def heldout_cell(self, variant: Variant) -> dict:
        t0 = time.time()
        path = variant.serving.decode_model
        if path:   # a distilled decoder continues the original model's cache (engine backend only)
            from ..models import load_model
            from ..plans.techniques import attach_plan_fold_tables
            attach_plan_fold_tables(self.model, variant.plan)
            s = self.scorer.score(variant.plan.prefill, variant.plan.decode, load_model(path))
        else:
            s = self.backend.heldout(variant.plan, self.windows)
        return {**s.to_json(), "seconds": time.time() - t0}

    def run(self) -> dict:
        try:
            return self._run()
        finally:
            self.backend.close()

    def _run(self) -> dict:
        from tqdm import tqdm

        t_start = time.time()
        fresh = not self.out.exists()
        self.out.mkdir(parents=True, exist_ok=True)
        try:
            sources = _plan_sources(self.settings, self.model, self.tokenizer, self.out, self.log, self.overwrite)
            self.variants = variants(self.settings, sources, self.model)
        except BaseException:   # e.g. a distilled:DIR that is not there: leave no empty run folder behind
            if fresh and not any(p.name != MARKER for p in self.out.iterdir()):
                shutil.rmtree(self.out)
            raise
        seeds = list(range(self.settings.first_seed, self.settings.first_seed + self.settings.seeds))
        jobs = [(v, "heldout", None) for v in self.variants]
        jobs += [(v, mode, seed) for v in self.variants for mode in self.settings.sampling for seed in seeds]
        cells: dict[str, dict] = {}
        todo = []
        for v, mode, seed in jobs:   # every cell is checked before any is computed
            key = f"{v.key}/{mode}" + ("" if seed is None else f"/seed{seed}")
            identity = self.cell_identity(v, mode, seed)
            cached = self._load_cell(key, identity)
            if cached is not None:
                cells[key] = cached
            else:
                todo.append((key, v, mode, seed, identity))
        if cells:
            self.log(f"resuming: {len(cells)} of {len(jobs)} cells already done in {self.out / 'cells'}")
        compute_s = 0.0
        with tqdm(total=len(jobs), initial=len(cells), desc="eval sweep", unit="cell", mininterval=2) as bar:
            for key, v, mode, seed, identity in todo:
                bar.set_postfix_str(key, refresh=False)
                t0 = time.time()
                data = self.heldout_cell(v) if mode == "heldout" else self.generation_cell(v, mode, seed)
                compute_s += time.time() - t0
                data["identity"] = identity
                write_json(_cell_file(self.out, key), data)
                cells[key] = data
                bar.update(1)
        results = self.aggregate(cells, sources, seeds)
        results["timing"] = {"this_run_s": time.time() - t_start, "computed_cells": len(todo),
                             "cached_cells": len(jobs) - len(todo), "cell_compute_s": compute_s,
                             "generation_s_all_cells": sum(c.get("seconds", 0) for k, c in cells.items()
                                                           if "/heldout" not in k),
                             "generated_tokens_all_cells": sum(c.get("tokens", 0) for c in cells.values())}
        write_json(self.out / "results.json", results)
        from .report import write_report
        write_report(results, self.out)
        return results

    # -- aggregation -------------------------------------------------------------------------------
    def _versus_full(self, mine: list[list[Generation]], full: list[list[Generation]], prompts: list,
                     task: str) -> dict:
        """This configuration against the baseline on the same prompts (``metrics.versus_full``)."""
        pairs = [(p, a.correct, b.correct) for p, a, b in zip(prompts, (g for gens in mine for g in gens),
                                                              (g for gens in full for g in gens), strict=True)
                 if task in ("all", a.task)]
        return versus_full([a for _, a, _ in pairs], [b for _, _, b in pairs], [p for p, _, _ in pairs],
                           self.settings.floor)

    def aggregate(self, cells: dict[str, dict], sources, seeds: list[int]) -> dict:
        import numpy as np

        from .report import HIST_BINS

        rows, histograms = [], {}
        task_names = [t.name for t in self.tasks]
        generations = {(v.key, mode): [
            [Generation.from_json(r) for r in cells[f"{v.key}/{mode}/seed{s}"]["generations"]] for s in seeds]
            for v in self.variants for mode in self.settings.sampling}
        full = next((v.key for v in self.variants if v.config == "baseline"), None)
        # each result's prompt: a greedy prompt that comes again in another seed counts once; a sampled one per seed
        prompts = {mode: [(task.name, str(ex.prompt), None if mode == "greedy" else seed) for seed in seeds
                          for task in self.tasks for ex in task_examples(task, self.settings.n, seed, self.tokenizer)]
                   for mode in self.settings.sampling} if full else {}
        for v in self.variants:
            held = cells[f"{v.key}/heldout"]
            for mode in self.settings.sampling:
                per_seed = generations[(v.key, mode)]
                shares = [min(g.length / g.max_tokens, 1.0) for gens in per_seed for g in gens]
                histograms.setdefault(v.key, {})[mode] = np.histogram(shares, HIST_BINS, (0.0, 1.0))[0].tolist()
                guard = _guard_summary([cells[f"{v.key}/{mode}/seed{s}"].get("guard") for s in seeds])
                for task in [*task_names, "all"]:
                    chosen = [[g for g in gens if task in ("all", g.task)] for gens in per_seed]
                    acc_mean, acc_std = mean_std([accuracy(g) for g in chosen])
                    lengths = length_stats([g for gens in chosen for g in gens])
                    rows.append({"variant": v.key, "configuration": v.config, "criterion": v.criterion,
                                 "calibration": v.calibration,
                                 "keep": v.keep, "sampling": mode, "task": task,
                                 "accuracy": acc_mean, "accuracy_std": acc_std,
                                 "accuracy_per_seed": [accuracy(g) for g in chosen], **lengths.to_json(),
                                 "max_tokens": self.budgets.get(task), "kl": held["kl"],
                                 "perplexity": held["perplexity"], "guard": guard if task == "all" else None,
                                 "vs_full": None if full in (None, v.key) else
                                 self._versus_full(per_seed, generations[(full, mode)], prompts[mode], task)})
        return {
            "format": "moetailor-eval", "version": 1,
            "command": self.command,
            "model": {"name": self.settings.model, **self.fingerprint},
            "settings": {"tasks": task_names, "n": self.settings.n, "seeds": seeds, "floor": self.settings.floor,
                         "sampling": self.settings.sampling,
                         "temperature": self.settings.temperature, "top_p": self.settings.top_p,
                         "configurations": [c.label for c in self.settings.configs], "plan": self.settings.plan,
                         "sweep": self.settings.sweep, "max_tokens": self.budgets,
                         "budget_rule": None if self.settings.max_tokens else
                         f"{BUDGET_FACTOR:g}x the longest reference completion (+EOS) at the trained difficulties",
                         "heldout": {"docs_per_domain": self.settings.kl_docs, "window": self.settings.kl_window,
                                     "tokens_scored": cells[f"{self.variants[0].key}/heldout"]["tokens"]},
                         "calibration": [src.plan.meta.get("calibration") for src in sources
                                         if src.plan is not None and src.plan.meta.get("calibration")] or None
                         if self.settings.sweep else None},
            "plans": {src.label: src.plan.to_json() for src in sources if src.plan is not None},
            "versions": _versions(self.settings.backend),
            "backend": self.settings.backend if not self.settings.vllm_url else f"vllm at {self.settings.vllm_url}",
            "rows": rows,
            "histograms": histograms,
        }
