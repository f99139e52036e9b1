"""Disaggregated prefill/decode: two worker processes, one pool of experts each.

The prefill worker holds the full checkpoint, runs prefill steps only, samples each request's
first token and hands the request's KV blocks over; the decode worker holds the pruned checkpoint
(from ``moetailor prune``), a distilled decoder with its plan (``moetailor distill``), or the full
model with the plan's decode policy,
writes those blocks into its own pool unchanged and decodes. Freed expert weight memory becomes KV
capacity: under the same ``memory_budget`` the decode worker holds more blocks (``capacity()``).

Every channel belongs to one worker: the front end sends to a worker through its own inbox queue
and reads from it through its own pipe, and hand-overs travel prefill -> front end -> decode
(tensors in shared memory, so only handles are copied). A worker that dies, even mid-message, can
therefore only break its own channels: its in-flight requests end with finish_reason "error" and a
message, a new worker with fresh channels is started, and requests keep being served.
"""
from __future__ import annotations

import queue as queue_mod
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for_connections
from pathlib import Path

import torch
import torch.multiprocessing as mp

from .llm import RequestOutput
from .sampling import SamplingParams


@dataclass
class RemoteSequence:
    """The front end's view of a request running in the workers (what the server reads)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling: SamplingParams
    completion_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    stage: str = "prefill"              # "prefill" -> "decode" once handed over
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    logprobs: list | None = None           # TokenLogprob per completion token, when asked for
    prompt_logprobs: list | None = None    # TokenLogprob per prompt token (first None), from the prefill worker

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, reason: str, error: str | None = None) -> None:
        self.finish_reason, self.error, self.finish_time = reason, error, time.perf_counter()

    def output(self) -> RequestOutput:
        end = self.finish_time or time.perf_counter()
        ttft = self.first_token_time - self.arrival if self.first_token_time else None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, self.text,
                             list(self.completion_token_ids), self.finish_reason,
                             {"ttft_s": ttft, "total_s": end - self.arrival}, self.error,
                             None if self.logprobs is None else list(self.logprobs), self.prompt_logprobs)


def _build_llm(model, plan, kwargs):
    from .llm import LLM
    torch.set_num_threads(kwargs.pop("threads", None) or torch.get_num_threads())
    return LLM(model, plan, **kwargs)


def _report(conn, kind: str, llm) -> None:
    conn.send(("ready", kind, {"num_blocks": llm.block_manager.num_blocks, "weight_bytes": llm.runner.weight_bytes,
                               "block_bytes": llm.runner.block_bytes, "max_model_len": llm.max_model_len}))


def _delta(seq, stage: str, prompt_logprobs=None) -> tuple:
    """The request's whole completion so far (with its logprobs when asked for): deltas from two
    processes may arrive in any order. The prefill worker also sends the prompt's logprobs."""
    logprobs = None if seq.logprobs is None else list(seq.logprobs)
    return ("delta", seq.request_id, list(seq.completion_token_ids), seq.text, seq.finish_reason, seq.error, stage,
            logprobs, prompt_logprobs)


def _next_messages(inbox, block: bool) -> list:
    """Everything waiting in the inbox; waits for the first message only when the worker is idle."""
    messages = [inbox.get()] if block else []
    while True:
        try:
            messages.append(inbox.get_nowait())
        except queue_mod.Empty:
            return messages


