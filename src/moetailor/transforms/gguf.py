"""A GGUF file for llama.cpp, written by llama.cpp's own converter (``make setup-llamacpp`` unpacks it).

moetailor adds only what its checkpoints need beyond a hub one, through a subclass of the converter's
model class (docs/llamacpp.md has the table): the output head of tied embeddings, the "refact"
pre-tokenizer of the bundled tokenizer, DeepSeek-V3's sigmoid scores, no BOS, a plan's
``expert_used_count`` and ``moetailor.*`` provenance. What llama.cpp cannot express (per-layer expert
counts or top-k, folding, skipping, pools, a top-k renormalisation its graph hard-codes otherwise)
is refused rather than converted into a different model.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..models.architectures import arch_spec
from ..outputs import atomic_path, check_output
from ..tables import unknown_choice

LLAMACPP_VERSION = "0.3.36"            # the llama-cpp-python sdist `make setup-llamacpp` builds and unpacks
OUTTYPES = ("f32", "bf16", "q8_0")
CONVERTER_ENV = "MOETAILOR_LLAMACPP_CONVERTER"
SETUP = "`make setup-llamacpp` (llama.cpp's converter and llama-cpp-python in .venv-llamacpp)"


@dataclass(frozen=True)
class LlamaCppArch:
    """How llama.cpp runs one of moetailor's architectures."""
    name: str                 # general.architecture: the prefix of its metadata keys
    renormalises: bool | None  # what its graph does with the top-k weights; None = read from the file


LLAMACPP_ARCHS: dict[str, LlamaCppArch] = {
    # src/models/<name>.cpp in llama.cpp 0.3.36: the norm_w argument of build_moe_ffn
    "qwen2_moe": LlamaCppArch("qwen2moe", False),
    "qwen3_moe": LlamaCppArch("qwen3moe", True),
    "olmoe": LlamaCppArch("olmoe", False),
    "mixtral": LlamaCppArch("llama", True),
    "deepseek_v3": LlamaCppArch("deepseek2", None),   # expert_weights_norm from norm_topk_prob
}


def llamacpp_arch(config) -> LlamaCppArch:
    spec = arch_spec(config)
    if spec.model_type not in LLAMACPP_ARCHS:
        raise ValueError(f"llama.cpp's converter has no {spec.model_type!r} MoE model; moetailor exports "
                         f"{', '.join(LLAMACPP_ARCHS)} to GGUF")
    return LLAMACPP_ARCHS[spec.model_type]


def override_kv(arch: str, top_k: int) -> str:
    """llama.cpp's flag that routes ``top_k`` experts per token (llama-cli / llama-server; in
    llama-cpp-python: ``Llama(..., kv_overrides={f"{arch}.expert_used_count": top_k})``)."""
    return f"--override-kv {arch}.expert_used_count=int:{top_k}"


def routing_difference(config) -> str | None:
    """Why llama.cpp would compute another function from this checkpoint's weights, or None."""
    target = llamacpp_arch(config)
    if target.renormalises is None:
        return None
    spec = arch_spec(config)
    ours = spec.normalises_top_k(config)
    if ours == target.renormalises:
        return None
    does = "always renormalises" if target.renormalises else "never renormalises"
    return (f"llama.cpp's {target.name} graph {does} the top-k expert weights, but this checkpoint has "
            f"{spec.norm_key}={str(ours).lower()}, so the GGUF would compute a different model from the same weights")


def loader_problem(config) -> str | None:
    """A shape llama.cpp's loader for this architecture rejects (checked here, before converting), or None."""
    model_type = arch_spec(config).model_type
    if model_type == "olmoe" and config.num_key_value_heads != config.num_attention_heads:
        return (f"llama.cpp's olmoe loader sizes attn_k_norm for as many KV heads as query heads (as OLMoE-1B-7B has), "
                f"but this checkpoint has {config.num_key_value_heads} KV heads for {config.num_attention_heads} "
                "query heads; llama.cpp cannot load it")
    if model_type == "deepseek_v3" and getattr(config, "q_lora_rank", None) is None \
            and config.num_hidden_layers not in (26, 27):
        return (f"llama.cpp's deepseek2 loader takes a model without a query LoRA (q_lora_rank=null) only at 26 or 27 "
                f"layers (it recognises DeepSeek-V2-Lite by its depth), and this checkpoint has "
                f"{config.num_hidden_layers}; llama.cpp cannot load it")
    return None


