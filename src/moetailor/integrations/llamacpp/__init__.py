"""Running a GGUF that `moetailor export gguf` wrote in llama.cpp (llama-cpp-python 0.3.36).

These helpers are what the llama.cpp integration tests and ``scripts/llamacpp_vs_engine.py`` compare
with moetailor's engine: tokenization, last-token logits, greedy decoding (argmax, ties to the lowest
id, as the engine does), batched greedy decoding of several sequences in one llama.cpp context, and
phase-aware decoding across two GGUF files: the prompt runs in one model (the full one), its
KV cache moves with llama.cpp's state API (``llama_state_get_data`` / ``llama_state_set_data``) into
the other (the pruned one), which decodes. That works because pruning only touches the routed experts:
attention shapes, and so the KV cache's layout, are the same in both files.

llama-cpp-python is only in `.venv-llamacpp` (`make setup-llamacpp`); importing this module elsewhere
raises an error that says so.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

try:
    import llama_cpp
except ImportError as e:   # pragma: no cover - depends on the environment
    raise ImportError("llama-cpp-python is not installed in this environment: run `make setup-llamacpp` and use "
                      f".venv-llamacpp/bin/python ({e})") from None


def load(path: str | Path, *, n_ctx: int = 512, n_threads: int = 1, top_k: int | None = None,
         arch: str | None = None, kv_cache: str = "f32") -> "llama_cpp.Llama":
    """A llama.cpp model and context; ``top_k`` routes that many experts per token
    (``kv_overrides={"<arch>.expert_used_count": top_k}``, llama-cli's --override-kv). The KV cache is
    f32 unless ``kv_cache="f16"`` (llama.cpp's default, which moves logits by ~2e-3 against fp32)."""
    overrides = None if top_k is None else {f"{arch or architecture(path)}.expert_used_count": int(top_k)}
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=n_threads,
                           n_threads_batch=n_threads, kv_overrides=overrides, verbose=False, seed=0,
                           type_k=KV_TYPES[kv_cache], type_v=KV_TYPES[kv_cache])


KV_TYPES = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16}


def architecture(path: str | Path) -> str:
    """general.architecture of a GGUF file (the prefix of its metadata keys)."""
    import gguf

    field = gguf.GGUFReader(str(path)).fields["general.architecture"]
    return bytes(field.parts[field.data[0]]).decode()


def tokenize(llm, text: str) -> list[int]:
    """Token ids of ``text`` as llama.cpp splits it (no BOS, special tokens as text)."""
    return llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)


def _logits(ctx, vocab: int, row: int = -1) -> np.ndarray:
    pointer = llama_cpp.llama_get_logits_ith(ctx, row)
    return np.ctypeslib.as_array(pointer, shape=(vocab,)).copy()     # [V]


def last_logits(llm, tokens: list[int]) -> np.ndarray:
    """The logits [V] after the prompt ``tokens`` (one prefill from an empty cache)."""
    llm.reset()
    llm.eval(tokens)
    return _logits(llm.ctx, llm.n_vocab())


def _continue(llm, token: int, max_tokens: int, eos: set[int], out: list[int]) -> list[int]:
    while len(out) < max_tokens and token not in eos:
        llm.eval([token])
        token = int(np.argmax(_logits(llm.ctx, llm.n_vocab())))
        out.append(token)
    return out


def greedy(llm, tokens: list[int], max_tokens: int, eos: set[int] = frozenset()) -> list[int]:
    """Greedy completion ids (the EOS that ends it included, as the engine reports it)."""
    token = int(np.argmax(last_logits(llm, tokens)))
    return _continue(llm, token, max_tokens, eos, [token])


def phase_aware_greedy(prefill, decode, tokens: list[int], max_tokens: int, eos: set[int] = frozenset()) -> list[int]:
    """Prefill in ``prefill`` (and its first token), decode in ``decode``: the KV cache moves between the
    two contexts through llama.cpp's state API. Both files must have the same attention shapes."""
    token = int(np.argmax(last_logits(prefill, tokens)))
    decode.reset()
    decode.load_state(prefill.save_state())
    return _continue(decode, token, max_tokens, eos, [token])


class BatchedDecoder:
    """Greedy decoding of B sequences together in one llama.cpp context (one ``llama_decode`` per step for all
    of them, each sequence its own ``seq_id``): llama-cpp-python's ``Llama`` runs one sequence at a time."""

    def __init__(self, llm, max_seqs: int, n_ctx: int, n_threads: int = 1, kv_cache: str = "f32"):
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = n_ctx
        params.n_seq_max = max_seqs
        params.kv_unified = True
        params.type_k = params.type_v = KV_TYPES[kv_cache]
        params.n_threads = params.n_threads_batch = n_threads
        self.llm = llm
        self.ctx = llama_cpp.llama_init_from_model(llm.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {max_seqs} sequences of {n_ctx} cells")
        self.n_ctx, self.max_seqs = n_ctx, max_seqs
        self.batch = llama_cpp.llama_batch_init(n_ctx, 0, max_seqs)
        self.vocab = llm.n_vocab()

    def close(self) -> None:
        if self.ctx:
            llama_cpp.llama_batch_free(self.batch)
            llama_cpp.llama_free(self.ctx)
            self.ctx = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, seq_id, wants logits)."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, int(logits)
            b.seq_id[i][0] = seq
        rc = llama_cpp.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, row: int) -> int:
        return int(np.argmax(_logits(self.ctx, self.vocab, row)))

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy ``max_tokens`` ids per prompt (EOS not special: every sequence runs the full length)."""
        if len(prompts) > self.max_seqs:
            raise ValueError(f"{len(prompts)} prompts for a context of {self.max_seqs} sequences")
        if sum(len(p) for p in prompts) + len(prompts) * max_tokens > self.n_ctx:
            raise ValueError("prompts and completions do not fit the context; raise n_ctx")
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)
        entries, last = [], []
        for s, p in enumerate(prompts):                      # one prefill batch holding every prompt
            entries += [(t, j, s, j == len(p) - 1) for j, t in enumerate(p)]
            last.append(len(entries) - 1)
        self._decode(entries)
        outs = [[self._argmax(r)] for r in last]
        for step in range(1, max_tokens):                    # one decode batch: one token per sequence
            self._decode([(o[-1], len(p) + step - 1, s, True) for s, (p, o) in enumerate(zip(prompts, outs))])
            for s, o in enumerate(outs):
                o.append(self._argmax(s))
        return outs


__all__ = ["BatchedDecoder", "architecture", "greedy", "last_logits", "load", "phase_aware_greedy", "tokenize"]