def prefill_worker(model, kwargs: dict, inbox, conn) -> None:
    """Full pool. Prefill, sample the first token, send the KV blocks to the front end, free them."""
    llm = _build_llm(model, None, kwargs)
    _report(conn, "prefill", llm)
    while True:
        for msg in _next_messages(inbox, block=not llm.has_unfinished()):
            if msg[0] == "stop":
                return
            if msg[0] == "add":
                _, rid, ids, sampling = msg
                try:
                    llm.add_request(ids, sampling, request_id=rid)
                except ValueError as e:   # e.g. more KV blocks than this worker's pool holds
                    conn.send(("delta", rid, [], "", "error", str(e), "prefill", None, None))
            elif msg[0] == "abort":
                llm.abort(msg[1])
        for seq in llm.step():            # the inbox holds only new requests: always a prefill step
            if seq.is_finished:           # finished on its first token
                conn.send(_delta(seq, "prefill", seq.prompt_logprobs))
                continue
            kv = llm.runner.read_blocks(seq.block_table)      # per layer (k, v) [n*bs, nKV, D]
            state = seq.generator.get_state() if seq.generator is not None else None
            adopt = ("adopt", seq.request_id, seq.token_ids, seq.num_prompt_tokens, seq.sampling, state, kv, seq.prompt,
                     seq.logprobs, seq.prompt_logprobs)
            conn.send(("handoff", _delta(seq, "decode", seq.prompt_logprobs), adopt))
            llm.abort(seq.request_id)     # frees the prefill worker's blocks


