"""One adapter per vLLM model-runner generation (``names.py``), behind one interface: which runner
classes load models (their ``load_model`` is wrapped to hook the MoE layers), and how each step's
tokens reach ``StepTokens`` (per token: decode or prefill, and its request's ``expert_top_k``).

  * ``V1``: wraps ``GPUModelRunner._prepare_inputs`` and reads the persistent ``InputBatch``;
  * ``V2``: wraps, on the runner's own ``model_state`` object (no class), ``add_request``, which
    sees each request's sampling parameters, and ``prepare_inputs``, which runs before every forward
    with the step's ``InputBatch`` and the runner's ``RequestState``.

A token is a decode token when its position (the request's computed tokens before the step plus its
place in the step) is at or past its request's prompt length (or the earlier position the request
names in ``extra_args["moetailor_decode_from"]``), in both generations.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from . import names as N


def step_positions(counts, computed) -> tuple[np.ndarray, np.ndarray]:
    """Per request of a step (tokens scheduled, tokens computed before it) -> per token: its
    request's place in the batch [T] and its position in the request [T]."""
    counts = np.asarray(counts, dtype=np.int64)
    req = np.repeat(np.arange(len(counts)), counts)                                   # [T]
    starts = np.cumsum(counts) - counts
    query_pos = np.arange(len(req)) - np.repeat(starts, counts)                       # [T]
    return req, np.asarray(computed, dtype=np.int64)[req] + query_pos                  # [T], [T]


def step_phases(counts, computed, prompt_lens) -> tuple[np.ndarray, np.ndarray]:
    """Per request of a step (tokens scheduled, tokens computed before it, prompt length) ->
    per token: its request's place in the batch [T] and whether it is a decode token [T]."""
    req, positions = step_positions(counts, computed)
    return req, positions >= np.asarray(prompt_lens, dtype=np.int64)[req]


def check_fields(obj, module: str, owner: str, generation: str | None = None) -> None:
    """Refuse (one line) an object that lacks a registry field of its class: the instance fields
    that no import can show, checked on the real objects when the plugin first meets them (the
    optional entries too: the object is here, so the plugin is about to read them)."""
    missing = [e.qualname for e in N.REGISTRY if e.module == module and e.owner == owner and e.kind == "attribute"
               and e.runner in (None, generation) and not hasattr(obj, e.qualname.rpartition(".")[2])]
    if missing:
        import vllm

        raise RuntimeError(f"moetailor's vLLM plugin supports vLLM {', '.join(N.SUPPORTED)}: this vLLM "
                           f"{vllm.__version__} has no {', '.join(missing)}; install one of those")


@dataclass
class RunnerAdapter:
    """The interface: ``install`` once per process, ``attach`` once per loaded runner."""

    generation: str
    loaders: tuple[tuple[str, str], ...]         # (module, class) whose own load_model is wrapped
    _installed: bool = field(default=False, repr=False)

    def install(self, on_loaded) -> None:
        """Wrap each runner class's own ``load_model``: ``on_loaded(runner, self)`` runs after it."""
        if self._installed:
            return
        self._installed = True
        for module, cls in self.loaders:
            N.wrap_method(module, f"{cls}.load_model", lambda m: _wrap_load_model(m, self, on_loaded), own=True)

    def attach(self, runner, tokens) -> None:
        raise NotImplementedError


def _wrap_load_model(load_model, adapter: RunnerAdapter, on_loaded):
    @functools.wraps(load_model)
    def wrapped(self, *args, **kwargs):
        from .experts import loading
        from .observe import check_observe_config

        check_observe_config(self.vllm_config.additional_config, worker=True)   # unwritable path: before the load
        with loading(self.vllm_config.additional_config):
            result = load_model(self, *args, **kwargs)
        on_loaded(self, adapter)
        return result
    return wrapped


