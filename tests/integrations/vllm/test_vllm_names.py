"""The registry of vLLM names (``integrations/vllm/names.py``) against the facts recorded from each
supported release's sources (``vllm_names.json``, written by ``scripts/vllm_names.py``). Imports no
vLLM: runs in moetailor's main environment. With ``MOETAILOR_VLLM_WHEELS`` naming a folder of vLLM
wheels, it also reads them again and compares."""
from __future__ import annotations

import importlib.util
import json
import os
import zipfile
from pathlib import Path

import pytest

from moetailor.integrations.vllm import names as N

ROOT = Path(__file__).resolve().parents[3]


def _script():
    spec = importlib.util.spec_from_file_location("vllm_names_script", ROOT / "scripts" / "vllm_names.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FACTS = json.loads(N.FACTS.read_text())


def test_the_facts_cover_exactly_the_supported_versions_and_the_registry():
    assert sorted(FACTS) == sorted(N.SUPPORTED)
    for version, facts in FACTS.items():
        assert sorted(facts) == sorted(N.BY_KEY), f"{version}: rerun scripts/vllm_names.py (the registry changed)"


@pytest.mark.parametrize("version", sorted(N.SUPPORTED))
def test_every_name_the_plugin_needs_is_in_each_supported_version(version):
    facts = FACTS[version]
    missing = [e.key for e in N.REGISTRY if N.required(e, N.generations(version)) and facts[e.key] is None]
    assert not missing, f"vLLM {version} lacks {missing}"
    for e in N.REGISTRY:
        fact = facts[e.key]
        if fact is not None and e.params and "params" in fact:
            assert tuple(fact["params"][:len(e.params)]) == e.params, (version, e.key, fact["params"])


@pytest.mark.parametrize("version", sorted(N.SUPPORTED))
def test_the_runner_generations_listed_are_those_each_version_ships(version):
    loaders = {"v1": f"{N.V1_RUNNER}:GPUModelRunner.load_model", "v2": f"{N.V2_RUNNER}:GPUModelRunner.load_model"}
    shipped = {g for g, key in loaders.items() if FACTS[version][key] is not None}
    assert shipped == set(N.SUPPORTED[version])


def test_0_34_moved_the_runner_and_dropped_prepare_inputs():
    facts = FACTS["0.34.0"]
    assert facts[f"{N.V1_RUNNER}:GPUModelRunner._prepare_inputs"] is None
    assert facts[f"{N.V2_RUNNER}:GPUModelRunner.load_model"]["where"].startswith("vllm/v1/worker/gpu/model_runner.py:")
    assert facts[f"{N.V2_STATE}:ModelState.add_request"]["params"][:3] == ["self", "req_index", "new_req_data"]


def _wheel(tmp_path: Path, files: dict[str, str]) -> Path:
    path = tmp_path / "vllm-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def test_the_script_finds_methods_fields_bases_and_reexports_in_a_wheel(tmp_path):
    script = _script()
    wheel = _wheel(tmp_path, {
        "vllm/__init__.py": "", "vllm/_version.py": "__version__ = version = '9.9.9'\n",
        "vllm/base.py": "class Base:\n    def load_model(self, load_dummy_weights=False, *args, **kw):\n"
                        "        self.device = 1\n",
        "vllm/runner.py": "import vllm.base as b\nfrom vllm.base import Base as Reexported\n"
                          "class Runner(b.Base):\n    max_num_tokens: int = 0\n"
                          "    def _prepare_inputs(self, scheduler_output):\n        self.input_batch, x = 1, 2\n"
                          "    @property\n    def req_ids(self):\n        return []\n"
                          "    def create(self, layer):\n        layer.register_parameter('w13_weight', None)\n",
    })
    src = script.Sources(wheel)
    assert src.version() == "9.9.9"

    def fact(qualname, kind):
        return script.locate(src, N.VName("vllm.runner", qualname, kind, "reads"))

    assert fact("Runner.load_model", "method") == {"where": "vllm/base.py:2",
                                                   "params": ["self", "load_dummy_weights", "args", "kw"]}
    assert fact("Runner._prepare_inputs", "method")["params"] == ["self", "scheduler_output"]
    for field in ("device", "input_batch", "max_num_tokens", "req_ids"):
        assert fact(f"Runner.{field}", "attribute") is not None, field
    assert fact("Runner.w13_weight", "parameter") == {"where": "vllm/runner.py:11"}
    assert fact("Runner.requests", "attribute") is None
    assert fact("Reexported", "class") == {"where": "vllm/base.py:1"}
    assert fact("Missing", "class") is None


@pytest.mark.skipif(not os.environ.get("MOETAILOR_VLLM_WHEELS"), reason="MOETAILOR_VLLM_WHEELS (a folder of vLLM wheels) "
                    "not set: `pip download vllm==0.34.0 --no-deps -d DIR`")
def test_the_recorded_facts_are_what_the_wheels_say():
    script = _script()
    for wheel in sorted(Path(os.environ["MOETAILOR_VLLM_WHEELS"]).glob("vllm*.whl")):
        src = script.Sources(wheel)
        if src.version() in FACTS:
            assert script.facts(src) == FACTS[src.version()], wheel.name
