"""Where `eval` and `tune` run their candidate plans: one interface, two engines.

  * ``EngineBackend``: moetailor's embedded engine on the model in memory (generation) and the
    model's own forward (held-out KL), as `eval` has always run;
  * ``VLLMBackend``: one vLLM engine with moetailor's plugin, either ``vllm.LLM`` in this process
    (the interpreter has vLLM: ``.venv-vllm``) or a running ``vllm serve`` at ``--vllm-url``. The
    engine starts once with the full router and switches plans between candidates
    (``integrations.vllm.rpc.use_plan``), so whatever vLLM runs on scores the plans. Novice plans
    switch in where the engine adds novice constants (``novice``: in-process when asked, a server
    started with ``--vllm-novice``). A merged plan is another checkpoint, which no plan switch gives:
    its callers score it on the embedded engine (``serving.disagg``).

Both answer ``generate(plan, prompts, params)`` (moetailor ``SamplingParams``; outputs with ``text``,
``token_ids``, ``finish_reason``) and ``heldout(plan, windows)`` (KL from the full model and
perplexity, the window's first half under the plan's prefill policy and the rest under its decode
policy). vLLM gives the held-out log-probabilities as prompt logprobs over the whole vocabulary, the
second half marked as decode tokens (``moetailor_decode_from``); prompts go as token ids and text is
decoded here, with the engine's EOS ids as stop tokens, so a greedy vLLM output is compared with the
engine's on the same tokens.
"""
from __future__ import annotations

import importlib.util
import math
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..tables import unknown_choice

BACKENDS = ("engine", "vllm")
VLLM_SETUP = "run `make setup-vllm` and use .venv-vllm/bin/moetailor"


