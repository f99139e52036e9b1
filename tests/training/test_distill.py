"""Distillation from the teacher's KV cache: the student starts as the masked model, continues from a
teacher cache like the masked model does, only the intended tensors train, the SE1+SE2 merge is an
exact stock checkpoint, bad input is refused and an interrupted run resumes to the same result."""

import pytest
import torch

from moetailor.cli.main import main
from moetailor.models.tiny import tiny_model
from moetailor.plans import uniform_plan
from moetailor.routing import LayerPolicy, RoutingController
from moetailor.training.distill import (
    DistillConfig,
    Student,
    bucket_kl,
    distill_loss,
    export,
    row_cache,
    split_fraction,
    teacher_targets,
    train,
)
from moetailor.transforms.artifacts import load_distilled

KEEP = (0, 2, 3, 6)
VOCAB = 96


def setup(arch="qwen2_moe", se2=True, seed=0):
    model = tiny_model(arch, seed=seed, num_experts=8, top_k=2)
    plan = uniform_plan(model, decode=LayerPolicy(keep=KEEP), criterion="test")
    return model, plan, Student(model, plan, se2=se2)


def masked_reference(arch, plan, seed=0):
    """An independent copy of the same model with the plan's decode policy: the training-free decoder."""
    model = tiny_model(arch, seed=seed, num_experts=8, top_k=2)
    return model, RoutingController(model)


def tokens(b, n, seed=0):
    return torch.randint(2, VOCAB, (b, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])
def test_student_starts_as_masked_model_and_continues_from_teacher_cache_like_it(arch):
    model, plan, student = setup(arch)
    ref, ctl = masked_reference(arch, plan)
    x = tokens(1, 20)
    with torch.no_grad():
        s_logits = student(x, use_cache=False).logits
        with ctl.policy(plan.decode):
            m_logits = ref(input_ids=x, use_cache=False).logits
        t_logits = student.teacher(x, use_cache=False).logits
    assert (s_logits - m_logits).abs().max() <= 1e-6
    assert (s_logits - t_logits).abs().max() > 1e-3  # the plan really changes the model

    split = 7
    with torch.no_grad():
        cache = student.teacher(x[:, :split], use_cache=True).cache
        s_cont = student(x[:, split:], cache=row_cache(cache, 0, split, model.config), use_cache=True).logits
        with ctl.policy(plan.decode):
            m_cont = ref(input_ids=x[:, split:], cache=row_cache(cache, 0, split, model.config), use_cache=True).logits
        with ctl.policy(plan.decode):
            full_masked = ref(input_ids=x, use_cache=False).logits[:, split:]
    assert (s_cont - m_cont).abs().max() <= 1e-6
    # continuing from the FULL model's cache differs from a fully masked forward: the prefix matters
    assert (s_cont - full_masked).abs().max() > 1e-4


