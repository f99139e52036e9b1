"""Disaggregated prefill/decode: two worker processes, one pool of experts each.

The prefill worker holds the full checkpoint, runs prefill, samples each request's first token and
hands its KV blocks over; the decode worker (a pruned checkpoint, a distilled decoder with its plan,
or the full model with the plan's decode policy) writes those blocks into its own pool and decodes.
Freed expert memory becomes KV capacity (``capacity()``).

Every channel belongs to one worker (its inbox queue, its pipe; hand-overs go prefill -> front end ->
decode, tensors in shared memory), so a worker that dies, even mid-message, breaks only its own
channels: its requests end with finish_reason "error" and it is replaced. One that stops answering
(no heartbeat for ``heartbeat_timeout`` s) is killed and treated the same way.
"""
from __future__ import annotations

import ctypes
import itertools
import logging
import os
import queue as queue_mod
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import wait as wait_for_connections
from pathlib import Path

import torch
import torch.multiprocessing as mp

from .sampling import SamplingParams, per_prompt
from .outputs import RequestOutput
from .scheduler import Sequence
from .validation import check_request, encode_prompt
from .wire import Abort, Add, Adopt, Delta, Failed, Handoff, Heartbeat, Ready, Stats, Stop

log = logging.getLogger("moetailor.disagg")

PR_SET_PDEATHSIG = 1      # linux/prctl.h
PARENT_POLL_S = 0.5       # how often a worker checks that its front end is alive
STATS_EVERY_S = 0.25      # how often a busy worker sends its pool numbers (/metrics)
MAX_QUICK_RESTARTS = 3    # a worker that dies this often within RESTART_WINDOW_S is left down
RESTART_WINDOW_S = 60.0
HEARTBEAT_S = 0.5         # how often a worker says it is alive (from its own thread, also mid-step)
HEARTBEAT_TIMEOUT_S = 10.0  # a ready worker silent this long is hung: killed and replaced


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

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

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


def _exit_with_parent(parent_pid: int) -> None:
    """End this worker when the front end dies, even by SIGKILL: Linux's parent-death signal
    (prctl PR_SET_PDEATHSIG) and, everywhere, a thread that watches the parent pid."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    if os.getppid() != parent_pid:     # the parent died before the signal was armed
        os._exit(1)
    threading.Thread(target=watch, name="moetailor-parent-watch", daemon=True).start()


class _SharedConn:
    """The worker's end of its pipe, shared by the loop and the heartbeat thread (a Connection is not
    safe to send on from two threads at once)."""

    def __init__(self, conn):
        self.conn, self.lock = conn, threading.Lock()

    def send(self, msg) -> None:
        with self.lock:
            self.conn.send(msg)


def _heartbeat(kind: str, conn: _SharedConn) -> None:
    """Send a Heartbeat every HEARTBEAT_S while the process runs; a stopped process sends none."""
    def beat() -> None:
        while True:
            try:
                conn.send(Heartbeat(kind))
            except (OSError, ValueError):   # the front end is gone: the parent watch ends this process
                return
            time.sleep(HEARTBEAT_S)
    threading.Thread(target=beat, name="moetailor-heartbeat", daemon=True).start()


def _start_worker(kind: str, parent_pid: int, conn, build):
    """Arm the parent watch, start the heartbeat, load, warm up with one tiny request (a checkpoint
    that loads but cannot run fails here, at start), report ready. A failure is sent to the front end
    with its cause."""
    _exit_with_parent(parent_pid)
    _heartbeat(kind, conn)
    try:
        llm = build()
        llm.generate([[0]], SamplingParams(max_tokens=2, ignore_eos=True))
        llm.step_log.clear()
        llm.tokens_generated = 0
    except Exception as e:
        conn.send(Failed(kind, f"{type(e).__name__}: {e}"))
        raise SystemExit(1) from None
    limits = llm.request_limits()
    conn.send(Ready(kind, {"num_blocks": llm.block_manager.num_blocks, "weight_bytes": llm.runner.weight_bytes,
                               "block_bytes": llm.runner.block_bytes, "max_model_len": llm.max_model_len,
                               "pid": os.getpid(), "limits": limits}))
    return llm


def _delta(seq, stage: str, prompt_logprobs=None) -> Delta:
    """The request's whole completion so far (with its logprobs when asked for): deltas from two
    processes may arrive in any order. The prefill worker also sends the prompt's logprobs."""
    logprobs = None if seq.logprobs is None else list(seq.logprobs)
    return Delta(seq.request_id, list(seq.completion_token_ids), seq.text, seq.finish_reason, seq.error, stage,
                 logprobs, prompt_logprobs)