@dataclass
class Completion:
    """A generated completion as the scorers read it (the engine's RequestOutput has the same fields)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None


def check_backend(backend: str, vllm_url: str | None, model: str | Path | None = None,
                  plan: str | Path | None = None) -> dict | None:
    """Refuse, before any model loads, a backend this environment cannot run, a server that does not
    answer or serves another model than ``model``, or a ``plan`` file with novice experts that the server
    cannot switch in (one line each). Answers the server's record (``server_info``) for a ``vllm_url``,
    else None."""
    if backend not in BACKENDS:
        raise ValueError(unknown_choice("--backend", backend, BACKENDS))
    if vllm_url and backend != "vllm":
        raise ValueError("--vllm-url is the address of a vLLM server; pass it with --backend vllm")
    if backend == "vllm" and not vllm_url and importlib.util.find_spec("vllm") is None:
        raise ValueError(f"--backend vllm needs vLLM in this environment: {VLLM_SETUP} (or pass --vllm-url URL of a "
                         "running `moetailor serve MODEL --backend vllm`)")
    if backend == "vllm" and vllm_url:
        served = server_info(vllm_url, model)
        if plan is not None and Path(plan).is_file():
            from ..plans import Plan
            if Plan.load(plan).needs_constants:
                require_novice(served, vllm_url, model, f"--plan {plan}")
        return served
    return None


def require_novice(served: dict, url: str, model: str | Path | None, what: str) -> None:
    """Refuse ``what``, which replaces dropped experts by their constants, on a server (``served``: its
    ``server_info``) whose engine adds none: its plan switch would be answered 400 mid-run."""
    if not served.get("novice"):
        raise ValueError(f"{what} replaces dropped experts by constants (novice experts), which the vLLM server at "
                         f"{url} does not add; restart it with `moetailor serve {model or 'MODEL'} --backend vllm "
                         "--vllm-no-prefix-caching --vllm-novice`")


class EngineBackend:
    """moetailor's engine (generation) and the in-memory model's forward (held-out KL)."""

    name = "engine"
    novice = True      # novice plans run (the engine adds each replaced expert's constant)

    def __init__(self, model, tokenizer, max_num_seqs: int = 64):
        self.model, self.tokenizer, self.max_num_seqs = model, tokenizer, max_num_seqs
        self._llm = None
        self._scorers: dict[int, object] = {}

    @property
    def llm(self):
        if self._llm is None:
            from ..serving import LLM
            self._llm = LLM(self.model, tokenizer=self.tokenizer, max_num_seqs=self.max_num_seqs)
        return self._llm

    @property
    def max_model_len(self) -> int:
        return self.llm.max_model_len

    def generate(self, plan, prompts: list[str], params: list) -> list:
        self.llm.set_plan(plan)
        try:
            return self.llm.generate(prompts, params)
        finally:
            self.llm.set_plan(None)

    def scorer(self, windows: list[list[int]]):
        """The held-out scorer of these windows (the full model's predictions computed once)."""
        from .metrics import HeldoutScorer
        key = id(windows)
        if key not in self._scorers:
            self._scorers[key] = HeldoutScorer(self.model, windows)
        return self._scorers[key]

    def heldout(self, plan, windows: list[list[int]]):
        from ..plans.techniques import attach_plan_fold_tables
        if plan is None:
            return self.scorer(windows).score(None, None)
        attach_plan_fold_tables(self.model, plan)   # as the engine does for its generation cells
        return self.scorer(windows).score(*(None if p.is_identity else p for p in (plan.prefill, plan.decode)))

    def close(self) -> None:
        self._llm = None


class VLLMBackend:
    """One vLLM engine with moetailor's plugin, in this process or at ``url``; plans are switched on
    it between calls. ``model`` is the model in memory (its fingerprint and EOS ids), ``path`` its
    checkpoint directory (or bundled name)."""

    name = "vllm"

    def __init__(self, model, tokenizer, path: str | Path, *, url: str | None = None, max_num_seqs: int = 64,
                 novice: bool = True):
        from ..models.paths import resolve_model_path
        from ..runtime.runner import default_max_model_len
        from ..serving.llm import eos_token_ids

        self.model, self.tokenizer, self.path, self.url = model, tokenizer, resolve_model_path(path), url
        self.max_num_seqs, self.max_model_len = max_num_seqs, default_max_model_len(model.config)
        self.vocab = int(model.config.vocab_size)
        self.stop_ids = sorted(eos_token_ids(model, tokenizer))   # what the embedded engine stops on
        # vLLM computes in the dtype of the model in memory, the one the engine would score in (tune's --dtype)
        self.dtype = str(next(model.parameters()).dtype).replace("torch.", "")
        self._tmp = tempfile.TemporaryDirectory(prefix="moetailor-vllm-plans-")
        self._plan_key: str | None = "unset"
        self._llm = None
        self._references: dict[int, list[torch.Tensor]] = {}
        self.client = RemoteVLLM(url, path) if url else None   # checks the server (one line when it does not answer)
        # whether novice plans switch in: the in-process engine adds novice constants on every MoE layer
        # when asked (``novice``), a server when it was started with --vllm-novice
        self.novice = self.client.novice if url else novice

    # -- the engine --------------------------------------------------------------------------------
    @property
    def llm(self):
        if self._llm is None:
            from ..integrations.vllm.launch import engine_kwargs
            from ..integrations.vllm.rpc import SERIALIZATION_ENV

            os.environ.setdefault(SERIALIZATION_ENV, "1")   # plan switches reach the workers as functions
            from vllm import LLM
            kwargs = engine_kwargs(self.path, dtype=self.dtype, novice=self.novice, enable_prefix_caching=False,
                                   max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                                   max_logprobs=self.vocab, seed=0, disable_log_stats=True)
            self._llm = LLM(**kwargs)
        return self._llm

    def use_plan(self, plan) -> None:
        """Route the engine's next requests by ``plan`` (None: the full router)."""
        from ..plans.plan import plan_hash
        key = None if plan is None else plan_hash(plan)
        if key == self._plan_key:
            return
        if plan is not None and plan.fold_stats:
            plan = replace(plan, fold_stats=str(Path(plan.fold_stats).absolute()))   # read where the engine runs
        if self.url:
            self.client.use_plan(None if plan is None else plan.to_json())
        else:
            from ..integrations.vllm.rpc import call, use_plan
            path = None if plan is None else str(plan.save(Path(self._tmp.name) / f"{key}.json"))
            call(self.llm, use_plan, path, "plan")
        self._plan_key = key

    # -- generation --------------------------------------------------------------------------------
    def generate(self, plan, prompts: list[str], params: list) -> list[Completion]:
        from ..serving.validation import encode_prompt

        self.use_plan(plan)
        ids = [encode_prompt(self.tokenizer, p)[1] for p in prompts]
        if self.url:
            raw = self.client.generate(ids, [self._request(p) for p in params])
        else:
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt

            outs = self.llm.generate([TokensPrompt(prompt_token_ids=i) for i in ids],
                                     [SamplingParams(**self._request(p)) for p in params], use_tqdm=False)
            raw = [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]
        return [Completion(self.tokenizer.decode(t, skip_special_tokens=True), t, reason) for t, reason in raw]

    def _request(self, p) -> dict:
        """vLLM's sampling parameters for a moetailor ``SamplingParams``."""
        if p.stop or p.logprobs is not None or p.prompt_logprobs is not None:
            raise ValueError("the vLLM evaluator takes max_tokens, temperature, top_p, top_k, seed and expert_top_k")
        kw = dict(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, seed=p.seed,
                  ignore_eos=p.ignore_eos, stop_token_ids=self.stop_ids)
        if p.top_k:
            kw["top_k"] = p.top_k
        if p.expert_top_k is not None:
            kw["extra_args"] = {"expert_top_k": p.expert_top_k}
        return kw

    # -- held-out KL -------------------------------------------------------------------------------
    def _logprobs(self, windows: list[list[int]], split: int) -> list[torch.Tensor]:
        """Per window: log-probabilities [T - split, V] predicting tokens split.. (the prefix under the
        prefill policy, positions from ``split`` on under the decode policy)."""
        from ..integrations.vllm.plan import DECODE_FROM

        if self.url:
            return self.client.prompt_logprobs(windows, split, self.vocab)
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # flat (a few lists per request, not a dict of Logprob objects per position) and not detokenized:
        # the vocabulary's logprobs at every position, read as arrays
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=self.vocab, flat_logprobs=True,
                                detokenize=False, extra_args={DECODE_FROM: split})
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows], params, use_tqdm=False)
        return [dense_flat_logprobs(o.prompt_logprobs, split, self.vocab) for o in outs]

    def heldout(self, plan, windows: list[list[int]]):
        from .metrics import HeldoutScore, kl_divergence

        split = len(windows[0]) // 2
        key = id(windows)
        if key not in self._references:
            self.use_plan(None)
            self._references[key] = self._logprobs(windows, split)
        self.use_plan(plan)
        got = self._logprobs(windows, split) if plan is not None else self._references[key]
        kl_sum, nll_sum, n = 0.0, 0.0, 0
        for w, ref, logp in zip(windows, self._references[key], got):
            target = torch.tensor(w[split:])
            kl_sum += float(kl_divergence(ref, logp).sum())
            nll_sum += float(-logp.gather(-1, target[:, None]).sum())
            n += len(target)
        return HeldoutScore(kl=max(kl_sum / n, 0.0), perplexity=math.exp(nll_sum / n), tokens=n)

    def close(self) -> None:
        if self._llm is not None:
            self._llm.llm_engine.engine_core.shutdown()
            self._llm = None
        self._tmp.cleanup()