def pre_tokenizer_name(tokenizer_json: dict) -> str | None:
    """llama.cpp's pre-tokenizer that splits text as this tokenizer.json does (byte-level BPE only), or None.
    llama.cpp applies a pre-tokenizer's regexes one after another, as a tokenizers ``Sequence`` does."""
    model = tokenizer_json.get("model") or {}
    pre = tokenizer_json.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or tokenizer_json.get("normalizer") is not None:
        return None
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    byte_level = steps[-1] if steps else {}
    if kinds[-1:] != ["ByteLevel"] or not byte_level.get("use_regex", True) or byte_level.get("add_prefix_space"):
        return None
    if kinds == ["ByteLevel"]:
        return "gpt-2"        # 's|'t|... ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "refact"       # \p{N}, then the GPT-2 regex
    return None


def converter_dir() -> Path:
    """Where llama.cpp's convert_hf_to_gguf.py and its conversion/ package are, or a clear error."""
    if os.environ.get(CONVERTER_ENV):          # when set, the only place looked at
        candidates = [Path(os.environ[CONVERTER_ENV])]
    else:
        checkout = Path(__file__).resolve().parents[3]       # a source checkout: its .venv-llamacpp
        candidates = [Path(sys.prefix) / "share" / "llama.cpp", checkout / ".venv-llamacpp" / "share" / "llama.cpp"]
    for path in candidates:
        if (path / "convert_hf_to_gguf.py").is_file() and (path / "conversion" / "__init__.py").is_file():
            return path
    raise FileNotFoundError(f"llama.cpp's converter (convert_hf_to_gguf.py and conversion/, from the llama-cpp-python "
                            f"{LLAMACPP_VERSION} sdist) is not installed; looked in "
                            f"{', '.join(str(c) for c in candidates)}: run {SETUP}, or set {CONVERTER_ENV}=DIR")


def import_converter():
    """The converter's ``conversion`` package, with the ``gguf`` package it was written against
    (the same path setup convert_hf_to_gguf.py does)."""
    where = converter_dir()
    for path in (where / "gguf-py", where):
        if (path.is_dir()) and str(path) not in sys.path:
            sys.path.insert(0, str(path))
    try:
        import conversion
        import gguf  # noqa: F401
    except ImportError as e:
        raise FileNotFoundError(f"llama.cpp's converter in {where} cannot be imported ({e}); run {SETUP}") from None
    return conversion


def _converter_class(base, *, untie: bool, pre_tokenizer: str | None, top_k: int | None, sigmoid: bool, extra: dict):
    """A subclass of the converter's class for this architecture, doing what moetailor's checkpoints need."""
    import gguf

    class MoetailorModel(base):
        model_arch = base.model_arch

        def modify_tensors(self, data_torch, name, bid):
            yield from super().modify_tensors(data_torch, name, bid)
            if untie and name == "model.embed_tokens.weight":
                yield from super().modify_tensors(data_torch, "lm_head.weight", bid)

        def get_vocab_base_pre(self, tokenizer):
            return pre_tokenizer if pre_tokenizer is not None else super().get_vocab_base_pre(tokenizer)

        def set_gguf_parameters(self):
            super().set_gguf_parameters()
            w = self.gguf_writer
            if top_k is not None:
                w.remove_key(gguf.Keys.LLM.EXPERT_USED_COUNT.format(arch=w.arch))
                w.add_expert_used_count(top_k)
            gating = gguf.Keys.LLM.EXPERT_GATING_FUNC.format(arch=w.arch)
            if sigmoid and not any(gating in kv for kv in w.kv_data):
                # the converter reads a hub config's scoring_func, which transformers does not save: without
                # it llama.cpp's deepseek2 falls back to softmax scores
                w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
            for key, value in extra.items():
                if isinstance(value, list):
                    w.add_array(f"moetailor.{key}", value)
                elif isinstance(value, int):
                    w.add_uint32(f"moetailor.{key}", value)
                else:
                    w.add_string(f"moetailor.{key}", str(value))

        def set_vocab(self):
            super().set_vocab()
            w = self.gguf_writer
            if not any(gguf.Keys.Tokenizer.ADD_BOS in kv for kv in w.kv_data):
                w.add_add_bos_token(False)

    MoetailorModel.__name__ = f"Moetailor{base.__name__}"
    return MoetailorModel


