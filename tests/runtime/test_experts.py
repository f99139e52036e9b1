"""moetailor's experts implementation against stock transformers, bit for bit: the loop and the grouped
paths sum each token's routes as transformers does (top-k order, one sum, one rounding), so a
calibration or evaluation forward through the routing controller is the stock model's forward, in fp32
and in bf16."""
from __future__ import annotations

import copy

import pytest
import torch

from moetailor.models.tiny import TINY_ARCHITECTURES, tiny_model
from moetailor.routing import RoutingController
from moetailor.runtime.step import Step, experts_read_buffer, running


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", TINY_ARCHITECTURES)
def test_controller_forward_is_the_stock_forward(arch, dtype):
    model = tiny_model(arch, seed=2).to(dtype)
    stock = copy.deepcopy(model)                     # transformers' own classes and experts implementation
    ids = torch.randint(2, 96, (3, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = stock(input_ids=ids).logits
        ctl = RoutingController.of(model)
        with ctl.policy(None):                       # calibration's and evaluation's step: the experts loop
            loop = model(input_ids=ids).logits
        step = Step(is_prefill=True, experts="grouped", experts_read=experts_read_buffer(len(model.model.layers)))
        with running(step):
            grouped = model(input_ids=ids).logits
    assert stock.config._experts_implementation != model.config._experts_implementation   # two implementations
    torch.testing.assert_close(loop, want, rtol=0, atol=0)
    torch.testing.assert_close(grouped, want, rtol=0, atol=0)
