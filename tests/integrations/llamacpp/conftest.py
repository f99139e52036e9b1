"""Fixtures of the llama.cpp integration tests (helpers: llamacpp_helpers.py): the bundled model exported
full and pruned by the real `moetailor export gguf`, and moetailor's engine on the same weights."""
from __future__ import annotations

import json

import pytest
from llamacpp_helpers import ASSETS, BUNDLED_PLAN, task_prompts, with_config


@pytest.fixture(scope="session")
def prompts():
    return task_prompts()


@pytest.fixture(scope="session")
def plans(tmp_path_factory):
    """The bundled decode plan cut to its first 16 kept experts per layer (a quarter of 64: the 50% plan
    leaves these prompts' greedy outputs unchanged, and a plan that changes nothing could not make an
    equality test fail), as a decode-only plan (phase-aware) and for both phases (a pruned model)."""
    data = json.loads(BUNDLED_PLAN.read_text())
    for layer in data["decode"].values():
        layer["keep"] = layer["keep"][:16]
    root = tmp_path_factory.mktemp("plans")
    (root / "quarter.json").write_text(json.dumps(data))
    (root / "quarter-both.json").write_text(json.dumps({**data, "prefill": data["decode"]}))
    return {"decode": root / "quarter.json", "both": root / "quarter-both.json"}


@pytest.fixture(scope="session")
def exported(tmp_path_factory, plans):
    """The bundled model as GGUF files written by the CLI: full (f32, bf16, q8_0) and pruned (f32)."""
    from moetailor.cli.main import main

    root = tmp_path_factory.mktemp("gguf")
    files = {}
    for outtype in ("f32", "bf16", "q8_0"):
        files[outtype] = root / f"reference-{outtype}.gguf"
        assert main(["export", "gguf", "reference", "--outtype", outtype, "--allow-routing-difference",
                     "--out", str(files[outtype])]) == 0
    files["pruned"] = root / "reference-quarter.gguf"
    assert main(["export", "gguf", "reference", "--plan", str(plans["decode"]), "--allow-routing-difference",
                 "--out", str(files["pruned"])]) == 0
    return files


@pytest.fixture(scope="session")
def unnormalised(tmp_path_factory):
    """The bundled weights with norm_topk_prob=false: the function llama.cpp's qwen2moe graph computes
    from them (it never renormalises the top-k weights)."""
    return with_config(ASSETS / "reference", tmp_path_factory.mktemp("ref") / "unnormalised", norm_topk_prob=False)