def _pre_tokenizer_for(source: Path, base) -> str | None:
    """None when llama.cpp's own table knows the tokenizer (hub models); else moetailor's reading of
    tokenizer.json, or a clear error."""
    path = source / "tokenizer.json"
    if not path.is_file():
        return None             # a sentencepiece model: the converter handles it without a hash
    tok = json.loads(path.read_text())
    from transformers import AutoTokenizer

    probe = base.__new__(base)    # get_vocab_base_pre reads only the tokenizer: no need to index the weights
    try:
        with _converter_log(logging.CRITICAL):     # the converter prints a banner before it raises
            probe.get_vocab_base_pre(AutoTokenizer.from_pretrained(source))
        return None
    except NotImplementedError:
        pass
    name = pre_tokenizer_name(tok)
    if name is None:
        raise ValueError(f"{path}: llama.cpp's converter does not recognise this tokenizer's pre-tokenizer "
                         f"({json.dumps(tok.get('pre_tokenizer'))[:160]}) and moetailor knows no llama.cpp "
                         "equivalent of it (it maps plain byte-level BPE to 'gpt-2' and digits + byte-level to 'refact')")
    return name


def _default_rope(record: logging.LogRecord) -> bool:
    """transformers 5 writes ``rope_type: "default"`` (no scaling), which the converter does not name but
    handles as no scaling: its warning would only alarm."""
    return record.getMessage() != "Unknown RoPE type: default"


@contextmanager
def _converter_log(level: int | None):
    """The converter's logger at ``level`` (None: as it is) and without the RoPE warning, for a while."""
    logger = logging.getLogger("hf-to-gguf")
    old = logger.level
    if level is not None:
        logger.setLevel(level)
    logger.addFilter(_default_rope)
    try:
        yield
    finally:
        logger.setLevel(old)
        logger.removeFilter(_default_rope)


@dataclass
class GGUFExport:
    """What ``export_gguf`` wrote: the file and what a llama.cpp user needs to know about it."""
    path: Path
    arch: str                   # llama.cpp architecture name (metadata key prefix)
    num_experts: int
    top_k: int                  # experts routed per token as written in the file
    model_top_k: int            # the checkpoint's own k
    outtype: str
    pre_tokenizer: str | None   # the name moetailor wrote, None = the converter's own choice
    untied: bool
    routing_note: str | None    # a difference llama.cpp's graph makes that the caller accepted
    bytes: int

    def override(self, top_k: int) -> str:
        return override_kv(self.arch, top_k)


