"""Novice experts (MoNE): a dropped expert's route adds g * c_e, c_e its mean output. The engine
(native decode kernels and torch's ops) and the module path against transformers' stock forward with
hooks that add g * c_e themselves, on the bundled model."""
import shutil

import pytest
import torch

from moetailor.calibration import calibrate_batches
from moetailor.models import moe_layers
from moetailor.models.loading import load_model
from moetailor.plans.criteria import make_plan
from moetailor.routing import RoutingController
from moetailor.serving import LLM, SamplingParams


@pytest.fixture(scope="module")
def novice_plan(tmp_path_factory):
    model = load_model("reference")
    g = torch.Generator().manual_seed(0)
    stats = calibrate_batches(model, [torch.randint(2, 8000, (4, 64), generator=g) for _ in range(2)], progress=False)
    path = stats.save(tmp_path_factory.mktemp("novice") / "stats.safetensors")
    plan = make_plan(stats, model, "reap", keep=0.5, phase="both", stats_path=str(path), novice=True)
    return plan, stats


def hooked_reference(plan, stats):
    """The stock model (no moetailor controller) whose experts modules run only the kept experts and
    add g * c_e for each route to a dropped one: routes rewritten before, constants added after."""
    model = load_model("reference")
    model.set_experts_implementation("eager")   # transformers' loop, which skips sentinel routes (index E)
    for layer in moe_layers(model):
        keep = torch.zeros(layer.num_experts, dtype=torch.bool)
        keep[list(plan.decode.for_layer(layer.index).keep)] = True
        mean = stats.layers[layer.index].mean_output.float()
        seen = {}

        def before(module, args, kwargs, keep=keep, mean=mean, seen=seen):
            hidden, index, weights = args
            dropped = ~keep[index]
            seen["constant"] = torch.einsum("tk,tkh->th", weights.float() * dropped, mean[index])
            return (hidden, index.masked_fill(dropped, len(keep)), weights.masked_fill(dropped, 0)), kwargs

        def after(module, args, kwargs, out, seen=seen):
            return out + seen.pop("constant").to(out.dtype)
        layer.experts.register_forward_pre_hook(before, with_kwargs=True)
        layer.experts.register_forward_hook(after, with_kwargs=True)
    return model


def test_novice_forward_equals_hooked_stock_forward(novice_plan):
    plan, stats = novice_plan
    ids = torch.randint(2, 8000, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hooked_reference(plan, stats)(input_ids=ids).logits
        model = load_model("reference")
        from moetailor.plans.techniques import attach_plan_fold_tables
        attach_plan_fold_tables(model, plan)
        ctl = RoutingController.of(model)
        with ctl.policy(plan.decode):
            got = model(input_ids=ids).logits
        full = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got - full).abs().max() > 1e-2     # the plan changes the model


@pytest.mark.parametrize("native", [True, False] if shutil.which("g++") or shutil.which("c++") else [False])
def test_engine_novice_decode_equals_hooked_generate(novice_plan, native):
    plan, stats = novice_plan
    reference = hooked_reference(plan, stats)
    prompts = [torch.randint(2, 8000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 19)]
    want = [reference.generate(torch.tensor([p]), max_new_tokens=10, min_new_tokens=10, do_sample=False,
                               pad_token_id=1)[0, len(p):].tolist() for p in prompts]
    llm = LLM("reference", plan, max_num_seqs=4, native_kernels=native)
    got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))]
    assert got == want
    E = moe_layers(llm.model)[0].num_experts
    reads = [max(r.distinct_experts.values()) for r in llm.step_log if r.phase == "decode"]
    assert reads and max(reads) <= E // 2          # dropped experts' weights are never read


def test_novice_plan_without_constants_says_so(novice_plan):
    plan, _ = novice_plan
    model = load_model("reference")
    with pytest.raises(ValueError, match="no constants were loaded"):
        RoutingController.of(model).compile(plan.decode)
