"""Calibration statistics on tiny models: counts against hand-counted routes, planted fold
relations, the NAEE beta on a constructed router, the file format and its errors."""
import json

import pytest
import torch
import torch.nn.functional as F

from moetailor.calibration import (
    BETA_BINS,
    Collector,
    ExpertStats,
    StatsMismatch,
    calibrate,
    calibrate_batches,
    iter_documents,
    iter_token_windows,
    load_fold_tables,
    parse_data_spec,
)
from moetailor.models import moe_layers
from moetailor.models.tiny import TINY_ARCHITECTURES, char_tokenizer, tiny_model
from moetailor.routing import RoutingController
from moetailor.routing.router import select


def batches(n=3, seed=0, shape=(4, 16)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, shape, generator=g) for _ in range(n)]


def stock_routes(model, inputs):
    """Routes and hidden states recorded from the stock routers (no moetailor controller installed)."""
    seen = {}
    hooks = []
    for layer in moe_layers(model):
        def hook(module, args, out, i=layer.index):
            seen.setdefault(i, []).append((args[0].reshape(-1, args[0].shape[-1]), out[0], out[2]))
        hooks.append(layer.router.register_forward_hook(hook))
    with torch.no_grad():
        for x in inputs:
            model(input_ids=x, use_cache=False)
    for h in hooks:
        h.remove()
    return {i: [torch.cat(t) for t in zip(*v)] for i, v in seen.items()}  # hidden, logits, index


