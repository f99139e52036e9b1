"""The reference-model recipe's data side: packed task rows carry loss only on completions."""
import json

import pytest

from moetailor.data.corpus import DOMAIN_NAMES
from moetailor.models.loading import load_tokenizer
from moetailor.training.reference import Mixture


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    (root / "train").mkdir()
    for name in DOMAIN_NAMES:
        docs = [{"text": f"{name} document {i}. " * 40} for i in range(5)]
        (root / "train" / f"{name}.jsonl").write_text("\n".join(json.dumps(d) for d in docs))
    return root


def test_masked_task_rows_train_only_on_completions(corpus):
    tok = load_tokenizer("reference")
    mixture = Mixture(tok, corpus, seq_len=256, task_share=1.0, seed=0, mask_prompts=True)
    ids, labels = mixture.batch(4)                                   # [4, 256] each
    assert ids.shape == labels.shape == (4, 256)
    trained = labels != -100
    assert 0 < trained.float().mean() < 1                            # some masked, some trained
    assert (labels[trained] == ids[trained]).all()                   # trained labels are the inputs
    text = tok.decode(ids[0][trained[0]].tolist())
    assert "####" in text and "lookup" not in text                   # completions, not prompts


def test_unmasked_text_rows_and_task_weights(corpus):
    tok = load_tokenizer("reference")
    text_only = Mixture(tok, corpus, seq_len=128, task_share=0.0, seed=0, mask_prompts=True)
    ids, labels = text_only.batch(2)
    assert (labels == ids).all()                                      # text windows: every token
    lookup_only = Mixture(tok, corpus, seq_len=512, task_share=1.0, seed=0, mask_prompts=False,
                          task_weights={name: 0.0 for name in ("addition", "expressions", "brackets",
                                                                "sorting", "reverse")})
    ids, _ = lookup_only.batch(1)
    assert tok.decode(ids[0].tolist()).startswith("lookup\n")


def test_drill_rows_repeat_one_symbol_string_with_loss_everywhere(corpus):
    tok = load_tokenizer("reference")
    drill_only = Mixture(tok, corpus, seq_len=128, task_share=0.0, seed=0, drill_share=1.0)
    ids, labels = drill_only.batch(3)                                 # [3, 128]
    assert (labels == ids).all()
    symbols = set(drill_only.symbols)
    for row in ids.tolist():
        assert set(row) <= symbols
        period = next(p for p in range(1, 129) if row[p:] == row[:-p])  # the repeated string's length
        assert 4 <= period < 24


def test_loss_on_labelled_positions_matches_the_full_head():
    """Projecting only labelled positions onto the vocabulary gives transformers' own loss."""
    import torch
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from moetailor.training.reference import bf16_matmuls_are_fast, causal_lm_loss

    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, pad_token_id=1, bos_token_id=None, eos_token_id=0))
    ids = torch.randint(2, 64, (3, 20))
    labels = ids.clone()
    labels[:, :12] = -100                                              # a masked prompt
    labels[1, 15:] = -100
    loss, aux = causal_lm_loss(model, ids, labels)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_matmuls_are_fast()):   # as the recipe runs
        reference = model(input_ids=ids, labels=labels, output_router_logits=True)
    expected = reference.loss - model.config.router_aux_loss_coef * reference.aux_loss
    assert torch.allclose(loss, expected, atol=1e-4)
    assert torch.allclose(aux, reference.aux_loss)


