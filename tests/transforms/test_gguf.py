"""What `moetailor export gguf` decides before llama.cpp's converter runs (no llama.cpp needed): the
pre-tokenizer named from tokenizer.json, the routing llama.cpp's graphs hard-code, what of a plan one GGUF
can hold, and the one-line errors. The conversion itself is tested against llama.cpp in
tests/integrations/llamacpp (`make test-llamacpp`)."""
import json
from pathlib import Path

import pytest

from moetailor.cli.main import main
from moetailor.models.tiny import tiny_config
from moetailor.plans import Plan
from moetailor.transforms.gguf import gguf_plan, override_kv, pre_tokenizer_name, routing_difference

ASSETS = Path(__file__).resolve().parents[2] / "src" / "moetailor" / "assets"
PLAN = ASSETS / "plans" / "reference-reap-50.json"


def test_bundled_tokenizer_is_llamacpps_refact_pre_tokenizer():
    tok = json.loads((ASSETS / "reference" / "tokenizer.json").read_text())
    assert pre_tokenizer_name(tok) == "refact"        # digits one by one, then GPT-2's regex


def test_pre_tokenizer_names_only_what_llamacpp_splits_the_same_way():
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    base = {"model": {"type": "BPE"}, "normalizer": None}
    assert pre_tokenizer_name({**base, "pre_tokenizer": byte_level}) == "gpt-2"
    assert pre_tokenizer_name({**base, "pre_tokenizer": {**byte_level, "add_prefix_space": True}}) is None
    grouped = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": False}, byte_level]}
    assert pre_tokenizer_name({**base, "pre_tokenizer": grouped}) is None      # digit runs: no llama.cpp twin
    assert pre_tokenizer_name({**base, "pre_tokenizer": {"type": "Metaspace"}}) is None
    assert pre_tokenizer_name({"model": {"type": "WordLevel"}, "normalizer": None, "pre_tokenizer": byte_level}) is None


@pytest.mark.parametrize("arch,norm,differs", [
    ("qwen2_moe", True, True), ("qwen2_moe", False, False),     # llama.cpp's qwen2moe never renormalises
    ("olmoe", True, True), ("olmoe", False, False),             # nor does olmoe
    ("qwen3_moe", False, True), ("qwen3_moe", True, False),     # qwen3moe always does
    ("mixtral", None, False),                                   # Mixtral always renormalises, as llama.cpp does
    ("deepseek_v3", True, False), ("deepseek_v3", False, False),  # read from the file's expert_weights_norm
])
def test_routing_difference_follows_llamacpps_graphs(arch, norm, differs):
    cfg = tiny_config(arch) if norm is None else tiny_config(arch, norm_topk_prob=norm)
    note = routing_difference(cfg)
    assert (note is not None) == differs
    if differs:
        assert "renormalises" in note and "norm_topk_prob" in note


def test_override_kv_is_llamacpps_flag():
    assert override_kv("qwen2moe", 4) == "--override-kv qwen2moe.expert_used_count=int:4"


def _plan(changes) -> Plan:
    data = json.loads(PLAN.read_text())
    changes(data)
    return Plan.from_json(data)


def test_uniform_plan_is_one_gguf():
    part = gguf_plan(Plan.load(PLAN))
    assert part.top_k is None and sorted(part.keep) == [0, 1, 2, 3, 4, 5]
    assert {len(v) for v in part.keep.values()} == {32}
    assert gguf_plan(Plan.load(PLAN), "prefill").keep is None       # the bundled plan leaves prefill full


def test_plan_with_different_counts_per_layer_is_refused():
    def cut(data):
        data["decode"]["0"]["keep"] = data["decode"]["0"]["keep"][:16]
    with pytest.raises(ValueError, match=r"different numbers of experts \(0:16, 1:32") as e:
        gguf_plan(_plan(cut))
    assert "--keep-experts" in str(e.value) and "expert_count" in str(e.value)


def test_top_k_only_plan_and_uneven_top_k():
    def skip(data):
        data["decode"] = {str(i): {"top_k": 4} for i in range(6)}
    part = gguf_plan(_plan(skip))
    assert part.keep is None and part.top_k == 4

    def uneven(data):
        data["decode"] = {str(i): {"top_k": 4 if i else 2} for i in range(6)}
    with pytest.raises(ValueError, match="different numbers of experts per token"):
        gguf_plan(_plan(uneven))


@pytest.mark.parametrize("field,value,words", [("skip_beta", 0.3, "dynamic skipping"),
                                               ("batch_pool", 16, "batch pool"),
                                               ("pool_mode", "fold", "pool")])