@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_statistics_match_hand_counted_routes(arch):
    model = tiny_model(arch)
    inputs = batches()
    routes = stock_routes(model, inputs)
    stats = calibrate_batches(model, inputs, progress=False)
    assert stats.meta["tokens"] == sum(x.numel() for x in inputs)
    assert RoutingController.installed(model) is None  # calibration leaves the model stock
    assert all(not m._forward_hooks for m in model.modules())
    for layer in moe_layers(model):
        hidden, logits, index = routes[layer.index]
        st = stats.layers[layer.index]
        E = layer.num_experts
        freq = torch.zeros(E)
        for e in index.reshape(-1).tolist():
            freq[e] += 1
        assert torch.equal(st.frequency.float(), freq)
        assert torch.equal(torch.diagonal(st.coselect).float(), freq)
        # mass: router scores over all experts, renormalised over each token's chosen k
        scores = logits.float().sigmoid() if arch == "deepseek_v3" else logits.float().softmax(-1)
        g = scores.gather(1, index)
        g = g / g.sum(-1, keepdim=True)
        mass = torch.zeros(E, dtype=torch.float64).index_add_(0, index.reshape(-1), g.reshape(-1).double())
        torch.testing.assert_close(st.mass, mass, rtol=1e-5, atol=1e-5)
        assert float(st.mass.sum()) == pytest.approx(stats.meta["tokens"], rel=1e-6)
        # EAN / REAP from the raw expert weights
        ex = layer.experts
        ean = torch.zeros(E, dtype=torch.float64)
        wean = torch.zeros(E, dtype=torch.float64)
        for t in range(index.shape[0]):
            for slot, e in enumerate(index[t].tolist()):
                gate, up = (hidden[t] @ ex.gate_up_proj[e].T).chunk(2)
                norm = float((ex.down_proj[e] @ (F.silu(gate) * up)).norm().detach())
                ean[e] += norm
                wean[e] += float(g[t, slot]) * norm
        torch.testing.assert_close(st.ean, ean, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(st.weighted_ean, wean, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(st.reap, wean / freq.double().clamp_min(1), rtol=1e-4, atol=1e-5)


def test_softmax_gate_is_not_renormalised():
    model = tiny_model("qwen3_moe")
    inputs = batches()
    renorm = calibrate_batches(model, inputs, progress=False)
    plain = calibrate_batches(model, inputs, gate="softmax", progress=False)
    tokens = renorm.meta["tokens"]
    for i in renorm.layers:
        assert float(renorm.layers[i].mass.sum()) == pytest.approx(tokens, rel=1e-6)
        assert float(plain.layers[i].mass.sum()) < 0.99 * tokens
        assert torch.equal(renorm.layers[i].frequency, plain.layers[i].frequency)
    assert plain.meta["gate"]["name"] == "softmax"
    with pytest.raises(ValueError, match="unknown gate"):
        calibrate_batches(model, inputs, gate="sigmoid", progress=False)


def plant_double(model, a: int, b: int):
    """Make expert b compute exactly 2 * expert a (and a's outputs large, so ExFold's 1e-3 epsilon is
    negligible), and give b nearly a's router row: with top-2 routing a is always chosen with b."""
    layer = moe_layers(model)[0]
    with torch.no_grad():
        layer.experts.down_proj[a] *= 20
        layer.experts.gate_up_proj[b] = layer.experts.gate_up_proj[a]
        layer.experts.down_proj[b] = 2 * layer.experts.down_proj[a]
        w = layer.router.weight
        w[a] = 4 * w[a]
        w[b] = 0.999 * w[a]
    return layer


@pytest.mark.parametrize("all_experts", [False, True])
def test_fold_recovers_planted_relation(all_experts):
    model = tiny_model("qwen3_moe", num_experts=8, top_k=2)
    A, B = 2, 5
    layer = plant_double(model, A, B)
    stats = calibrate_batches(model, batches(4), fold=True, all_experts=all_experts, progress=False)
    st = stats.layers[layer.index]
    assert st.fold_count[A, B] > 10
    tables = st.fold_tables()
    assert float(tables.scale[A, B]) == pytest.approx(0.5, rel=1e-3)
    assert float(tables.loss[A, B]) == pytest.approx(0.0, abs=1e-4)
    assert float(tables.scale[B, A]) == pytest.approx(2.0, rel=1e-3)
    assert float(tables.loss[B, A]) == pytest.approx(0.0, abs=1e-4)
    others = [e for e in range(8) if e not in (A, B)]
    if all_experts:  # every pair observed on every token; unrelated pairs lose much more
        assert torch.isfinite(tables.loss).all()
        assert min(float(tables.loss[A, e]) for e in others) > 0.05
    else:  # routed: only co-selected pairs are observed; the others are inf / 0
        unseen = st.fold_count == 0
        assert unseen.sum() > 0
        assert torch.isinf(tables.loss[unseen & ~torch.eye(8, dtype=torch.bool)]).all()
        assert (tables.scale[unseen & ~torch.eye(8, dtype=torch.bool)] == 0).all()
        assert torch.isfinite(tables.loss[~unseen]).all()
        observed = [(s, d) for s in others for d in others if s != d and st.fold_count[s, d] > 0]
        assert observed and all(float(tables.loss[s, d]) > 0.05 for s, d in observed)
    assert torch.all(tables.mean_norm[[A, B]] > 0)
    if all_experts:  # both computed on every token
        assert float(tables.mean_norm[B]) == pytest.approx(2 * float(tables.mean_norm[A]), rel=1e-4)


def test_beta_median_on_constructed_router():
    model = tiny_model("qwen2_moe", num_experts=8, top_k=4)
    layer = moe_layers(model)[0]
    collector = Collector([layer])
    # Per token: top expert logit 0, second logit log(r): w_2 / w_1 = r exactly (softmax and renormalised alike).
    ratios = torch.tensor([0.05, 0.2, 0.3, 0.37, 0.41, 0.6, 0.75, 0.9, 0.95])
    logits = torch.full((len(ratios), 8), -30.0)
    logits[:, 3] = 0.0
    logits[:, 6] = ratios.log()
    logits[:, 1] = ratios.log() - 1.0
    logits[:, 0] = ratios.log() - 2.0
    weights, index = select(logits, layer.semantics, 4, None)
    hidden = torch.randn(len(ratios), model.config.hidden_size)
    collector(layer, hidden, logits, weights.to(logits.dtype), index)
    st = collector.stats[layer.index]
    assert float(st.beta_hist.sum()) == len(ratios)
    assert st.beta == pytest.approx(float(ratios.median()), abs=1.0 / BETA_BINS)
    # a second batch shifts the median the way an exact median would
    more = torch.tensor([0.1, 0.12, 0.15, 0.16])
    logits2 = torch.full((4, 8), -30.0)
    logits2[:, 2], logits2[:, 5] = 0.0, more.log()
    logits2[:, 4], logits2[:, 7] = more.log() - 1, more.log() - 2
    w2, i2 = select(logits2, layer.semantics, 4, None)
    collector(layer, torch.randn(4, model.config.hidden_size), logits2, w2, i2)
    assert st.beta == pytest.approx(float(torch.cat([ratios, more]).median()), abs=1.0 / BETA_BINS)


def test_save_load_roundtrip_and_errors(tmp_path):
    model = tiny_model("olmoe")
    stats = calibrate_batches(model, batches(2), fold=True, progress=False, meta={"data": "constructed"})
    path = stats.save(tmp_path / "stats.safetensors")
    back = ExpertStats.load(path)
    back.check_model(model)
    assert back.meta["data"] == "constructed" and back.meta["model"]["model_type"] == "olmoe"
    for i, layer in stats.layers.items():
        for name, t in layer.tensors().items():
            assert torch.equal(getattr(back.layers[i], name), t), name
    tables = load_fold_tables(path, model)
    assert set(tables) == set(stats.layers)
    # truncated
    raw = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match="truncated"):
        ExpertStats.load(tmp_path / "cut.safetensors")
    # foreign safetensors file
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(3)}, str(tmp_path / "foreign.safetensors"))
    with pytest.raises(ValueError, match="not a moetailor statistics file"):
        ExpertStats.load(tmp_path / "foreign.safetensors")
    (tmp_path / "plan.json").write_text(json.dumps({"format": "moetailor-plan"}))
    with pytest.raises(ValueError, match="safetensors"):
        ExpertStats.load(tmp_path / "plan.json")
    with pytest.raises(FileNotFoundError, match="moetailor calibrate"):
        ExpertStats.load(tmp_path / "missing.safetensors")
    # another model (same shape, other weights) and another architecture
    with pytest.raises(StatsMismatch, match="router_hash"):
        back.check_model(tiny_model("olmoe", seed=1))
    with pytest.raises(StatsMismatch, match="model_type"):
        load_fold_tables(path, tiny_model("qwen3_moe"))
    no_fold = calibrate_batches(model, batches(1), progress=False)
    with pytest.raises(ValueError, match="--fold"):
        load_fold_tables(no_fold, model)