def export_gguf(source: str | Path, out: str | Path, outtype: str = "f32", *, top_k: int | None = None,
                overwrite: bool = False, allow_routing_difference: bool = False, extra: dict | None = None,
                verbose: bool = False) -> GGUFExport:
    """Convert the checkpoint directory ``source`` into the GGUF file ``out`` (atomically) with llama.cpp's
    converter. ``top_k``: the file's ``<arch>.expert_used_count`` (None = the model's k).
    ``allow_routing_difference``: convert even where ``routing_difference`` finds one (else an error)."""
    from transformers import AutoConfig

    from ..models.paths import resolve_model_path

    if outtype not in OUTTYPES:
        raise ValueError(unknown_choice("--outtype", outtype, OUTTYPES))
    source = resolve_model_path(source)
    out = check_output(out, overwrite=overwrite, inputs=(source,))
    config = AutoConfig.from_pretrained(source, local_files_only=True)
    target = llamacpp_arch(config)
    spec = arch_spec(config)
    model_k = int(config.num_experts_per_tok)
    if top_k is not None and not 1 <= top_k <= model_k:
        raise ValueError(f"expert top-k {top_k} must be in [1, {model_k}] (the model's k)")
    problem = loader_problem(config)
    if problem:
        raise ValueError(problem)
    note = routing_difference(config)
    if note and not allow_routing_difference:
        raise ValueError(f"{note}. Pass --allow-routing-difference to export it anyway (e.g. to compare speed on the "
                         "same weights), or export a checkpoint whose routing llama.cpp computes (of the bundled "
                         "models, `reference-qwen3` does: `moetailor export gguf reference-qwen3 --out model.gguf`)")
    conversion = import_converter()
    import gguf
    import torch

    hparams = conversion.ModelBase.load_hparams(source, False)
    base = conversion.get_model_class(conversion.get_model_architecture(hparams, conversion.ModelType.TEXT))
    untie = bool(getattr(config, "tie_word_embeddings", False))
    pre = _pre_tokenizer_for(source, base)
    cls = _converter_class(base, untie=untie, pre_tokenizer=pre, top_k=top_k, sigmoid=spec.scoring == "sigmoid-grouped",
                           extra={"source": str(source), **pruned_metadata(source), **(extra or {})})
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
             "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]
    with _converter_log(None if verbose else logging.WARNING), atomic_path(out) as tmp, torch.inference_mode():
        cls(source, ftype, tmp, model_name=source.name).write()
    return GGUFExport(Path(out), target.name, spec.num_experts(config), top_k or model_k, model_k, outtype, pre, untie,
                      note, Path(out).stat().st_size)


@dataclass(frozen=True)
class GGUFPlan:
    """The part of a plan's phase one GGUF can hold: kept experts (by pruning) and one top-k."""
    keep: dict[int, tuple[int, ...]] | None     # kept ids per MoE layer; None = all experts
    top_k: int | None                           # experts per token; None = the model's k


MERGED = ("merged experts (new weights: write the merged checkpoint with `moetailor prune MODEL PLAN --out DIR` and "
          "export DIR)")
UNSUPPORTED = {
    "pool_mode": "routes outside the pool dropped or folded (llama.cpp only has the masked router a pruned "
                 "checkpoint computes)",
    "skip_beta": "dynamic skipping (llama.cpp routes a fixed number of experts per token)",
    "token_keep": "token-level folding (llama.cpp has no folding)",
    "batch_pool": "a per-step batch pool (llama.cpp has no per-step expert pool)",
    "fold": "folding (llama.cpp has no folding)",
    "merge": MERGED,
    "merge_router": MERGED,
}