def _error(rid: str, stage: str, e: Exception) -> Delta:
    log.exception("request %s failed in the %s worker", rid, stage)
    return Delta(rid, [], "", "error", f"internal error ({type(e).__name__}) in the {stage} worker; the server log "
                                       "has the details", stage)


def _next_messages(inbox, block: bool) -> list:
    """Everything waiting in the inbox; waits for the first message only when the worker is idle."""
    messages = [inbox.get()] if block else []
    while True:
        try:
            messages.append(inbox.get_nowait())
        except queue_mod.Empty:
            return messages


def _serve(kind: str, llm, inbox, conn, on_message, on_step) -> None:
    """The worker loop: messages in, one engine step, results out, stats now and then. One bad
    request ends with an error delta; the worker keeps serving."""
    last_stats, idle_reported, last_sent = 0.0, False, None

    def report() -> None:
        """Queue and pool numbers, with the step records since the last report (the front end's
        ``step_log``: what `generate` prints, as for one engine)."""
        nonlocal last_stats, last_sent
        new = list(itertools.takewhile(lambda r: r is not last_sent, reversed(llm.step_log)))[::-1]
        last_sent = llm.step_log[-1] if llm.step_log else None
        conn.send(Stats(kind, {**llm.stats(), "steps": [asdict(r) for r in new]}))
        last_stats = time.monotonic()

    while True:
        idle = not llm.has_unfinished()
        if idle and not idle_reported:       # once on going idle: the pool is empty now
            report()
        idle_reported = idle
        for msg in _next_messages(inbox, block=idle):
            if isinstance(msg, Stop):
                return
            if isinstance(msg, Abort):
                llm.abort(msg.request_id)
                continue
            try:
                on_message(msg)
            except ValueError as e:       # a request this worker cannot run (e.g. its pool is too small)
                conn.send(Delta(msg.request_id, [], "", "error", str(e), kind))
            except Exception as e:
                conn.send(_error(msg.request_id, kind, e))
        stepped = llm.step()              # a request that fails in the step comes back finished with an error
        for seq in stepped:
            try:
                on_step(seq)
            except Exception as e:
                llm.abort(seq.request_id)
                conn.send(_error(seq.request_id, kind, e))
        if stepped and (idle or time.monotonic() - last_stats > STATS_EVERY_S):
            report()                      # the first busy step, then every STATS_EVERY_S


def prefill_worker(model, kwargs: dict, inbox, conn, parent_pid: int) -> None:
    """Full pool. Prefill, sample the first token, send the KV blocks to the front end, free them."""
    conn = _SharedConn(conn)
    llm = _start_worker("prefill", parent_pid, conn, lambda: _build_llm(model, None, kwargs))

    def add(msg: Add) -> None:
        llm.add_request(msg.token_ids, msg.sampling, request_id=msg.request_id)

    def hand_over(seq) -> None:
        if seq.is_finished:               # finished on its first token (or failed)
            conn.send(_delta(seq, "prefill", seq.prompt_logprobs))
            return
        kv = llm.runner.read_blocks(seq.block_table)      # per layer (k, v) [n*bs, nKV, D]
        state = seq.generator.get_state() if seq.generator is not None else None
        adopt = Adopt(seq.request_id, seq.token_ids, seq.num_prompt_tokens, seq.sampling, state, kv, seq.prompt,
                      seq.logprobs, seq.prompt_logprobs)
        conn.send(Handoff(_delta(seq, "decode", seq.prompt_logprobs), adopt))
        llm.abort(seq.request_id)         # frees the prefill worker's blocks

    _serve("prefill", llm, inbox, conn, add, hand_over)


def distilled_plan(model):
    """The plan a ``moetailor distill`` decoder was trained with (its expert pool; ``load_model``
    read it beside the weights), or None for any other model."""
    from ..models.sidecars import sidecars_of
    from ..plans.plan import Plan

    distill = sidecars_of(model).distill
    return None if distill is None else Plan.from_json(distill.plan, where=f"plan file {distill.plan_file}")