def dense_logprobs(positions, vocab: int) -> torch.Tensor:
    """vLLM's prompt logprobs (per position a mapping token id -> Logprob or float) -> [T, V]."""
    out = torch.full((len(positions), vocab), float("-inf"))
    for row, entry in enumerate(positions):
        if entry is None:
            raise ValueError("vLLM returned no prompt logprobs for a held-out position")
        for token, lp in entry.items():
            out[row, int(token)] = float(getattr(lp, "logprob", lp) if not isinstance(lp, dict) else lp["logprob"])
    if torch.isinf(out).any():
        raise ValueError(f"vLLM returned fewer than the vocabulary's {vocab} prompt logprobs per position; start it "
                         f"with --max-logprobs {vocab} (or -1)")
    return out


def dense_flat_logprobs(flat, start: int, vocab: int) -> torch.Tensor:
    """vLLM's ``FlatLogprobs`` of a prompt (flat lists: token ids and logprobs, per position a
    [start, end) range) -> [T - start, V] for positions start..T-1."""
    begin, end = flat.start_indices[start], flat.end_indices[-1]
    if begin == end and len(flat) > start:
        raise ValueError("vLLM returned no prompt logprobs for a held-out position")
    counts = torch.tensor(flat.end_indices[start:]) - torch.tensor(flat.start_indices[start:])       # [T']
    rows = torch.repeat_interleave(torch.arange(len(counts)), counts)                                # [n]
    out = torch.full((len(counts), vocab), float("-inf"))
    out[rows, torch.tensor(flat.token_ids[begin:end])] = torch.tensor(flat.logprobs[begin:end])
    if torch.isinf(out).any():
        raise ValueError(f"vLLM returned fewer than the vocabulary's {vocab} prompt logprobs per position; start it "
                         f"with max_logprobs={vocab} (or -1)")
    return out


