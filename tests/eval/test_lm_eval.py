"""lm-evaluation-harness against a real `moetailor serve reference` process, with the task YAMLs the
package ships (eval/lm_eval_tasks): a generation task (local-completions and
local-chat-completions) whose answers equal the engine's own greedy outputs, and a multiple-choice
task (loglikelihood via echo + logprobs) whose per-choice loglikelihoods equal a transformers
forward of the same model."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the test extras: pip install -e '.[test]'")

from moetailor.eval import lm_eval_tasks  # noqa: E402
from moetailor.eval.user_tasks import load_user_tasks  # noqa: E402
from moetailor.models import load_model, load_tokenizer  # noqa: E402
from moetailor.models.chat import chat_prompt  # noqa: E402
from moetailor.serving import LLM, SamplingParams  # noqa: E402

# a server process, lm-eval and the engine on the same CPUs: ~90 s here under load (two cores shared)
pytestmark = pytest.mark.slow

TASKS_DIR = os.path.dirname(lm_eval_tasks.__file__)
LIMIT = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moetailor.cli.main", "serve", "reference", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 240
        while True:
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, log.read_text()
            assert time.time() < deadline, "moetailor serve did not start: " + log.read_text()
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def reference():
    return load_model("reference"), load_tokenizer("reference")


def evaluate(model: str, base_url: str, task: str, **kwargs) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    args = f"base_url={base_url},model=reference,num_concurrent=4,max_retries=1,max_length=1024"
    return simple_evaluate(model=model, model_args=args, tasks=[task], limit=LIMIT, log_samples=True,
                           task_manager=TaskManager(include_path=TASKS_DIR), **kwargs)


def test_generation_task_through_completions_and_chat(server, reference):
    model, tok = reference
    examples = load_user_tasks(os.path.join(TASKS_DIR, "addition.jsonl"))[0].examples(LIMIT)
    chat = [chat_prompt(tok, [{"role": "user", "content": ex.prompt}]) for ex in examples]
    outs = LLM(model, tokenizer=tok).generate([ex.prompt for ex in examples] + chat,
                                              SamplingParams(max_tokens=162, temperature=0.0))
    engine = {"local-completions": [o.text for o in outs[:LIMIT]], "local-chat-completions": [o.text for o in outs[LIMIT:]]}
    for name, url, extra in [("local-completions", "/v1/completions", {}),
                             ("local-chat-completions", "/v1/chat/completions", {"apply_chat_template": True})]:
        result = evaluate(name, server + url, "moetailor_addition", **extra)
        samples = sorted(result["samples"]["moetailor_addition"], key=lambda s: s["doc_id"])
        assert [s["resps"][0][0] for s in samples] == engine[name], name
        accuracy = sum(ex.is_correct(text) for ex, text in zip(examples, engine[name])) / LIMIT
        assert result["results"]["moetailor_addition"]["exact_match,answer"] == pytest.approx(accuracy), name
    # the bundled model's chat template is its bare prompt: both routes answer alike, and mostly right
    assert engine["local-chat-completions"] == engine["local-completions"]
    assert sum(ex.is_correct(text) for ex, text in zip(examples, engine["local-completions"])) > LIMIT // 2


def test_multiple_choice_loglikelihoods_equal_transformers(server, reference):
    model, tok = reference
    result = evaluate("local-completions", server + "/v1/completions", "moetailor_reverse_mc")
    samples = result["samples"]["moetailor_reverse_mc"]
    assert len(samples) == LIMIT
    correct = 0
    for s in samples:
        context = s["doc"]["prompt"] + "####"
        scores = []
        for resp, choice in zip(s["resps"], s["doc"]["choices"]):
            got = resp[0][0]                                        # (loglikelihood, is_greedy) per choice
            ctx = tok.encode(context, add_special_tokens=False)
            whole = tok.encode(context + " " + choice, add_special_tokens=False)
            assert whole[:len(ctx)] == ctx
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=torch.tensor([whole])).logits[0].float(), -1)
            want = sum(logp[t - 1, whole[t]].item() for t in range(len(ctx), len(whole)))
            assert got == pytest.approx(want, abs=1e-3)
            scores.append(want)
        correct += max(range(len(scores)), key=scores.__getitem__) == s["doc"]["label"]
    assert result["results"]["moetailor_reverse_mc"]["acc,none"] == pytest.approx(correct / LIMIT)