def test_calibrate_text_is_deterministic_and_bounded():
    model = tiny_model("mixtral")
    tok = char_tokenizer()
    a = calibrate(model, tok, "text:fortunes", 700, seed=3, batch_tokens=256, seq_len=128, progress=False)
    b = calibrate(model, tok, "text:fortunes", 700, seed=3, batch_tokens=256, seq_len=128, progress=False)
    c = calibrate(model, tok, "text:fortunes", 700, seed=4, batch_tokens=256, seq_len=128, progress=False)
    assert a.meta["tokens"] == 700 and a.meta["data"] == "text:fortunes"
    for i in a.layers:
        assert torch.equal(a.layers[i].frequency, b.layers[i].frequency)
        assert torch.equal(a.layers[i].ean, b.layers[i].ean)
    assert any(not torch.equal(a.layers[i].frequency, c.layers[i].frequency) for i in a.layers)


def test_data_specs(tmp_path):
    from moetailor.data.tasks import TASKS, eval_examples, training_rng

    tok = char_tokenizer()
    windows = list(iter_token_windows(tok, "mix", 1000, seq_len=300, seed=0))
    assert [len(w) for w in windows] == [300, 300, 300, 100]
    assert list(iter_token_windows(tok, "mix", 1000, seq_len=300, seed=0)) == windows
    # the task stream is neither the evaluation stream nor training's (short tasks may coincide by chance)
    docs = iter_documents("tasks", seed=0)
    calib = {next(docs) for _ in range(300)}
    evals = {ex.prompt + ex.completion for t in TASKS.values() for ex in eval_examples(t, 50)}
    assert len(calib & evals) < 0.1 * len(calib)
    train_rng = training_rng(0)
    train = {t.generate(train_rng, d).prompt for t in TASKS.values() for d in t.difficulties for _ in range(20)}
    assert len({d.split(chr(10))[0] + chr(10) for d in calib} & train) < 0.1 * len(calib)
    (tmp_path / "c.jsonl").write_text('{"text": "hello"}\n\n{"text": "world"}\n')
    assert [next(d) for d in [iter_documents(str(tmp_path / "c.jsonl"))] for _ in range(3)] == ["hello", "world", "hello"]
    (tmp_path / "c.txt").write_text("plain text " * 100)
    assert next(iter_documents(str(tmp_path / "c.txt"))).startswith("plain text")
    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    with pytest.raises(ValueError, match='"text"'):
        next(iter_documents(str(tmp_path / "bad.jsonl")))
    with pytest.raises(ValueError, match="unknown text domain 'nonsense'; choose from: "):
        parse_data_spec("text:nonsense")
    with pytest.raises(FileNotFoundError):
        parse_data_spec(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="not understood"):
        parse_data_spec("wikipedia")
    with pytest.raises(ValueError, match="at least 1"):
        next(iter_token_windows(tok, "text", 0))


