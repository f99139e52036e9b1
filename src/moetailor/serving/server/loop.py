"""The engine thread: one background thread runs ``llm.step()`` while requests are unfinished and
hands each request's deltas to the asyncio queue its HTTP handler reads."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass

from ..client import EngineClient
from ..sampling import SamplingParams
from ..outputs import StreamDelta
from ..outputs import delta as stream_delta

log = logging.getLogger("moetailor.server")


@dataclass
class _Request:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    sent_text: int = 0
    sent_tokens: int = 0


class AsyncEngine:
    """Drives ``llm.step()`` in a background thread and delivers each request's deltas."""

    def __init__(self, llm: EngineClient):
        self.llm = llm
        self.requests: dict[str, _Request] = {}
        self.wake = threading.Event()
        self.stopping = False
        self.started = time.time()
        self.thread = threading.Thread(target=self._run, name="moetailor-engine", daemon=True)
        self.thread.start()

    def submit(self, loop: asyncio.AbstractEventLoop, prompt, sampling: SamplingParams, plan=None,
               plan_key: str | None = None) -> tuple[str, asyncio.Queue, int]:
        """Queue a request (ValueError for one that can never run); returns its id, delta queue and
        prompt tokens. Tokenizes, so the server calls it off the event loop."""
        request_id = uuid.uuid4().hex
        entry = _Request(loop, asyncio.Queue())
        self.requests[request_id] = entry
        try:
            seq = self.llm.add_request(prompt, sampling, request_id=request_id, plan=plan, plan_key=plan_key)
        except Exception:
            self.requests.pop(request_id, None)
            raise
        self.wake.set()
        return request_id, entry.queue, seq.num_prompt_tokens

    def abort(self, request_id: str) -> None:
        if self.llm.abort(request_id):
            self._deliver_final(request_id)

    def close(self) -> None:
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout=5)
        self.llm.close()

    def _run(self) -> None:
        while not self.stopping:
            try:
                if not self.llm.has_unfinished():
                    seqs = self.llm.poll()   # a disaggregated front end watches its workers while idle too
                    if not seqs:
                        self.wake.wait(0.05)
                        self.wake.clear()
                        continue
                else:
                    seqs = self.llm.step()   # a request that fails in it comes back finished with an error
            except Exception as e:           # a bug outside any one request: end what is in flight, keep serving
                log.exception("engine step failed")
                self._fail_all(f"internal error ({type(e).__name__}) in the engine; the server log has the details")
                continue
            for seq in seqs:
                self._deliver(seq)

    def _deliver(self, seq) -> None:
        entry = self.requests.get(seq.request_id)
        if entry is None:
            return
        delta = stream_delta(seq, entry.sent_text, entry.sent_tokens)
        entry.sent_text, entry.sent_tokens = entry.sent_text + len(delta.text), entry.sent_tokens + len(delta.token_ids)
        if seq.is_finished:
            self.requests.pop(seq.request_id, None)
        entry.loop.call_soon_threadsafe(entry.queue.put_nowait, delta)

    def _deliver_final(self, request_id: str) -> None:
        entry = self.requests.pop(request_id, None)
        if entry is not None:
            entry.loop.call_soon_threadsafe(entry.queue.put_nowait,
                                            StreamDelta(request_id, "", [], True, "abort", None))

    def _fail_all(self, error: str) -> None:
        with self.llm.lock:
            for request_id in list(self.requests):
                self.llm.abort(request_id, reason="error", error=error)
                entry = self.requests.pop(request_id, None)
                if entry is not None:
                    entry.loop.call_soon_threadsafe(entry.queue.put_nowait,
                                                    StreamDelta(request_id, "", [], True, "error", error))