def gguf_plan(plan, phase: str = "decode") -> GGUFPlan:
    """What of ``plan``'s ``phase`` a GGUF can hold, or a one-line error saying why not and what to do."""
    policy = plan.phase(phase)
    layers = plan.model["moe_layers"]
    per_layer = {i: policy.for_layer(i) for i in layers}
    for i, p in per_layer.items():
        odd = sorted(k for k in p.to_json() if k not in ("keep", "top_k"))
        if odd:
            what = "; ".join(dict.fromkeys(UNSUPPORTED.get(k, k) for k in odd))
            from ..plans.plan import describe_phase
            folded = p.keep is not None and p.pool_mode == "fold"
            fix = (" (the same kept experts without folding: `moetailor plan STATS --criterion C --keep R`, or "
                   "`moetailor tune ... --no-fold`)" if folded else "")
            raise ValueError(f"the plan's {phase} phase {describe_phase(plan, phase)}: layer {i} sets {odd}, which "
                             f"llama.cpp cannot run: {what}. Serve this plan with moetailor (`moetailor serve MODEL "
                             f"--decode-plan PLAN`), or export a plan that only keeps experts and/or sets top_k{fix}")
    counts = {i: len(p.keep) if p.keep is not None else plan.model["num_experts"] for i, p in per_layer.items()}
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{i}:{n}" for i, n in counts.items())
        raise ValueError(f"the plan's {phase} layers keep different numbers of experts ({listed}); a GGUF has one expert "
                         "count for all layers (<arch>.expert_count). Make a uniform plan: `moetailor plan STATS "
                         "--criterion C --keep-experts N` (or --keep RATIO) without --layers")
    ks = {p.top_k for p in per_layer.values()}
    if len(ks) > 1:
        raise ValueError(f"the plan's {phase} layers route different numbers of experts per token "
                         f"({sorted(k or plan.model['top_k'] for k in ks)}); llama.cpp routes one count in every layer "
                         "(<arch>.expert_used_count). Use the same top_k in every layer")
    pruned = set(counts.values()) != {plan.model["num_experts"]}
    keep = {i: p.keep for i, p in per_layer.items()} if pruned else None
    return GGUFPlan(keep, next(iter(ks)))


def export_plan_gguf(source: str | Path, plan_path: str | Path, out: str | Path, outtype: str = "f32", *,
                     phase: str = "decode", top_k: int | None = None, overwrite: bool = False,
                     allow_routing_difference: bool = False, command: str | None = None,
                     verbose: bool = False) -> GGUFExport:
    """A GGUF of ``plan``'s ``phase``: the checkpoint pruned to the kept experts (streamed into a
    temporary directory, removed after), converted, with the plan's top-k as the file's expert count."""
    from ..models.paths import resolve_model_path
    from ..plans.plan import Plan
    from ..routing.policy import LayerPolicy, PhasePolicy
    from .streaming import prune_checkpoint_streamed

    source = resolve_model_path(source)
    check_output(out, overwrite=overwrite, inputs=(source, plan_path))
    plan = Plan.load(plan_path)
    part = gguf_plan(plan, phase)
    if part.top_k is not None and top_k is not None and part.top_k != top_k:
        raise ValueError(f"the plan's {phase} phase sets top_k={part.top_k} and --expert-top-k is {top_k}; give one")
    k = top_k if top_k is not None else part.top_k
    extra = {"source": str(source), "plan": str(plan_path), "phase": phase}
    if part.keep is None:
        return export_gguf(source, out, outtype, top_k=k, overwrite=overwrite, verbose=verbose,
                           allow_routing_difference=allow_routing_difference, extra=extra)
    keep_only = plan.with_phases(**{phase: PhasePolicy({i: LayerPolicy(keep=ids) for i, ids in part.keep.items()})})
    with tempfile.TemporaryDirectory(prefix=".moetailor-gguf-", dir=Path(out).absolute().parent) as tmp:
        pruned = prune_checkpoint_streamed(source, keep_only, Path(tmp) / "pruned", phase=phase, command=command,
                                           progress=False)
        return export_gguf(pruned, out, outtype, top_k=k, overwrite=overwrite, verbose=verbose,
                           allow_routing_difference=allow_routing_difference, extra=extra)


def pruned_metadata(path: Path) -> dict:
    """moetailor.* metadata of a pruned checkpoint (its sidecar): the original ids of the kept experts."""
    from .prune import SIDECAR, read_sidecar

    if not (Path(path) / SIDECAR).is_file():
        return {}
    side = read_sidecar(path)
    out = {"num_experts_original": int(side["num_experts_original"])}
    for layer, ids in side["kept"].items():
        out[f"kept.{layer}"] = [int(e) for e in ids]
    if side.get("merged"):   # a merged checkpoint: the kept ids represent groups of merged experts
        out["merged"] = 1
    return out