def test_user_traffic_formats(tmp_path):
    """JSONL with text, prompt/completion or chat messages; chat without a template is a clear error."""
    tok = char_tokenizer()
    f = tmp_path / "traffic.jsonl"
    f.write_text('{"text": "plain"}\n{"prompt": "Q: 1+1\\n", "completion": "A: 2"}\n'
                 '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    with pytest.raises(ValueError, match="chat template"):
        [next(d) for d in [iter_documents(str(f), tokenizer=tok)] for _ in range(3)]
    tok.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    docs = iter_documents(str(f), tokenizer=tok)
    assert [next(docs) for _ in range(4)] == ["plain", "Q: 1+1\nA: 2", "<user>hi\n<assistant>yo\n", "plain"]
    (tmp_path / "bad.jsonl").write_text('{"messages": "hi"}\n')
    with pytest.raises(ValueError, match="list of"):
        next(iter_documents(str(tmp_path / "bad.jsonl"), tokenizer=tok))


def test_task_domains_mixture_and_provenance(tmp_path):
    from moetailor.calibration.calibrate import calibration_record, describe_calibration
    from moetailor.calibration.data import default_data_spec, iter_document_tokens

    docs = iter_documents("tasks:sorting", seed=0)
    assert all(next(docs).startswith("sort") for _ in range(20))
    with pytest.raises(ValueError, match="unknown task 'juggling'; choose from: "):
        parse_data_spec("tasks:juggling")
    # a mixture meets its token shares (tasks documents are short, text documents long)
    tok = char_tokenizer()
    spec = parse_data_spec("mixture:tasks=3,text=1")
    assert spec.shares == (("tasks", 0.75), ("text", 0.25)) and str(spec) == "mixture:tasks=0.75,text=0.25"
    got = {"tasks": 0, "text": 0}
    task_docs = iter_documents("tasks", seed=0)
    first_tasks = {tuple(tok(next(task_docs), add_special_tokens=False)["input_ids"]) for _ in range(2000)}
    total = 0
    for ids in iter_document_tokens(tok, spec):
        got["tasks" if tuple(ids[:-1]) in first_tasks else "text"] += len(ids)
        total += len(ids)
        if total > 60_000:
            break
    assert 0.70 < got["tasks"] / total < 0.80
    with pytest.raises(ValueError, match="COMPONENT=SHARE"):
        parse_data_spec("mixture:tasks=0.5,poetry=0.5")
    # defaults: the bundled model calibrates on its workload; any other model must name its data
    assert default_data_spec("reference", None) == "tasks"
    assert default_data_spec("ckpt/", "x.jsonl") == "x.jsonl"
    with pytest.raises(ValueError, match="--data is required"):
        default_data_spec("ckpt/", None)
    # statistics record name, tokens and a content hash that follows the tokens
    model = tiny_model("mixtral")
    (tmp_path / "a.txt").write_text("alpha beta gamma\n" * 50)
    a = calibrate(model, tok, str(tmp_path / "a.txt"), 300, batch_tokens=128, seq_len=64, progress=False)
    b = calibrate(model, tok, str(tmp_path / "a.txt"), 300, batch_tokens=128, seq_len=64, progress=False)
    c = calibrate(model, tok, "text:fortunes", 300, batch_tokens=128, seq_len=64, progress=False)
    rec = calibration_record(a.meta)
    assert rec["data"] == "a.txt" and rec["tokens"] == 300 and len(rec["sha256"]) == 16
    assert rec["sha256"] == b.meta["data_sha256"] != c.meta["data_sha256"]
    assert describe_calibration(rec) == f"a.txt (300 tokens, sha256 {rec['sha256']})"


def test_fingerprint_names_the_checkpoint_without_a_machine_path(tmp_path):
    from moetailor.models.loading import REFERENCE_DIR, model_fingerprint, source_name

    assert source_name(REFERENCE_DIR) == "reference"
    assert source_name(tmp_path / "my-ckpt") == "my-ckpt"
    assert source_name(None) is None
    model = tiny_model("mixtral")
    model.moetailor_source = str(tmp_path / "ckpts" / "pruned-50")
    assert model_fingerprint(model)["source"] == "pruned-50"
