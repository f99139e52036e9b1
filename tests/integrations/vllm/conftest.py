"""Fixtures of the vLLM integration tests (helpers: vllm_helpers.py)."""
from __future__ import annotations

import pytest

from vllm_helpers import task_prompts


@pytest.fixture(scope="session")
def prompts():
    return task_prompts()