class V1Adapter(RunnerAdapter):
    def __init__(self):
        super().__init__("v1", ((N.V1_RUNNER, "GPUModelRunner"), (N.V1_CPU_RUNNER, "CPUModelRunner")))

    def install(self, on_loaded) -> None:
        if not self._installed:
            N.wrap_method(N.V1_RUNNER, "GPUModelRunner._prepare_inputs", _wrap_prepare_inputs)
        super().install(on_loaded)

    def attach(self, runner, tokens) -> None:
        check_fields(runner, N.V1_RUNNER, "GPUModelRunner", "v1")
        check_fields(runner.input_batch, N.V1_BATCH, "InputBatch", "v1")
        runner._moetailor_tokens = tokens

    @staticmethod
    def prepare(runner, tokens, num_scheduled_tokens) -> None:
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        counts = np.asarray(num_scheduled_tokens[:num_reqs])
        rows = np.arange(num_reqs)
        params = [runner.requests[rid].sampling_params for rid in batch.req_ids[:num_reqs]]
        starts = [tokens.decode_from(p, int(n)) for p, n in zip(params, batch.num_prompt_tokens[rows])]
        computed = batch.num_computed_tokens_cpu[rows]
        req, decode = step_phases(counts, computed, starts)
        ks = np.array([tokens.request_k(p) for p in params], dtype=np.int64)
        ids = None
        if tokens.observer is not None:     # the step's token ids, for the observer's traffic hash
            _, positions = step_positions(counts, computed)
            ids = batch.token_ids_cpu[req, positions]
        tokens.write(decode, ks[req], ids)


def _wrap_prepare_inputs(prepare_inputs):
    @functools.wraps(prepare_inputs)
    def wrapped(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
        tokens = getattr(self, "_moetailor_tokens", None)
        if tokens is not None:
            V1Adapter.prepare(self, tokens, num_scheduled_tokens)
        return prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)
    return wrapped


class V2Adapter(RunnerAdapter):
    def __init__(self):
        # the CPU runner of this generation subclasses GPUModelRunner without its own load_model; 0.34's
        # standalone CPU runner (CPUs without Triton) is its own class with the same protocol
        super().__init__("v2", ((N.V2_RUNNER, "GPUModelRunner"), (N.V2_STANDALONE, "StandaloneCPUModelRunner")))

    def attach(self, runner, tokens) -> None:
        standalone = type(runner).__name__ == "StandaloneCPUModelRunner"
        check_fields(runner, *((N.V2_STANDALONE, "StandaloneCPUModelRunner") if standalone
                               else (N.V2_RUNNER, "GPUModelRunner")), "v2")
        if not standalone:
            check_fields(runner.req_states, N.V2_STATES, "RequestState", "v2")
        watch_model_state(runner.model_state, runner.req_states, tokens)

    @staticmethod
    def prepare(input_batch, req_states, budgets: dict[int, int], tokens, starts: dict | None = None) -> None:
        n = input_batch.num_reqs
        slots = np.asarray(input_batch.idx_mapping_np[:n])
        prompt_len = req_states.prompt_len      # a UVA-backed buffer (.np), or a CPU tensor (standalone runner)
        prompt_len = prompt_len.np if hasattr(prompt_len, "np") else prompt_len.numpy()
        prompt_len = np.asarray(prompt_len)[slots]
        if starts:
            prompt_len = np.minimum(prompt_len, [starts.get(int(s), 1 << 62) for s in slots])
        req, decode = step_phases(input_batch.num_scheduled_tokens[:n], input_batch.num_computed_tokens_np[:n],
                                  prompt_len)
        ks = np.array([budgets.get(int(s), tokens.model_k) for s in slots], dtype=np.int64)
        tokens.write(decode, ks[req])


def watch_model_state(state, req_states, tokens) -> None:
    """Wrap this ``ModelState`` object's ``add_request`` (each request's budget, by its slot) and
    ``prepare_inputs`` (the step's tokens into ``tokens``, before the forward)."""
    budgets: dict[int, int] = {}
    starts: dict[int, int | None] = {}     # a request's moetailor_decode_from, by its slot
    add_request, prepare_inputs = state.add_request, state.prepare_inputs

    @functools.wraps(add_request)
    def add(req_index, new_req_data, *args, **kwargs):
        budgets[int(req_index)] = tokens.request_k(new_req_data.sampling_params)
        starts[int(req_index)] = tokens.decode_from(new_req_data.sampling_params, 1 << 62)
        return add_request(req_index, new_req_data, *args, **kwargs)

    @functools.wraps(prepare_inputs)
    def prepare(input_batch, req_states_, *args, **kwargs):
        V2Adapter.prepare(input_batch, req_states_, budgets, tokens, starts)
        return prepare_inputs(input_batch, req_states_, *args, **kwargs)

    state.add_request = add
    state.prepare_inputs = prepare


ADAPTERS: dict[str, RunnerAdapter] = {"v1": V1Adapter(), "v2": V2Adapter()}


def adapters_for(version: str) -> list[RunnerAdapter]:
    """The adapters of the runner generations this vLLM ships (an untested version: those whose
    runner module imports)."""
    gens = N.generations(version) or tuple(g for g, a in ADAPTERS.items()
                                           if any(N.vllm_class(m, n) is not None for m, n in a.loaders))
    return [ADAPTERS[g] for g in gens]
