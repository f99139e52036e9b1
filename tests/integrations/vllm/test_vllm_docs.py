"""docs/vllm.md's Python example runs as written (from the repository root, vLLM's default mode)
and prints what moetailor's engine generates for the same requests."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_helpers import SKIP_REASON

pytest.importorskip("vllm", reason=SKIP_REASON)

ROOT = Path(__file__).resolve().parents[3]


def test_docs_python_example_runs_and_equals_engine(tmp_path):
    from moetailor.plans import Plan
    from moetailor.serving import LLM, SamplingParams

    text = (ROOT / "docs" / "vllm.md").read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    assert "additional_config" in block and "enforce_eager" not in block
    script = tmp_path / "example.py"
    script.write_text(block)
    r = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    engine = LLM("reference", Plan.load(ROOT / "src/moetailor/assets/plans/reference-reap-50.json").phase_aware())
    outs = engine.generate(["add 12 + 34", "sort 3 1 2", "reverse abc"],
                           [SamplingParams(max_tokens=32, temperature=0, expert_top_k=k) for k in (2, 4, None)])
    assert "".join(o.text + "\n" for o in outs) in r.stdout, r.stdout[-2000:]
