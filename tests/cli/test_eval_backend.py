"""`eval`/`tune --backend vllm`: the refusals that come before any model loads (in moetailor's main
environment, which has no vLLM), and the backend interface on the embedded engine. The vLLM side
runs in tests/integrations/vllm/test_vllm_evaluator.py (`make test-vllm`)."""
from __future__ import annotations

import http.server
import importlib.util
import threading

import pytest

from moetailor.cli.main import main

NO_VLLM = importlib.util.find_spec("vllm") is None


def one_line_error(capsys, argv, *needles) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err
    return err


@pytest.mark.skipif(not NO_VLLM, reason="checks the refusal where vLLM is missing")
@pytest.mark.parametrize("verb", ["eval", "tune"])
def test_backend_vllm_without_vllm_names_the_setup(verb, tmp_path, capsys, monkeypatch):
    import moetailor.models as models

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the backend was refused")

    monkeypatch.setattr(models, "load_model", no_load)
    extra = ["--plan", "x.json"] if verb == "eval" else ["--max-kl", "1", "--servable", "vllm"]
    one_line_error(capsys, [verb, "reference", *extra, "--backend", "vllm", "--out", str(tmp_path / "o")],
                   "make setup-vllm", ".venv-vllm/bin/moetailor")
    assert not (tmp_path / "o").exists()


def test_vllm_url_that_does_not_answer(tmp_path, capsys):
    import socket

    with socket.socket() as s:          # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    one_line_error(capsys, ["eval", "reference", "--configs", "baseline", "--backend", "vllm", "--vllm-url",
                            f"http://127.0.0.1:{port}", "--out", str(tmp_path / "o")],
                   "does not answer", "moetailor serve reference --backend vllm")
    assert not (tmp_path / "o").exists()


def test_vllm_url_of_a_server_without_the_plugin(tmp_path, capsys):
    """Any HTTP server that is not vLLM with moetailor's middleware (here: Python's file server)."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        one_line_error(capsys, ["tune", "reference", "--max-kl", "1", "--servable", "vllm", "--backend", "vllm",
                                "--vllm-url", f"http://127.0.0.1:{server.server_address[1]}",
                                "--out", str(tmp_path / "o")],
                       "is not a vLLM server with moetailor's plugin", "--backend vllm")
    finally:
        server.shutdown()
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("argv, words", [
    (["eval", "reference", "--configs", "baseline", "--vllm-url", "http://x"], "pass it with --backend vllm"),
    (["tune", "reference", "--max-kl", "1", "--vllm-url", "http://x"], "pass it with --backend vllm"),
])
def test_vllm_url_without_backend_vllm(argv, words, tmp_path, capsys):
    one_line_error(capsys, [*argv, "--out", str(tmp_path / "o")], words)


def test_engine_backend_is_what_eval_ran(tmp_path):
    """The interface on the embedded engine: generation equals the engine's own, the held-out score
    equals the scorer's, and the plan is reset after each call."""
    from moetailor.eval.backends import EngineBackend
    from moetailor.eval.metrics import HeldoutScorer
    from moetailor.models import load_model, load_tokenizer
    from moetailor.models.paths import resolve_model_path
    from moetailor.plans import Plan
    from moetailor.serving import LLM, SamplingParams

    model, tok = load_model("reference"), load_tokenizer("reference")
    plan = Plan.load(resolve_model_path("reference").parent / "plans" / "reference-reap-50.json")
    prompts = ["add 12 + 30 =", "reverse abc ="]
    params = [SamplingParams(max_tokens=8, temperature=0.0)] * 2
    backend = EngineBackend(model, tok, max_num_seqs=4)
    got = backend.generate(plan, prompts, params)
    want = LLM(model, tokenizer=tok, plan=plan).generate(prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert backend.llm.plan is None
    windows = [tok("the quick brown fox jumps over the lazy dog " * 4)["input_ids"][:32]]
    phase_aware = plan.phase_aware()
    assert backend.heldout(phase_aware, windows) == HeldoutScorer(model, windows).score(None, phase_aware.decode)
    assert backend.heldout(None, windows).kl == 0.0


def test_tune_novice_on_a_server_without_novice_constants_names_the_fix(tmp_path, capsys, monkeypatch):
    """`tune --novice` against a server of the right model that was started without --vllm-novice (here a
    stand-in answering the middleware's two routes): one line naming --vllm-novice, before any model loads."""
    import json

    import moetailor.models as models
    from moetailor.integrations.vllm.plan import checkpoint_fingerprint
    from moetailor.models.paths import resolve_model_path

    answers = {"/moetailor/fingerprint": {"fingerprint": checkpoint_fingerprint(resolve_model_path("reference")),
                                          "model": "reference", "prefix_caching": False, "novice": False},
               "/v1/models": {"data": [{"id": "reference"}]}}

    class Middleware(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(answers[self.path]).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the server was refused")

    monkeypatch.setattr(models, "load_model", no_load)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Middleware)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        one_line_error(capsys, ["tune", "reference", "--max-kl", "1", "--budget", "0.5", "--servable", "vllm",
                                "--backend", "vllm", "--vllm-url", f"http://127.0.0.1:{server.server_address[1]}",
                                "--novice", "--out", str(tmp_path / "o")],
                       "adds no novice constants", "--vllm-novice", "drop --novice")
    finally:
        server.shutdown()
    assert not (tmp_path / "o").exists()