def test_techniques_without_a_llamacpp_knob_are_refused(field, value, words):
    def add(data):
        data["decode"]["2"][field] = value
    with pytest.raises(ValueError, match=words) as e:
        gguf_plan(_plan(add))
    assert "layer 2" in str(e.value) and "moetailor serve" in str(e.value)


def test_cli_refuses_the_bundled_model_whose_routing_llamacpp_changes(tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert main(["export", "gguf", "reference", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "never renormalises" in err and "--allow-routing-difference" in err
    assert "moetailor export gguf reference-qwen3" in err     # the bundled model that does export
    assert not out.exists()


def test_the_bundled_model_the_refusal_names_routes_as_llamacpp_does():
    from transformers import AutoConfig

    from moetailor.models.loading import resolve_model_path

    assert routing_difference(AutoConfig.from_pretrained(resolve_model_path("reference-qwen3"))) is None


def test_cli_names_the_setup_command_when_the_converter_is_missing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MOETAILOR_LLAMACPP_CONVERTER", str(tmp_path / "nowhere"))
    assert main(["export", "gguf", "reference", "--allow-routing-difference", "--out", str(tmp_path / "m.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "make setup-llamacpp" in err and "MOETAILOR_LLAMACPP_CONVERTER" in err


def test_cli_refuses_a_non_uniform_plan(tmp_path, capsys):
    data = json.loads(PLAN.read_text())
    data["decode"]["3"]["keep"] = data["decode"]["3"]["keep"][:20]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(data))
    assert main(["export", "gguf", "reference", "--plan", str(plan), "--allow-routing-difference",
                 "--out", str(tmp_path / "m.gguf")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "3:20" in err and "moetailor plan" in err


def test_cli_rejects_a_top_k_above_the_models(tmp_path, capsys):
    assert main(["export", "gguf", "reference", "--expert-top-k", "9", "--allow-routing-difference",
                 "--out", str(tmp_path / "m.gguf")]) == 2
    assert "[1, 8]" in capsys.readouterr().err


def test_shapes_llamacpps_loaders_reject_are_named():
    from moetailor.transforms.gguf import loader_problem

    assert loader_problem(tiny_config("olmoe")) and "KV heads" in loader_problem(tiny_config("olmoe"))
    assert loader_problem(tiny_config("olmoe", num_key_value_heads=4)) is None
    assert "26 or 27" in loader_problem(tiny_config("deepseek_v3"))          # q_lora_rank=null at 2 layers
    assert loader_problem(tiny_config("deepseek_v3", q_lora_rank=16)) is None
    assert loader_problem(tiny_config("deepseek_v3", layers=27)) is None
    assert loader_problem(tiny_config("qwen2_moe")) is None


def _converter_available() -> bool:
    from moetailor.transforms.gguf import converter_dir

    try:
        converter_dir()
        return True
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not _converter_available(), reason="llama.cpp's converter is not installed: `make setup-llamacpp`")
def test_export_from_this_environment_writes_the_plan_into_the_file(tmp_path):
    """With .venv-llamacpp present, the verb runs from moetailor's own environment too (the converter is
    pure Python); a plan's kept experts and top_k end up in the file's metadata."""
    from moetailor.models.tiny import tiny_model
    from moetailor.plans import uniform_plan
    from moetailor.routing import LayerPolicy
    from moetailor.transforms.gguf import import_converter

    src = tmp_path / "model"
    model = tiny_model("qwen3_moe", num_experts=8, top_k=2, vocab=8192)
    model.save_pretrained(src)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (src / name).write_bytes((ASSETS / "reference" / name).read_bytes())
    model.moetailor_source = str(src)
    plan = uniform_plan(model, decode=LayerPolicy(keep=(1, 3, 4, 6), top_k=1)).save(tmp_path / "plan.json")
    out = tmp_path / "m.gguf"
    assert main(["export", "gguf", str(src), "--plan", str(plan), "--out", str(out)]) == 0
    import_converter()
    import gguf

    kv = {k: f.contents() for k, f in gguf.GGUFReader(str(out)).fields.items()}
    assert kv["general.architecture"] == "qwen3moe" and kv["qwen3moe.expert_count"] == 4
    assert kv["qwen3moe.expert_used_count"] == 1 and kv["moetailor.kept.0"] == [1, 3, 4, 6]
    assert kv["tokenizer.ggml.pre"] == "refact"
    assert not list(tmp_path.glob(".moetailor-gguf-*")) and not list(tmp_path.glob(".m.gguf.tmp-*"))
