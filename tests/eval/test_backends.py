"""The vLLM evaluator's checks that need no server: eval/backends.py."""
from __future__ import annotations

import pytest

from moetailor.eval.backends import require_novice


def test_a_novice_plan_on_a_server_without_novice_constants_names_the_fix():
    """A server started without --vllm-novice would answer the plan switch 400 mid-run: refused in one
    line naming the plan, the server and the flag that fixes it."""
    with pytest.raises(ValueError) as e:
        require_novice({"novice": False, "name": "m"}, "http://127.0.0.1:8000", "reference", "--plan p.json")
    msg = str(e.value)
    assert len(msg.splitlines()) == 1, msg
    for words in ("--plan p.json", "novice experts", "http://127.0.0.1:8000",
                  "moetailor serve reference --backend vllm --vllm-no-prefix-caching --vllm-novice"):
        assert words in msg, msg
    require_novice({"novice": True, "name": "m"}, "http://127.0.0.1:8000", "reference", "--plan p.json")