def test_a_later_model_keeps_the_shipped_heldout_text_unseen_and_unchanged(tmp_path, monkeypatch):
    """``bundle=False``: the bundled held-out/calibration files stay byte for byte, and a training
    document that shares a long line with them (another package version cuts other documents) is dropped."""
    from moetailor.data import corpus

    line = lambda i: f"line {i} of a document long enough to count as shared text here\n"  # noqa: E731
    docs = ["".join(line(10 * d + j) for j in range(5)) for d in range(70)]
    bundled = tmp_path / "bundled"
    for split in ("heldout", "calibration"):
        (bundled / split).mkdir(parents=True)
    shipped = docs[3]                                                # a document the new cut trains on
    (bundled / "heldout" / "scripture.jsonl").write_text(json.dumps({"text": shipped}) + "\n")
    (bundled / "calibration" / "scripture.jsonl").write_text("")
    before = {p: p.read_bytes() for p in bundled.rglob("*.jsonl")}
    monkeypatch.setattr(corpus, "BUNDLED_DIR", bundled)
    monkeypatch.setattr(corpus, "DOMAINS", [corpus.Domain("scripture", lambda: iter(docs), "test")])
    summary = corpus.build_corpus(tmp_path / "work", heldout_docs=2, calib_docs=2, bundle=False)
    trained = [json.loads(l)["text"] for l in (tmp_path / "work" / "train" / "scripture.jsonl").read_text().splitlines()]
    assert shipped not in trained and len(trained) == summary["scripture"]["train_docs"] >= 60
    assert {p: p.read_bytes() for p in bundled.rglob("*.jsonl")} == before


def test_the_second_family_is_a_qwen3_moe_without_shared_expert():
    from moetailor.training.config import model_class, model_config

    cfg = model_config(8192, "qwen3_moe")
    assert cfg.model_type == "qwen3_moe" and cfg.num_experts == 64 and cfg.num_experts_per_tok == 8
    assert not hasattr(cfg, "shared_expert_intermediate_size") or not cfg.shared_expert_intermediate_size
    assert model_class("qwen3_moe").__name__ == "Qwen3MoeForCausalLM"
    with pytest.raises(ValueError, match="unknown reference family 'mixtral'; choose from: qwen2_moe, qwen3_moe"):
        model_config(8192, "mixtral")


def test_a_stopped_stage_resumes_on_the_batches_and_weights_of_an_unbroken_run(corpus, tmp_path, monkeypatch):
    """A run stopped mid-stage continues from out/resume.pt to the same weights as one that never stopped
    (a training run outlasts a session here); a resume point of another run is refused by name."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from moetailor.training import reference

    tok = load_tokenizer("reference")
    stage = reference.Stage(steps=4, lr=1e-3, warmup=2, task_share=0.5, mask_prompts=True, drill_share=0.2)
    run = reference.RunIdentity("qwen3_moe", batch_size=2, seq_len=32, seed=0)
    config = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=16, intermediate_size=64, moe_intermediate_size=16,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, pad_token_id=1,
                            bos_token_id=None, eos_token_id=0)

    def fresh_stage_run(out, resume=None):
        out.mkdir(exist_ok=True)
        torch.manual_seed(0)
        model = Qwen3MoeForCausalLM(config)
        if resume is not None:
            model.load_state_dict(resume["model"])
        mixture = Mixture(tok, corpus, 32, stage.task_share, 0, stage.mask_prompts, {}, stage.drill_share)
        log = [] if resume is None else resume["log"]
        reference._run_stage(model, mixture, stage, 1, 2, 32, log, out, [], run, resume, eval_every=10**6)
        return model, log

    monkeypatch.setattr(reference, "RESUME_EVERY", 2)
    unbroken, unbroken_log = fresh_stage_run(tmp_path / "unbroken")

    class Stop(Exception):
        pass

    real_batch, calls = Mixture.batch, []

    def stop_at_the_fourth_batch(self, batch_size):
        calls.append(1)
        if len(calls) == 4:
            raise Stop
        return real_batch(self, batch_size)

    monkeypatch.setattr(Mixture, "batch", stop_at_the_fourth_batch)
    with pytest.raises(Stop):
        fresh_stage_run(tmp_path / "stopped")
    monkeypatch.setattr(Mixture, "batch", real_batch)
    state = reference.load_resume(tmp_path / "stopped", run)
    assert state["stage"] == 1 and state["step"] == 2 and len(state["log"]) == 2
    resumed, resumed_log = fresh_stage_run(tmp_path / "stopped", state)
    assert [r["loss"] for r in resumed_log] == [r["loss"] for r in unbroken_log]
    for (name, a), (_, b) in zip(unbroken.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(SystemExit, match="belongs to another run .* pass the same --family"):
        reference.load_resume(tmp_path / "stopped", reference.RunIdentity("qwen2_moe", 2, 32, 0))