def _decode_llm(model, plan, kwargs):
    """The decode worker's engine; a distilled decoder given without a plan decodes under its own."""
    llm = _build_llm(model, plan, kwargs)
    if plan is None:
        llm.set_plan(distilled_plan(llm.model))
    return llm


def adopted(token_ids: list[int], num_prompt_tokens: int, sampling: SamplingParams, request_id: str,
            generator_state: torch.Tensor | None = None, prompt: str | None = None, logprobs: list | None = None,
            prompt_logprobs: list | None = None) -> Sequence:
    """A sequence the prefill worker started, as the decode worker continues it: its tokens so far,
    its sampler's state and the logprobs already computed for it (the engine's ``enqueue`` adds its
    KV blocks and text)."""
    seq = Sequence(token_ids[:num_prompt_tokens], sampling, request_id=request_id, prompt=prompt)
    seq.token_ids = list(token_ids)
    if seq.logprobs is not None:
        seq.logprobs = list(logprobs or [])
    seq.prompt_logprobs = prompt_logprobs
    seq.first_token_time = time.perf_counter()
    if generator_state is not None and seq.generator is not None:
        seq.generator.set_state(generator_state)
    return seq


def decode_worker(model, plan, kwargs: dict, inbox, conn, parent_pid: int) -> None:
    """Pruned (or masked) pool. Adopt prefilled sequences and decode them."""
    conn = _SharedConn(conn)
    llm = _start_worker("decode", parent_pid, conn, lambda: _decode_llm(model, plan, kwargs))

    def adopt(msg: Adopt) -> None:
        seq = adopted(msg.token_ids, msg.num_prompt_tokens, msg.sampling, msg.request_id, msg.generator_state,
                      msg.prompt, msg.logprobs, msg.prompt_logprobs)
        if not llm.enqueue(seq, msg.kv):
            raise ValueError(f"request id {msg.request_id!r} is already in use in the decode worker")

    _serve("decode", llm, inbox, conn, adopt, lambda seq: conn.send(_delta(seq, "decode")))


@dataclass
class Worker:
    """One worker process and the two channels only it uses."""
    kind: str                  # "prefill" | "decode": also the stage of the requests it holds
    process: object
    inbox: object              # front end -> worker (queue)
    conn: object               # worker -> front end (pipe, read end)
    closed: bool = False       # the pipe reached end of file: the worker is gone
    retired: bool = False      # its channels are dropped (replaced, or left down)
    last_heard: float = field(default_factory=time.monotonic)   # any message, heartbeats included
    hung: str | None = None    # why it was killed as unresponsive

    def retire(self) -> None:
        """Drop the channels without waiting on a dead reader."""
        self.inbox.cancel_join_thread()
        self.inbox.close()
        self.conn.close()
        self.closed = self.retired = True


class WorkerUnavailable(RuntimeError):
    """A worker kept failing and is left down (the server answers 503 and /health says why)."""


