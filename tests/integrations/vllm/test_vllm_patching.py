"""``apply_patches`` on the vLLM on the path, in a fresh process: the version check passes and every
registered method the plugin wraps for this version's runner generations is wrapped. Runs on 0.32.0
in ``.venv-vllm``; with an unpacked 0.33.0 or 0.34.0 wheel first on ``PYTHONPATH`` it runs the real
patching on those releases' classes (their pure-Python modules import without a GPU; no engine
starts):

    PYTHONPATH=/tmp/vllm34:src .venv-vllm/bin/python -m pytest tests/integrations/vllm/test_vllm_patching.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from vllm_helpers import SKIP_REASON

pytest.importorskip("vllm", reason=SKIP_REASON)

PROBE = r"""
import importlib, json
import vllm
from moetailor.integrations.vllm import names as N
from moetailor.integrations.vllm.patches import apply_patches, vllm_version
from moetailor.integrations.vllm.runners import adapters_for

def depths(gens):
    out = {}
    for e in N.REGISTRY:
        if e.use != "wraps" or (e.runner is not None and e.runner not in gens) or e.owner == "ModelState":
            continue
        try:
            cls = getattr(importlib.import_module(e.module), e.owner)
        except ImportError:
            continue
        fn, depth = getattr(cls, e.qualname.rpartition(".")[2]), 0
        while hasattr(fn, "__wrapped__"):
            fn, depth = fn.__wrapped__, depth + 1
        out[e.key] = depth
    return out

gens = [a.generation for a in adapters_for(vllm_version())]
before = depths(gens)
apply_patches()
apply_patches()   # idempotent: vLLM may call register more than once
out = {"version": vllm_version(), "generations": gens, "before": before, "after": depths(gens)}
print("PROBE" + json.dumps(out))
"""


def test_apply_patches_wraps_every_registered_method_once():
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.split("PROBE", 1)[1])
    from moetailor.integrations.vllm import names as N

    assert out["version"] in N.SUPPORTED and out["generations"] == list(N.SUPPORTED[out["version"]])
    assert out["after"], out
    added = {k: out["after"][k] - out["before"][k] for k in out["after"]}
    assert all(n == 1 for n in added.values()), added
    loaders = {"v1": f"{N.V1_RUNNER}:GPUModelRunner.load_model", "v2": f"{N.V2_RUNNER}:GPUModelRunner.load_model"}
    for gen in out["generations"]:
        assert loaders[gen] in added, (gen, added)