def decode_worker(model, plan, kwargs: dict, inbox, conn) -> None:
    """Pruned (or masked) pool. Adopt prefilled sequences and decode them."""
    llm = _build_llm(model, plan, kwargs)
    _report(conn, "decode", llm)
    while True:
        for msg in _next_messages(inbox, block=not llm.has_unfinished()):
            if msg[0] == "stop":
                return
            if msg[0] == "abort":
                llm.abort(msg[1])
            elif msg[0] == "adopt":
                _, rid, ids, n_prompt, sampling, state, kv, prompt, logprobs, prompt_logprobs = msg
                llm.adopt(ids, n_prompt, sampling, kv, request_id=rid, generator_state=state, prompt=prompt,
                          logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        for seq in llm.step():
            conn.send(_delta(seq, "decode"))


@dataclass
class Worker:
    """One worker process and the two channels only it uses."""
    kind: str                  # "prefill" | "decode": also the stage of the requests it holds
    process: object
    inbox: object              # front end -> worker (queue)
    conn: object               # worker -> front end (pipe, read end)
    closed: bool = False       # the pipe reached end of file: the worker is gone

    def retire(self) -> None:
        """Drop the channels without waiting on a dead reader."""
        self.inbox.cancel_join_thread()
        self.inbox.close()
        self.conn.close()
        self.closed = True


def _distilled_plan(decode_model):
    """A ``moetailor distill`` output decodes with its own plan (its expert pool); others need none."""
    from ..transforms.distill import SIDECAR, load_distilled

    if isinstance(decode_model, (str, Path)) and (Path(decode_model) / SIDECAR).is_file():
        return load_distilled(decode_model).plan
    return None


class DisaggregatedLLM:
    """Same front end as ``LLM`` (generate, add_request, step, abort), work done by two processes.

    The decode worker runs ``decode_model`` (default: ``model``) under ``plan`` (default: none, or
    the plan a distilled decoder was trained with)."""

    def __init__(self, model, decode_model: str | Path | None = None, plan=None, *, tokenizer=None,
                 startup_timeout: float = 300.0, **engine_kwargs):
        from ..models.loading import load_tokenizer

        if decode_model is not None and plan is None:
            plan = _distilled_plan(decode_model)
        if decode_model is None and plan is None:
            raise ValueError("disaggregated serving needs a pruned decode checkpoint (decode_model=DIR from "
                             "`moetailor prune`), a distilled decoder (`moetailor distill`) or a plan whose "
                             "decode policy the decode worker applies")
        if tokenizer is None and isinstance(model, (str, Path)):
            try:
                tokenizer = load_tokenizer(model)
            except Exception:   # no tokenizer files: token-id prompts only
                tokenizer = None
        self.tokenizer = tokenizer
        self.model = None                  # the weights live in the workers
        self.engine_kwargs = dict(engine_kwargs, tokenizer=tokenizer)
        self.worker_specs = {"prefill": (prefill_worker, (model,)),
                             "decode": (decode_worker, (decode_model if decode_model is not None else model,
                                                        plan))}
        self.ctx = mp.get_context("spawn")
        self.lock = threading.RLock()
        self.seqs: dict[str, RemoteSequence] = {}
        self.ready: dict[str, dict] = {}
        self.step_log: list = []
        self.tokens_generated = 0
        self.restarts = {"prefill": 0, "decode": 0}
        self.workers = {kind: self._start(kind) for kind in ("prefill", "decode")}
        self._wait_ready({"prefill", "decode"}, startup_timeout)
        self.max_model_len = engine_kwargs.get("max_model_len") or self.ready["prefill"].get("max_model_len") or 4096
        self._next_id = 0

    @property
    def decode_restarts(self) -> int:
        return self.restarts["decode"]

    def _start(self, kind: str) -> Worker:
        target, args = self.worker_specs[kind]
        inbox = self.ctx.Queue()
        reader, writer = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=target, args=(*args, dict(self.engine_kwargs), inbox, writer), daemon=True)
        proc.start()
        writer.close()                     # only the worker writes: its death is end of file here
        return Worker(kind, proc, inbox, reader)

    def _wait_ready(self, kinds: set[str], timeout: float) -> None:
        deadline = time.time() + timeout
        while not kinds <= set(self.ready):
            for kind in kinds:
                proc = self.workers[kind].process
                if kind not in self.ready and not proc.is_alive():
                    raise RuntimeError(f"the {kind} worker exited with code {proc.exitcode} while loading; "
                                       "run the same model with `moetailor generate` to see the error")
            if time.time() > deadline:
                raise RuntimeError(f"workers not ready after {timeout:.0f} s")
            self._drain(timeout=0.1)

    def capacity(self) -> dict:
        """KV blocks in each worker, and what the decode worker would hold with the full weights."""
        p, d = self.ready["prefill"], self.ready["decode"]
        budget = self.engine_kwargs.get("memory_budget")
        full = (budget - p["weight_bytes"]) // d["block_bytes"] if budget else None
        return {"prefill_blocks": p["num_blocks"], "decode_blocks": d["num_blocks"],
                "decode_blocks_with_full_weights": full, "prefill_weight_bytes": p["weight_bytes"],
                "decode_weight_bytes": d["weight_bytes"], "block_bytes": d["block_bytes"], "memory_budget": budget}

    # ---- the LLM-like front end ------------------------------------------------------------------
    def encode(self, prompt):
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass tokenizer= or give token ids")
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return None, [int(t) for t in prompt]

    def add_request(self, prompt, sampling: SamplingParams | None = None, request_id: str | None = None,
                    plan=None, plan_key=None) -> RemoteSequence:
        if plan is not None:
            raise ValueError("per-request expert plans are not available in disaggregated mode (the decode pool "
                             "is the pruned checkpoint); use expert_top_k or a colocated server")
        sampling = sampling or SamplingParams()
        sampling.validate()
        text, ids = self.encode(prompt)
        if not ids:
            raise ValueError("the prompt is empty; give at least one token")
        if len(ids) + sampling.max_tokens > self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens and max_tokens={sampling.max_tokens}, which exceeds "
                             f"the context limit of {self.max_model_len} tokens (prompt + completion); shorten the "
                             f"prompt or lower max_tokens")
        with self.lock:
            if request_id is None:
                request_id = f"d{self._next_id}"
                self._next_id += 1
            seq = RemoteSequence(request_id, text, ids, sampling)
            if sampling.logprobs is not None:
                seq.logprobs = []
            self.seqs[request_id] = seq
            self.workers["prefill"].inbox.put(("add", request_id, ids, sampling))
        return seq

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> bool:
        with self.lock:
            seq = self.seqs.pop(request_id, None)
            if seq is None or seq.is_finished:
                return False
            seq.finish(reason, error)
            for worker in self.workers.values():
                worker.inbox.put(("abort", request_id))
            return True

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def step(self) -> list[RemoteSequence]:
        """Collect what the workers produced since the last call (waits briefly for something)."""
        updated = self._drain(timeout=0.05)
        return updated + self._replace_dead_workers()

    def _drain(self, timeout: float) -> list[RemoteSequence]:
        updated = []
        conns = {w.conn: w for w in self.workers.values() if not w.closed}
        ready = wait_for_connections(list(conns), timeout)
        while ready:
            for conn in ready:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):        # the worker is gone (maybe mid-message)
                    conns.pop(conn).closed = True
                    continue
                updated += self._handle(msg)
            ready = wait_for_connections(list(conns), 0) if conns else []
        return updated

    def _handle(self, msg) -> list[RemoteSequence]:
        if msg[0] == "ready":
            self.ready[msg[1]] = msg[2]
            return []
        if msg[0] == "handoff":                     # prefill -> decode, through this process
            _, delta, adopt = msg
            with self.lock:
                if delta[1] not in self.seqs:       # aborted meanwhile
                    return []
                self.workers["decode"].inbox.put(adopt)
            msg = delta
        seq = self._apply(msg)
        return [seq] if seq is not None else []

    def _apply(self, msg) -> RemoteSequence | None:
        _, rid, ids, text, reason, error, stage, logprobs, prompt_logprobs = msg
        with self.lock:
            seq = self.seqs.get(rid)
            if seq is None:
                return None
            if ids and seq.first_token_time is None:
                seq.first_token_time = time.perf_counter()
            if len(ids) >= len(seq.completion_token_ids):       # ignore a stale (reordered) message
                self.tokens_generated += len(ids) - len(seq.completion_token_ids)
                seq.completion_token_ids, seq.text = list(ids), text
                if logprobs is not None:
                    seq.logprobs = logprobs
            if prompt_logprobs is not None:
                seq.prompt_logprobs = prompt_logprobs
            if stage == "decode":
                seq.stage = stage
            if reason is not None:
                seq.finish(reason, error)
                self.seqs.pop(rid, None)
            return seq

    def _replace_dead_workers(self) -> list[RemoteSequence]:
        """A dead worker's requests end with an error; a new worker with fresh channels takes its place."""
        lost = []
        for kind, worker in list(self.workers.items()):
            if worker.process.is_alive():
                continue
            if not worker.closed:
                self._drain(timeout=0.01)          # what it sent before dying
            code = worker.process.exitcode
            with self.lock:
                for seq in [s for s in self.seqs.values() if s.stage == kind]:
                    seq.finish("error", f"the {kind} worker exited (code {code}) while serving this request; "
                                        "it was ended, resubmit it")
                    self.seqs.pop(seq.request_id, None)
                    lost.append(seq)
                worker.retire()
                self.restarts[kind] += 1
                self.ready.pop(kind, None)
                self.workers[kind] = self._start(kind)
        return lost

    def generate(self, prompts, sampling=None, use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * len(prompts)
        seqs = [self.add_request(p, s) for p, s in zip(prompts, params)]
        while any(not s.is_finished for s in seqs):
            self.step()
        return [s.output() for s in seqs]

    def stats(self) -> dict:
        return {"waiting": sum(s.stage == "prefill" for s in self.seqs.values()),
                "running": sum(s.stage == "decode" for s in self.seqs.values()),
                "kv_blocks_total": self.ready.get("decode", {}).get("num_blocks", 0), "kv_blocks_free": 0,
                "kv_usage": 0.0, "preemptions": 0, "tokens_generated": self.tokens_generated,
                "decode_tokens_per_s": 0.0, "distinct_experts_last_step": 0.0}

    def crash_decode_worker(self) -> None:
        """Fault injection (tests): kill the decode worker as the OS would."""
        self.workers["decode"].process.kill()

    def close(self) -> None:
        for worker in self.workers.values():
            if worker.process.is_alive():
                worker.inbox.put(("stop",))
        for worker in self.workers.values():
            worker.process.join(timeout=5)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=5)
            worker.retire()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