def server_info(url: str, model: str | Path | None = None) -> dict:
    """The fingerprint record of the moetailor-plugin vLLM server at ``url`` with its served model
    ``name`` added (``novice``: whether novice plans switch in, ``--vllm-novice``), checked to serve
    ``model`` (a bundled name or checkpoint directory; its router weights are compared, no model is
    loaded). One line when it does not answer, is not such a server, or serves another model."""
    import httpx

    from ..integrations.vllm.plan import checkpoint_fingerprint
    from ..models.loading import fingerprint_mismatch, resolve_model_path

    start = (f"start it with `moetailor serve {model or 'MODEL'} --backend vllm --vllm-no-prefix-caching` and pass "
             "its address")
    try:
        r = httpx.get(url.rstrip("/") + "/moetailor/fingerprint", timeout=10)
        names = httpx.get(url.rstrip("/") + "/v1/models", timeout=10)
    except (httpx.HTTPError, ValueError) as e:
        raise ValueError(f"--vllm-url {url} does not answer ({type(e).__name__}); {start}") from None
    if r.status_code != 200 or names.status_code != 200:
        raise ValueError(f"--vllm-url {url} is not a vLLM server with moetailor's plugin (/moetailor/fingerprint "
                         f"answered {r.status_code}); {start}")
    served = r.json()
    if served.get("prefix_caching"):
        raise ValueError(f"--vllm-url {url} serves with prefix caching on, which would hand blocks computed under one "
                         f"plan to the next; restart it with `moetailor serve {model or 'MODEL'} --backend vllm "
                         "--vllm-no-prefix-caching`")
    if model is not None:
        problem = fingerprint_mismatch(served["fingerprint"], checkpoint_fingerprint(resolve_model_path(model)))
        if problem:
            raise ValueError(f"--vllm-url {url} serves another model ({served.get('model')}: {problem}); {start}")
    return {**served, "name": names.json()["data"][0]["id"]}


# vLLM's API server closes a keep-alive connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s), and
# httpx's pool keeps one for 5 s too: a request sent on a pooled connection just as the server closes
# it is answered with a reset (httpx.ReadError / RemoteProtocolError). The client drops idle
# connections well before the server does, and sends a request again once if its connection was
# closed under it (every request here is idempotent: a plan switch, a greedy completion, prompt
# logprobs).
KEEPALIVE_S = 1.0


class RemoteVLLM:
    """A running ``vllm serve`` with moetailor's plugin and middleware (``moetailor serve --backend
    vllm`` starts one so): plans switched through the middleware's ``/moetailor/plan``, completions
    and prompt logprobs over the OpenAI API."""

    def __init__(self, url: str, model: str | Path):
        import httpx

        self.url = url.rstrip("/")
        served = server_info(url, model)
        self.served_name, self.novice = served["name"], bool(served.get("novice"))
        self.http = httpx.Client(timeout=None, limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S))

    def _post(self, path: str, body: dict) -> dict:
        import httpx

        try:
            r = self.http.post(self.url + path, json=body)
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError):   # closed under the request
            r = self.http.post(self.url + path, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"vLLM at {self.url}{path} answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def use_plan(self, plan_json: dict | None) -> None:
        self._post("/moetailor/plan", {"plan": plan_json})

    def _complete(self, body: dict) -> dict:
        return self._post("/v1/completions", {"model": self.served_name, **body})["choices"][0]

    def generate(self, ids: list[list[int]], requests: list[dict]) -> list[tuple[list[int], str]]:
        def one(args):
            prompt, kw = args
            extra = kw.pop("extra_args", None)
            choice = self._complete({"prompt": prompt, "return_token_ids": True, **kw,
                                     **({"vllm_xargs": extra} if extra else {})})
            return list(choice["token_ids"]), choice["finish_reason"]

        with ThreadPoolExecutor(max_workers=16) as pool:
            return list(pool.map(one, zip(ids, [dict(r) for r in requests])))

    def prompt_logprobs(self, windows: list[list[int]], split: int, vocab: int) -> list[torch.Tensor]:
        from ..integrations.vllm.plan import DECODE_FROM

        def one(w):
            choice = self._complete({"prompt": w, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": vocab,
                                     "vllm_xargs": {DECODE_FROM: split}})
            return dense_logprobs(choice["prompt_logprobs"][split:], vocab)

        with ThreadPoolExecutor(max_workers=4) as pool:
            return list(pool.map(one, windows))


def make_backend(backend: str, model, tokenizer, path: str | Path, *, url: str | None = None,
                 max_num_seqs: int = 64, novice: bool = True):
    """``novice``: an in-process vLLM engine adds novice constants, so that novice plans switch in."""
    if backend == "vllm":
        return VLLMBackend(model, tokenizer, path, url=url, max_num_seqs=max_num_seqs, novice=novice)
    return EngineBackend(model, tokenizer, max_num_seqs)