class DisaggregatedLLM:
    """Same front end as ``LLM`` (generate, add_request, step, abort), work done by two processes.
    The decode worker runs ``decode_model`` (default: ``model``) under ``plan`` (default: none, or
    the plan a distilled decoder was trained with)."""

    def __init__(self, model, decode_model: str | Path | None = None, plan=None, *, tokenizer=None,
                 startup_timeout: float = 300.0, heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S, **engine_kwargs):
        from ..models.loading import load_tokenizer

        if decode_model is None and plan is None:
            raise ValueError("disaggregated serving needs a pruned decode checkpoint (decode_model=DIR from "
                             "`moetailor prune`), a distilled decoder (`moetailor distill`) or a plan whose "
                             "decode policy the decode worker applies")
        if tokenizer is None and isinstance(model, (str, Path)):
            try:
                tokenizer = load_tokenizer(model)
            except Exception:   # no tokenizer files: token-id prompts only
                tokenizer = None
        if not heartbeat_timeout > 2 * HEARTBEAT_S:
            raise ValueError(f"heartbeat_timeout={heartbeat_timeout!r} must be more than {2 * HEARTBEAT_S:g} s "
                             f"(workers send a heartbeat every {HEARTBEAT_S:g} s)")
        self.heartbeat_timeout = heartbeat_timeout
        self.tokenizer = tokenizer
        self.model = None                  # the weights live in the workers
        self.guard = None                  # the guard watches one engine's pools; none here
        self.observer = None               # observing runs in one engine (serve refuses --observe with --decode-model)
        self.engine_kwargs = dict(engine_kwargs, tokenizer=tokenizer)
        self.worker_specs = {"prefill": (prefill_worker, (model,)),
                             "decode": (decode_worker, (decode_model if decode_model is not None else model,
                                                        plan))}
        self.ctx = mp.get_context("spawn")
        self.lock = threading.RLock()
        self.seqs: dict[str, RemoteSequence] = {}
        self.ready: dict[str, dict] = {}
        self.step_log: deque = deque(maxlen=10_000)   # both workers' step records, as their reports bring them
        self.messages_received = 0
        self.delta_received: dict[str, int] = {}   # kind -> number of the last result message from that worker
        self.stats_received: dict[str, int] = {}   # kind -> number of its last stats report
        self.tokens_generated = 0
        self.restarts = {"prefill": 0, "decode": 0}
        self.deaths: dict[str, list[float]] = {"prefill": [], "decode": []}    # recent exits (monotonic s)
        self.causes: dict[str, str] = {}       # kind -> why it last failed (a worker's own report)
        self.down: dict[str, str] = {}         # kind -> why it is no longer restarted
        self.worker_stats: dict[str, dict] = {}
        self.preemptions_before: int = 0       # preemptions of replaced workers (the counter only grows)
        self.workers = {kind: self._start(kind) for kind in ("prefill", "decode")}
        try:
            self._wait_ready({"prefill", "decode"}, startup_timeout)
        except BaseException:
            for worker in self.workers.values():   # nothing to finish: no waiting for a worker still loading
                worker.process.kill()
            self.close()
            raise
        self.limits = self.ready["prefill"]["limits"].tighter(self.ready["decode"]["limits"])
        self.max_model_len = self.limits.max_model_len
        self._next_id = 0

    def _start(self, kind: str) -> Worker:
        target, args = self.worker_specs[kind]
        inbox = self.ctx.Queue()
        reader, writer = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=target, args=(*args, dict(self.engine_kwargs), inbox, writer, os.getpid()),
                                daemon=True)
        proc.start()
        writer.close()                     # only the worker writes: its death is end of file here
        return Worker(kind, proc, inbox, reader)

    def _wait_ready(self, kinds: set[str], timeout: float) -> None:
        deadline = time.time() + timeout
        while not kinds <= set(self.ready):
            for kind in kinds:
                proc = self.workers[kind].process
                if kind not in self.ready and not proc.is_alive():
                    self._drain(timeout=0.1)      # its last words: why it failed
                    cause = self.causes.get(kind, f"it exited with code {proc.exitcode}")
                    raise ValueError(f"the {kind} worker could not start: {cause}")
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

    # ---- the LLM-like front end (serving/client.py) -------------------------------------------------
    def encode(self, prompt):
        return encode_prompt(self.tokenizer, prompt)

    def request_limits(self):
        """The tighter of the two workers' limits, learned when they started."""
        return self.limits

    def add_request(self, prompt, sampling: SamplingParams | None = None, request_id: str | None = None,
                    plan=None, plan_key=None) -> RemoteSequence:
        if plan is not None:
            raise ValueError("per-request expert plans are not available in disaggregated mode (the decode pool "
                             "is the pruned checkpoint); use expert_top_k or a colocated server")
        sampling = sampling or SamplingParams()
        text, ids = self.encode(prompt)
        check_request(ids, sampling, self.limits)    # the same checks as a colocated engine, before any worker
        if self.down:
            raise WorkerUnavailable("; ".join(f"the {kind} worker is down ({why})" for kind, why in self.down.items()))
        with self.lock:
            if request_id is None:
                request_id = f"d{self._next_id}"
                self._next_id += 1
            seq = RemoteSequence(request_id, text, ids, sampling)
            if sampling.logprobs is not None:
                seq.logprobs = []
            self.seqs[request_id] = seq
            self.workers["prefill"].inbox.put(Add(request_id, ids, sampling))
        return seq

    def abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> bool:
        with self.lock:
            seq = self.seqs.pop(request_id, None)
            if seq is None or seq.is_finished:
                return False
            seq.finish(reason, error)
            for worker in self.workers.values():
                if not worker.retired:
                    worker.inbox.put(Abort(request_id))
            return True

    def has_unfinished(self) -> bool:
        return bool(self.seqs)

    def step(self, timeout: float = 0.05) -> list[RemoteSequence]:
        """Collect what the workers produced since the last call (waits up to ``timeout`` for something)
        and replace dead workers. The server calls it while idle too, so a worker that died idle is
        noticed (and restarted) at once, not by the next request."""
        updated = self._drain(timeout=timeout)
        return updated + self._replace_dead_workers()

    def poll(self) -> list[RemoteSequence]:
        """What ``step`` does, for a caller with no request in flight (the server's idle loop)."""
        return self.step(timeout=0.05)

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
                conns[conn].last_heard = time.monotonic()
                self.messages_received += 1
                if isinstance(msg, (Delta, Handoff)):
                    self.delta_received[conns[conn].kind] = self.messages_received
                updated += self._handle(msg)
            ready = wait_for_connections(list(conns), 0) if conns else []
        return updated

    def _handle(self, msg) -> list[RemoteSequence]:
        if isinstance(msg, Heartbeat):
            return []
        if isinstance(msg, Ready):
            self.ready[msg.kind] = msg.info
            return []
        if isinstance(msg, Stats):
            from .llm import StepRecord
            self.step_log.extend(StepRecord(**r) for r in msg.stats.pop("steps", []))
            self.worker_stats[msg.kind] = msg.stats
            self.stats_received[msg.kind] = self.messages_received
            return []
        if isinstance(msg, Failed):
            self.causes[msg.kind] = msg.cause
            log.error("the %s worker failed: %s", msg.kind, msg.cause)
            return []
        if isinstance(msg, Handoff):                # prefill -> decode, through this process
            with self.lock:
                if msg.delta.request_id not in self.seqs:   # aborted meanwhile
                    return []
                self.workers["decode"].inbox.put(msg.adopt)
            msg = msg.delta
        seq = self._apply(msg)
        return [seq] if seq is not None else []

    def _apply(self, msg: Delta) -> RemoteSequence | None:
        ids = msg.token_ids
        with self.lock:
            seq = self.seqs.get(msg.request_id)
            if seq is None:
                return None
            if ids and seq.first_token_time is None:
                seq.first_token_time = time.perf_counter()
            if len(ids) >= len(seq.completion_token_ids):       # ignore a stale (reordered) message
                self.tokens_generated += len(ids) - len(seq.completion_token_ids)
                seq.completion_token_ids, seq.text = list(ids), msg.text
                if msg.logprobs is not None:
                    seq.logprobs = msg.logprobs
            if msg.prompt_logprobs is not None:
                seq.prompt_logprobs = msg.prompt_logprobs
            if msg.stage == "decode":
                seq.stage = "decode"
            if msg.finish_reason is not None:
                seq.finish(msg.finish_reason, msg.error)
                self.seqs.pop(msg.request_id, None)
            return seq

    def _replace_dead_workers(self) -> list[RemoteSequence]:
        """A dead worker's requests end with an error; a new worker with fresh channels takes its place.
        Returns every request updated meanwhile."""
        lost = []
        self._kill_hung_workers()
        for kind, worker in list(self.workers.items()):
            if worker.retired or worker.process.is_alive():
                continue
            lost += self._drain(timeout=0.01)      # what it (and the other worker) sent meanwhile
            code = worker.process.exitcode
            was_ready = kind in self.ready
            log.error("the %s worker (pid %s) exited with code %s%s", kind, worker.process.pid, code,
                      "" if was_ready else " while loading")
            what = f"stopped answering ({worker.hung})" if worker.hung else f"exited (code {code})"
            with self.lock:
                for seq in [s for s in self.seqs.values() if s.stage == kind]:
                    seq.finish("error", f"the {kind} worker {what} while serving this request; it was ended, "
                                        "resubmit it")
                    self.seqs.pop(seq.request_id, None)
                    lost.append(seq)
                worker.retire()
                stats = self.worker_stats.pop(kind, {})
                self.preemptions_before += stats.get("preemptions", 0)
                self.ready.pop(kind, None)
                now = time.monotonic()
                self.deaths[kind] = [t for t in self.deaths[kind] if now - t < RESTART_WINDOW_S] + [now]
                if not was_ready or len(self.deaths[kind]) > MAX_QUICK_RESTARTS:
                    # a worker that cannot load, or keeps dying: restarting again would only repeat it
                    self.down[kind] = self.causes.get(kind) or (
                        f"exited with code {code} " + ("while loading" if not was_ready else
                                                       f"{len(self.deaths[kind])} times in {RESTART_WINDOW_S:.0f} s"))
                    log.error("the %s worker is left down: %s", kind, self.down[kind])
                    for seq in list(self.seqs.values()):        # nothing else can finish now
                        seq.finish("error", f"the {kind} worker is down; the request was ended")
                        self.seqs.pop(seq.request_id, None)
                        lost.append(seq)
                    continue
                self.restarts[kind] += 1
                self.workers[kind] = self._start(kind)
        return lost

    def _kill_hung_workers(self) -> None:
        """A ready worker whose heartbeat stopped for ``heartbeat_timeout`` s is killed (SIGKILL ends a
        stopped process too); the dead-worker path then ends its requests and replaces it."""
        now = time.monotonic()
        for kind, worker in self.workers.items():
            silent = now - worker.last_heard
            if worker.retired or kind not in self.ready or silent < self.heartbeat_timeout or \
                    not worker.process.is_alive():
                continue
            worker.hung = f"no heartbeat for {silent:.0f} s"
            log.error("the %s worker (pid %s) stopped answering: %s; killing it", kind, worker.process.pid,
                      worker.hung)
            worker.process.kill()
            worker.process.join(timeout=5)

    def health(self) -> dict:
        """Each worker's state: "ready", "unresponsive" (heartbeat late), "starting" (loading after a
        restart) or "down" (with why)."""
        workers = {}
        now = time.monotonic()
        for kind, worker in self.workers.items():
            alive = not worker.closed and worker.process.is_alive()
            late = now - worker.last_heard > max(2.0, self.heartbeat_timeout / 2)
            state = "down" if kind in self.down else ("unresponsive" if late else "ready") \
                if alive and kind in self.ready else "starting" if alive else "dead"
            workers[kind] = {"state": state, "pid": worker.process.pid, "restarts": self.restarts[kind]}
            if kind in self.down:
                workers[kind]["error"] = self.down[kind]
        return {"ok": all(w["state"] == "ready" for w in workers.values()), "workers": workers}

    def generate(self, prompts, sampling=None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Run every prompt to completion on the two workers; outputs in prompt order (as ``LLM.generate``)."""
        prompts, params = per_prompt(prompts, sampling)
        seqs = [self.add_request(p, s) for p, s in zip(prompts, params)]
        while any(not s.is_finished for s in seqs):
            self.step()
        return [s.output() for s in seqs]

    def sync_stats(self, timeout: float = 5.0) -> None:
        """Wait (up to ``timeout`` s) until each worker has reported after its last result, so that
        ``step_log`` holds every step of the requests that have finished (workers report on going idle)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(
                self.stats_received.get(kind, 0) < n for kind, n in self.delta_received.items()):
            self._drain(0.05)

    def stats(self) -> dict:
        """Request counts from the front end; pool numbers from the decode worker's last report (it
        holds the KV cache of running requests); preemptions summed over both workers."""
        d = self.worker_stats.get("decode", {})
        return {"waiting": sum(s.stage == "prefill" for s in self.seqs.values()),
                "running": sum(s.stage == "decode" for s in self.seqs.values()),
                "kv_blocks_total": self.ready.get("decode", {}).get("num_blocks", 0),
                "kv_blocks_free": d.get("kv_blocks_free", 0), "kv_usage": d.get("kv_usage", 0.0),
                "preemptions": self.preemptions_before + sum(w.get("preemptions", 0)
                                                             for w in self.worker_stats.values()),
                "tokens_generated": self.tokens_generated,
                "decode_tokens_per_s": d.get("decode_tokens_per_s", 0.0),
                "distinct_experts_last_step": d.get("distinct_experts_last_step", 0.0)}

    def close(self) -> None:
        for worker in self.workers.values():
            if worker.process.is_alive() and not worker.retired:
                worker.inbox.put(Stop())
        for worker in self.workers.values():
            worker.process.join(timeout=5)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=5)
            if not worker.retired:
                worker.retire()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
