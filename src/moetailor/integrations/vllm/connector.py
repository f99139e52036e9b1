"""A KV connector for phase-aware disaggregation: a prefill instance on the full checkpoint hands
each prompt's KV to a decode instance on the pruned checkpoint, through a shared directory.

Load it with ``KVTransferConfig(kv_connector="MoetailorConnector",
kv_connector_module_path="moetailor.integrations.vllm.connector", kv_role="kv_producer" |
"kv_consumer", kv_connector_extra_config={"storage_path": DIR})``.

The protocol (the proxy in ``disagg.py`` drives it):
  1. the producer serves the prompt P with max_tokens=1: it computes P's KV on the full model and
     samples the first token t1 from the full model's logits; when P's last chunk has run, the
     connector writes every block that holds P (whole blocks, the partial last one included) to
     its own copy DIR/<hash of P>/<uuid>/<layer>.safetensors, then a ``ready`` marker;
  2. the consumer serves P + [t1]: the request claims one ready copy of P (renames it to
     ``claimed-<uuid>``), the connector reports len(P) tokens as already computed (vLLM's scheduler
     then computes only t1's position) and copies the stored blocks into the request's first blocks
     before the forward; t1's KV and every later token run on the pruned model. The request keeps
     its copy through preemptions (it loads it again on resumption) and deletes it when it ends.
That is moetailor's phase-aware schedule: prompt and first token on the full pool, decode on the
pruned one.

Why one copy per request rather than one folder per prompt: identical prompts can be in flight
together (benchmarks, retries, fan-out), and a shared folder deleted by the first request to end
leaves a later one, still waiting or preempted, with nothing to load: vLLM then silently computes
its prompt on the pruned model. A reference count in a shared folder would fix that but leaves a
window between "no reference left" and the delete in which a producer can add one. Here no folder is
ever shared: the producer owns a copy until its ``ready`` marker, a rename (atomic; two requests
never get the same copy) hands it to exactly one decode request, and only that request deletes it.
The cost is one copy per in-flight request, what distinct prompts take anyway.

Whole blocks are copied with ``kv_cache[block_ids]``: vLLM (0.32) gives connectors per-layer KV
views with blocks at dim 0 on every backend, so the same code serves the CPU layout (a block is
[heads, 2 * block_size, head_dim]: all K rows, then all V rows) and the GPU ones; the two
instances need the same block size, KV dtype and attention shapes (a pruned checkpoint keeps the
attention untouched), which ``start_load_kv`` checks. vLLM's ``ExampleConnector`` stores only
whole blocks and indexes tokens with a GPU layout, so on CPU it moves nothing for short prompts.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = init_logger("moetailor.vllm.connector")
READY = "ready"
CLAIMED = "claimed-"  # prefix of a copy a decode request owns


def prompt_key(token_ids) -> str:
    return hashlib.sha256(torch.tensor(list(token_ids), dtype=torch.int64).numpy().tobytes()).hexdigest()[:32]


@dataclass
class Transfer:
    folder: str            # the request's own copy: DIR/<prompt key>/<uuid or claimed-uuid>
    block_ids: list[int]   # the request's blocks holding the transferred tokens, in order
    store: bool            # True: producer writes them; False: consumer reads them


@dataclass
class MoetailorConnectorMetadata(KVConnectorMetadata):
    transfers: list[Transfer] = field(default_factory=list)


class MoetailorConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        self.block_size = vllm_config.cache_config.block_size
        self.storage = cfg.get_from_extra_config("storage_path", None)
        if not self.storage:
            raise ValueError("MoetailorConnector needs kv_connector_extra_config={\"storage_path\": DIR}, a directory "
                             "both instances can read and write")
        os.makedirs(self.storage, exist_ok=True)
        self.producer = cfg.kv_role in ("kv_producer", "kv_both")
        self.consumer = cfg.kv_role in ("kv_consumer", "kv_both")
        # scheduler side
        self._to_load: dict[str, Request] = {}
        self._to_store: dict[str, tuple[str, list[int], int]] = {}  # req_id -> (folder, block ids so far, prompt len)
        self._claims: dict[str, str] = {}  # req_id -> the stored copy this decode request owns until it ends
        self._loads: dict[str, int] = {}  # req_id -> times its prompt KV was loaded (more than 1: reloaded on resume)
        # worker side
        self._stored: list[str] = []

    # ---- scheduler side -------------------------------------------------------------------------
    def _folder(self, key: str) -> str:
        return os.path.join(self.storage, key)

    def _claim(self, request: "Request") -> str | None:
        """The stored copy of this request's prompt (P = its prompt minus t1) that it owns: on the
        first call it takes one ready copy by renaming it, so no other request can read or delete it."""
        if request.request_id in self._claims:
            return self._claims[request.request_id]
        prompt = list(request.prompt_token_ids or [])
        if not self.consumer or len(prompt) < 2:
            return None
        parent = self._folder(prompt_key(prompt[:-1]))
        try:
            names = sorted(os.listdir(parent))
        except FileNotFoundError:
            return None
        for name in names:
            if name.startswith(CLAIMED) or not os.path.exists(os.path.join(parent, name, READY)):
                continue
            mine = os.path.join(parent, CLAIMED + uuid.uuid4().hex)
            try:
                os.rename(os.path.join(parent, name), mine)
            except OSError:
                continue  # another decode request (maybe on another instance) claimed it first
            self._claims[request.request_id] = mine
            return mine
        return None

    def _loadable(self, request: "Request") -> int:
        """Tokens the producer holds for this request: its prompt minus the last token (t1)."""
        return len(request.prompt_token_ids) - 1 if self._claim(request) else 0

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return max(0, self._loadable(request) - num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        if num_external_tokens > 0:
            self._to_load[request.request_id] = request

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = MoetailorConnectorMetadata()
        for req in scheduler_output.scheduled_new_reqs:
            prompt = list(req.prompt_token_ids or [])
            blocks = list(req.block_ids[0])
            if req.req_id in self._to_load:
                self._load(req.req_id, blocks, meta)
            elif self.producer and prompt:
                folder = os.path.join(self._folder(prompt_key(prompt)), uuid.uuid4().hex)
                self._to_store[req.req_id] = (folder, blocks, len(prompt))
                done = req.num_computed_tokens + scheduler_output.num_scheduled_tokens[req.req_id]
                self._maybe_store(req.req_id, done, meta)
        cached = scheduler_output.scheduled_cached_reqs
        # vLLM 0.34 has no resumed_req_ids: a resumed request comes again in full among the new ones
        resumed = getattr(cached, "resumed_req_ids", None) or ()
        for i, req_id in enumerate(cached.req_ids):
            if req_id in self._to_load:  # resumed after preemption: load again into its new blocks
                self._load(req_id, list(cached.new_block_ids[i][0]) if cached.new_block_ids[i] else [], meta)
            if req_id in self._to_store:
                folder, blocks, n = self._to_store[req_id]
                if cached.new_block_ids[i]:     # a resumed request's blocks are all new
                    blocks = ([] if req_id in resumed else blocks) + list(cached.new_block_ids[i][0])
                    self._to_store[req_id] = (folder, blocks, n)
                done = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]
                self._maybe_store(req_id, done, meta)
        return meta

    def _load(self, req_id: str, blocks: list[int], meta: MoetailorConnectorMetadata) -> None:
        """Load the request's claimed copy into its first blocks this step (counted in its loads)."""
        n = self._loadable(self._to_load.pop(req_id))
        meta.transfers.append(Transfer(self._claims[req_id], blocks[:_blocks_for(n, self.block_size)], False))
        self._loads[req_id] = self._loads.get(req_id, 0) + 1

    def _maybe_store(self, req_id: str, computed_after_step: int, meta: MoetailorConnectorMetadata) -> None:
        """Store once the step that computes the prompt's last token runs (chunked prefill safe)."""
        folder, blocks, n = self._to_store[req_id]
        if computed_after_step >= n:
            del self._to_store[req_id]
            meta.transfers.append(Transfer(folder, blocks[:_blocks_for(n, self.block_size)], True))

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Deletes the request's own copy of its prompt's KV (other requests with the same prompt
        hold their own copies). The request's output carries, as
        ``kv_transfer_params={"moetailor_kv_loads": n}``, how many times its prompt KV was loaded:
        1, plus 1 per resumption after a preemption (what lets a caller see the reload happen)."""
        self._to_store.pop(request.request_id, None)
        self._to_load.pop(request.request_id, None)
        loads = self._loads.pop(request.request_id, 0)
        folder = self._claims.pop(request.request_id, None)
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
            with contextlib.suppress(OSError):  # not empty: other copies of the prompt are still stored
                os.rmdir(os.path.dirname(folder))
        return False, ({"moetailor_kv_loads": loads} if loads else None)

    # ---- worker side ----------------------------------------------------------------------------
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        loads = [t for t in meta.transfers if not t.store]
        if not loads:
            return
        for name, layer in forward_context.no_compile_layers.items():
            kv = getattr(layer, "kv_cache", None)
            if not isinstance(kv, torch.Tensor):
                continue
            for t in loads:
                blocks = load_file(os.path.join(t.folder, f"{name}.safetensors"))["kv"]  # [n, ...]
                ids = torch.tensor(t.block_ids, dtype=torch.long, device=kv.device)
                if blocks.shape[1:] != kv.shape[1:] or blocks.dtype != kv.dtype or len(ids) != blocks.shape[0]:
                    raise ValueError(f"stored KV blocks {tuple(blocks.shape)} {blocks.dtype} do not fit this instance's "
                                     f"cache {tuple(kv.shape)} {kv.dtype} (layer {name}): run both instances with the "
                                     f"same block size, KV dtype and attention shapes")
                kv[ids] = blocks.to(kv.device)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for t in meta.transfers:
            if t.store:
                ids = torch.tensor(t.block_ids, dtype=torch.long, device=kv_layer.device)
                _makedirs(t.folder)
                path = os.path.join(t.folder, f"{layer_name}.safetensors")
                save_file({"kv": kv_layer[ids].detach().cpu().contiguous()}, path + ".tmp")
                os.replace(path + ".tmp", path)
                if t.folder not in self._stored:
                    self._stored.append(t.folder)

    def wait_for_save(self):
        for folder in self._stored:  # every layer of this step is written: the prompt's KV is complete
            open(os.path.join(folder, READY), "w").close()
        self._stored = []


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _makedirs(path: str, tries: int = 3) -> None:
    """``os.makedirs`` that survives a consumer removing the prompt's folder (then empty) between the
    creation of the parent and of the copy: it creates both again."""
    for attempt in range(tries):
        try:
            return os.makedirs(path, exist_ok=True)
        except FileNotFoundError:
            if attempt == tries - 1:
                raise
