"""The routing controller rides on torch's forward hooks: nothing written onto transformers' modules,
the stock output standing where no step asks for more, a copied model a stock model."""
import copy

import torch

from moetailor.models.adapters import moe_layers
from moetailor.models.tiny import tiny_model
from moetailor.routing import LayerPolicy, PhasePolicy, RoutingController
from moetailor.runtime.experts import INSTALLED


def test_the_controller_leaves_transformers_classes_and_attributes_alone():
    model = tiny_model("qwen3_moe", seed=1)
    before = {name: (type(m), set(vars(m))) for name, m in model.named_modules()}
    ids = torch.tensor([[3, 9, 4, 1, 7]])
    with torch.no_grad():
        stock = model(input_ids=ids).logits
    ctl = RoutingController.of(model)
    assert RoutingController.of(model) is ctl
    after = {name: (type(m), set(vars(m))) for name, m in model.named_modules()}
    assert {n: c for n, (c, _) in after.items()} == {n: c for n, (c, _) in before.items()}   # no class swapped
    assert not any(a.startswith("_moetailor") for _, attrs in after.values() for a in attrs)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, stock)             # no step: the stock routes stand
        with ctl.policy(PhasePolicy({l.index: LayerPolicy(top_k=1) for l in ctl.layers})):
            assert not torch.equal(model(input_ids=ids).logits, stock)     # a step's policy applies
    ctl.remove()
    assert RoutingController.installed(model) is None and not any(m._forward_hooks for m in model.modules())
    assert not any(l.experts in INSTALLED for l in moe_layers(model))


def test_a_copied_model_is_stock_until_it_gets_its_own_controller():
    model = tiny_model("qwen2_moe", seed=1)
    ctl = RoutingController.of(model)
    twin = copy.deepcopy(model)
    assert RoutingController.installed(twin) is None
    seen = []
    with ctl.observing(lambda *route: seen.append("original")):
        twin(input_ids=torch.tensor([[1, 2, 3]]))
    assert seen == []                                                     # the copy's hooks do nothing
    with RoutingController.of(twin).observing(lambda *route: seen.append("twin")):
        twin(input_ids=torch.tensor([[1, 2, 3]]))
    assert seen == ["twin"] * len(moe_layers(twin))                       # once per layer, not twice
