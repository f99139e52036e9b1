"""Fixtures of the vLLM integration tests (helpers: vllm_helpers.py)."""
from __future__ import annotations

import os

import pytest
from vllm_helpers import BUNDLED_PLAN, task_prompts

# the plugin's engine calls reach vLLM's workers as functions (moetailor.integrations.vllm.rpc); vLLM's
# engine processes read this when they start
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


@pytest.fixture(scope="session")
def prompts():
    return task_prompts()


@pytest.fixture(scope="session")
def quarter_plan(tmp_path_factory):
    """The bundled decode plan cut to its first 16 kept experts per layer (a quarter of 64). The
    task-calibrated 50% plan leaves these prompts' greedy outputs unchanged, and a plan that changes
    nothing could not make an equality test fail; this one changes them."""
    import json

    data = json.loads(BUNDLED_PLAN.read_text())
    for layer in data["decode"].values():
        layer["keep"] = layer["keep"][:16]
    path = tmp_path_factory.mktemp("plans") / "quarter.json"
    path.write_text(json.dumps(data))
    return path