def test_only_intended_parameters_receive_gradients_and_the_teacher_never_changes():
    model, plan, student = setup("qwen2_moe")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = tokens(2, 17)
    with torch.no_grad():
        t0 = student.teacher(x[:, :-1], use_cache=False).logits
    cfg = DistillConfig(steps=1, batch_size=2, seq_len=16)
    distill_loss(student, x, [0, 9], cfg)
    assert [n for n, p in model.named_parameters() if p.grad is not None] == []
    assert all(not p.requires_grad for p in model.parameters())
    grads = {n: p.grad for n, p in student.trainable()}
    assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]
    names = set(grads)
    assert {n for n in names if n.endswith("mlp.gate.weight")} == {f"model.layers.{i}.mlp.gate.weight" for i in (0, 1)}
    assert any("layernorm" in n for n in names) and "model.norm.weight" in names
    assert not any("experts" in n or "self_attn.q_proj" in n or "embed" in n for n in names)
    for n, g in grads.items():
        if n.endswith("mlp.gate.weight") or n.endswith("down_proj.weight") or "norm" in n:
            assert g.abs().sum() > 0, n
    # SE1 is frozen; only SE2 (outside the model) trains
    assert all(not p.requires_grad for p in model.model.layers[0].mlp.shared_expert.parameters())
    counts = student.counts()
    assert 0 < counts["trainable_share"] < 0.5 and counts["trainable"] == sum(g.numel() for g in grads.values())

    opt = torch.optim.SGD([p for _, p in student.trainable()], lr=0.5)
    opt.step()
    with torch.no_grad():
        t1 = student.teacher(x[:, :-1], use_cache=False).logits
        s1 = student(x[:, :-1], use_cache=False).logits
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert torch.equal(t0, t1)                     # the teacher is the untouched full model
    assert (s1 - t1).abs().max() > 0


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])
def test_merged_checkpoint_is_stock_and_equals_se1_plus_se2(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    model, plan, student = setup(arch)
    torch.manual_seed(1)
    with torch.no_grad():  # a student that has moved: random SE2 and perturbed router/norms
        for p in student.se2.parameters():
            p.normal_(0, 0.1)
        for p in student.params.values():
            p.add_(0.05 * torch.randn_like(p))
    out = export(student, tmp_path / "distilled", source=None)
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    key = {"qwen2_moe": "shared_expert_intermediate_size", "deepseek_v3": "n_shared_experts"}[arch]
    assert getattr(loaded.config, key) == 2 * getattr(model.config, key)
    x = tokens(2, 12)
    with torch.no_grad():
        want_full = student(x, policy=None, use_cache=False).logits
        got_full = loaded(input_ids=x, use_cache=False).logits
        want = student(x, use_cache=False).logits
    assert (want_full - got_full).abs().max() <= 1e-5

    model_path, saved = load_distilled(out)
    assert model_path == out
    saved.check_model(loaded)  # the plan was re-fingerprinted for the distilled router
    assert saved.meta["distillation"]["distilled"] and saved.decode == plan.decode
    with torch.no_grad(), RoutingController(loaded).policy(saved.decode):
        got = loaded(input_ids=x, use_cache=False).logits
    assert (want - got).abs().max() <= 1e-5
    # load_model carries the plan on the model: the disaggregated decode worker reads it there
    from moetailor.models.loading import load_model
    from moetailor.serving.disagg import distilled_plan
    assert distilled_plan(load_model(out)).to_json() == saved.to_json()
    assert distilled_plan(loaded) is None     # a model loaded without load_model has no sidecars


def test_architecture_without_shared_expert_refuses_se2_and_trains_router_and_norms(tmp_path):
    model = tiny_model("qwen3_moe", num_experts=8, top_k=2)
    plan = uniform_plan(model, decode=LayerPolicy(keep=KEEP))
    with pytest.raises(ValueError, match="no shared expert.*--no-se2"):
        Student(model, plan, se2=True)
    model, plan, student = setup("qwen3_moe", se2=False)
    assert len(student.se2) == 0 and student.counts()["se2"] == 0
    cfg = DistillConfig(steps=2, batch_size=2, seq_len=12, lr=1e-2, warmup=1)
    data = lambda start: (tokens(2, 13, seed=start + i) for i in range(10**6))
    train(student, data, cfg, progress=False)
    out = export(student, tmp_path / "d")
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    x = tokens(1, 10)
    with torch.no_grad():
        assert (student(x, policy=None, use_cache=False).logits - loaded(input_ids=x, use_cache=False).logits).abs().max() <= 1e-5


def test_bucket_kl():
    torch.manual_seed(0)
    t, s = torch.randn(5, 30) * 2, torch.randn(5, 30) * 2
    ids, t_top, t_rest = teacher_targets(t, 30)  # every token in the top set: the exact KL
    exact = (t.softmax(-1) * (t.log_softmax(-1) - s.log_softmax(-1))).sum(-1)
    assert torch.allclose(bucket_kl(s, ids, t_top, t_rest), exact, atol=1e-5)
    ids, t_top, t_rest = teacher_targets(t, 4)
    pt, ps = t.softmax(-1), s.softmax(-1)
    bt = torch.cat([pt.gather(1, ids), 1 - pt.gather(1, ids).sum(1, keepdim=True)], 1)
    bs = torch.cat([ps.gather(1, ids), 1 - ps.gather(1, ids).sum(1, keepdim=True)], 1)
    assert torch.allclose(bucket_kl(s, ids, t_top, t_rest), (bt * (bt.log() - bs.log())).sum(1), atol=1e-5)
    assert bucket_kl(t, ids, t_top, t_rest).abs().max() < 1e-5
    assert (bucket_kl(s, ids, t_top, t_rest) <= exact + 1e-5).all()  # bucketing never increases KL


def test_bad_settings_are_refused():
    for bad in ("1.0", "-0.1", "later", 1.5):
        with pytest.raises(ValueError, match="split-point"):
            DistillConfig(steps=1, split_point=bad).validate()
    assert split_fraction("zero") == 0.0 and split_fraction("uniform") is None and split_fraction("0.5") == 0.5
    with pytest.raises(ValueError, match="alpha"):
        DistillConfig(steps=1, alpha=1.5).validate()
    with pytest.raises(ValueError, match="steps"):
        DistillConfig(steps=0).validate()
    model = tiny_model("qwen2_moe", seed=0)
    other = uniform_plan(tiny_model("qwen2_moe", seed=1), decode=LayerPolicy(keep=KEEP))
    with pytest.raises(ValueError, match="does not match"):
        Student(model, other)
    with pytest.raises(ValueError, match="full router"):
        Student(model, uniform_plan(model))


def test_cli_refuses_bad_input_with_clear_errors(tmp_path, capsys):
    model = tiny_model("qwen2_moe", seed=0)
    model.save_pretrained(tmp_path / "m")
    other = uniform_plan(tiny_model("qwen2_moe", seed=1), decode=LayerPolicy(keep=KEEP)).save(tmp_path / "other.json")
    own = uniform_plan(model, decode=LayerPolicy(keep=KEEP)).save(tmp_path / "own.json")
    base = ["distill", str(tmp_path / "m")]
    cases = [
        (base + [str(own), "--steps", "2", "--out", str(tmp_path / "o")], "--data is required"),
        (base + [str(other), "--steps", "2", "--out", str(tmp_path / "o")], "does not match"),
        (base + [str(own), "--steps", "0", "--out", str(tmp_path / "o")], "--steps"),
        (base + [str(own), "--steps", "2", "--alpha", "-0.5", "--out", str(tmp_path / "o")], "--alpha"),
        (base + [str(own), "--steps", "2", "--split-point", "1", "--out", str(tmp_path / "o")], "--split-point"),
        (base + [str(own), "--steps", "2", "--resume", "--out", str(tmp_path / "o")], "--resume"),
        (base + [str(own), "--steps", "2", "--out", str(tmp_path)], "--overwrite"),
    ]
    for argv, message in cases:
        if message != "--data is required":
            argv = argv + ["--data", "tasks"]
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv


def test_interrupted_run_resumes_to_the_same_result(tmp_path):
    cfg = DistillConfig(steps=4, batch_size=2, seq_len=12, lr=1e-2, warmup=1, checkpoint_every=1)
    data = lambda start: (tokens(2, 13, seed=1000 + start + i) for i in range(10**6))

    _, _, straight = setup()
    ref = train(straight, data, cfg, state_dir=tmp_path / "a", progress=False)

    class Interrupt(Exception):
        pass

    def stop_at_two(step, rec):
        if step == 2:
            raise Interrupt
    _, _, first = setup()
    with pytest.raises(Interrupt):
        train(first, data, cfg, state_dir=tmp_path / "b", progress=False, callback=stop_at_two)
    _, _, second = setup()  # a fresh process: new model, state only from disk
    resumed = train(second, data, cfg, state_dir=tmp_path / "b", resume=True, progress=False)
    assert resumed.resumed_from == 2 and len(resumed.log) == 4
    for (n, a), (_, b) in zip(straight.trainable(), second.trainable()):
        assert torch.allclose(a, b, atol=1e-6), n
    assert [r["loss"] for r in resumed.log] == pytest.approx([r["loss"] for r in ref.log], rel=1e-5)
    assert (tmp_path / "b" / "loss_curve.png").stat().st_size > 0
    with pytest.raises(ValueError, match="settings differ"):
        _, _, third = setup()
        train(third, data, DistillConfig(**{**cfg.__dict__, "alpha": 0.5}), state_dir=tmp_path / "b", resume=True,
              progress=False)


class _Planted:
    """A pickle payload: unpickling it (torch.load weights_only=False) would create ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import pathlib
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_resume_refuses_a_planted_pickle_without_running_it(tmp_path, capsys):
    model = tiny_model("qwen2_moe", seed=0)
    model.save_pretrained(tmp_path / "m")
    plan = uniform_plan(model, decode=LayerPolicy(keep=KEEP)).save(tmp_path / "plan.json")
    marker = tmp_path / "payload-ran"
    (tmp_path / "o.partial").mkdir()
    torch.save({"step": 1, "payload": _Planted(marker)}, tmp_path / "o.partial" / "state.pt")
    capsys.readouterr()
    assert main(["distill", str(tmp_path / "m"), str(plan), "--data", "tasks", "--steps", "2", "--resume", "--out",
                 str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "not a readable distillation checkpoint (it refers to" in err and "could run code" in err
    assert len(err.strip().splitlines()) == 1
    assert not marker.exists()


def test_train_experts_moves_only_the_pools_experts_and_exports_them(tmp_path):
    """--train-experts: the decode pool's experts train (copies; the teacher's stay), the others get no
    gradient and keep their weights, and the exported checkpoint computes the student."""
    model = tiny_model("qwen3_moe", num_experts=8, top_k=2)
    plan = uniform_plan(model, decode=LayerPolicy(keep=KEEP))
    student = Student(model, plan, se2=False, experts=True)
    assert student.expert_names and student.counts()["experts"] > 0
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = DistillConfig(steps=3, batch_size=2, seq_len=12, lr=1e-2, warmup=1, se2=False, experts=True)
    data = lambda start: (tokens(2, 13, seed=start + i) for i in range(10**6))
    train(student, data, cfg, progress=False)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "the teacher must not change"
    outside = [e for e in range(8) if e not in KEEP]
    for name in student.expert_names:
        trained, original = student.params[name].detach(), before[name]
        assert torch.equal(trained[outside], original[outside]), f"{name}: an expert outside the pool changed"
        assert not torch.equal(trained[list(KEEP)], original[list(KEEP)]), f"{name}: the pool's experts did not train"
    out = export(student, tmp_path / "d")
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    x = tokens(1, 10)
    with torch.no_grad():
        assert (student(x, policy=None, use_cache=False).logits - loaded(input_ids=x, use_cache=False).logits).abs().max() <= 1e-5
