"""Plan options that read expert output statistics: protected super experts and novice plans."""
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moetailor.calibration import ExpertStats, calibrate_batches
from moetailor.cli.main import main
from moetailor.models.tiny import tiny_model
from moetailor.plans.criteria import make_plan, super_experts
from moetailor.plans.plan import Plan


@pytest.fixture(scope="module")
def stats_file(tmp_path_factory):
    model = tiny_model("qwen2_moe", num_experts=8, top_k=2)
    g = torch.Generator().manual_seed(0)
    stats = calibrate_batches(model, [torch.randint(0, 96, (4, 16), generator=g) for _ in range(3)], progress=False)
    return stats.save(tmp_path_factory.mktemp("stats") / "stats.safetensors"), model


def test_protected_super_experts_are_kept_whatever_their_score(stats_file):
    path, model = stats_file
    stats = ExpertStats.load(path)
    layer = next(iter(stats.layers))
    st = stats.layers[layer]
    weakest = int(torch.argmin(st.reap))
    st.out_max[weakest] = 1e4 * float(st.out_max.max())        # plant a super expert with the lowest REAP score
    assert super_experts(stats, 1) == {layer: [weakest]}
    plain = make_plan(stats, model, "reap", keep=0.5)
    assert weakest not in plain.decode.for_layer(layer).keep
    protected = make_plan(stats, model, "reap", keep=0.5, protect_super=1)
    keep = protected.decode.for_layer(layer).keep
    assert weakest in keep and len(keep) == len(plain.decode.for_layer(layer).keep)
    assert set(plain.decode.for_layer(layer).keep) - set(keep) == {plain.decode.for_layer(layer).keep[
        min(range(len(plain.decode.for_layer(layer).keep)), key=lambda j: float(st.reap[plain.decode.for_layer(layer).keep[j]]))]}
    assert protected.meta["super_experts"] == {str(layer): [weakest]}
    with pytest.raises(ValueError, match="super experts to protect but only 4 kept"):
        make_plan(stats, model, "reap", keep=0.5, protect_super=40)


def test_novice_plan_records_its_statistics(stats_file, tmp_path):
    path, model = stats_file
    stats = ExpertStats.load(path)
    plan = make_plan(stats, model, "mone", keep=0.5, novice=True, stats_path=str(path))
    assert all(p.pool_mode == "novice" for p in plan.decode.layers.values())
    assert plan.needs_constants and plan.fold_tables_path() == path
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").decode == plan.decode
    # the mone score is |T_j| x output variance
    layer = next(iter(stats.layers.values()))
    assert torch.all(layer.frequency * layer.output_variance >= 0)


def test_options_on_old_statistics_say_recalibrate(stats_file, tmp_path, capsys):
    path, _ = stats_file
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        old = {k: f.get_tensor(k) for k in f.keys() if ".out_" not in k}
    save_file(old, str(tmp_path / "old.safetensors"), metadata=meta)
    for extra in (["--protect-super", "2"], ["--novice"], ["--criterion", "mone"]):
        args = ["plan", str(tmp_path / "old.safetensors"), "--keep", "0.5", "--out", str(tmp_path / "p.json")]
        args += ["--criterion", "reap"] if "--criterion" not in extra else []
        assert main(args + extra) == 2
        err = capsys.readouterr().err
        assert "re-run `moetailor calibrate`" in err and len(err.strip().splitlines()) == 1
    assert main(["plan", str(tmp_path / "old.safetensors"), "--criterion", "reap", "--keep", "0.5",
                 "--out", str(tmp_path / "p.json")]) == 0
