"""Log-probabilities the engine returns beside tokens: the chosen token's and the top-N alternatives',
per generated token (``SamplingParams.logprobs``) and per prompt token (``prompt_logprobs``, what the
server's ``echo`` returns). Values are from the model's raw next-token distribution (log-softmax of
the step's logits, before temperature / top-k / top-p), as vLLM reports them by default.

Also the two OpenAI response shapes built from them: the legacy completions ``logprobs`` object
(``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``) and the chat ``logprobs.content``
list.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20   # top alternatives per token a request may ask for (vLLM's default limit)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()   # the N most likely tokens (id, logprob), most likely first


def token_logprobs(logits: torch.Tensor, token_ids: list[int], n: int) -> list[TokenLogprob]:
    """Rows of logits [R, V] scoring ``token_ids`` [R] (row r predicts token r), with the top ``n``."""
    logp = torch.log_softmax(logits.float(), dim=-1)                                     # [R, V]
    ids = torch.tensor(token_ids, dtype=torch.long, device=logp.device)                  # [R]
    chosen = logp.gather(-1, ids[:, None])[:, 0].tolist()                                # [R]
    if n > 0:
        values, indices = logp.topk(min(n, logp.shape[-1]), dim=-1)                      # [R, n]
        tops = [tuple(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    else:
        tops = [()] * len(token_ids)
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(token_ids, chosen, tops)]


def prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], n: int) -> list[TokenLogprob | None]:
    """Per prompt token from the prefill's logits [P, V] (row p predicts token p + 1); the first
    token has no prediction (None), as in OpenAI's and vLLM's echo."""
    return [None, *token_logprobs(logits[:-1], prompt_ids[1:], n)]


# ---- a step's sequences ------------------------------------------------------------------------

def take_prompt_logprobs(seqs: list, every: list[bool], logits: torch.Tensor) -> torch.Tensor:
    """After a prefill that kept every position's logits for the ``every`` sequences: store their
    prompt logprobs and return each sequence's last row [B, V]."""
    last, start = [], 0
    for seq, all_rows in zip(seqs, every):
        n = len(seq) if all_rows else 1
        if all_rows:
            p = seq.num_prompt_tokens
            seq.prompt_logprobs = prompt_logprobs(logits[start:start + p], seq.token_ids[:p],
                                                  seq.sampling.prompt_logprobs)
        last.append(start + n - 1)
        start += n
    return logits[last]


def record_logprobs(seqs: list, logits: torch.Tensor, tokens: list[int]) -> None:
    """Append each asking sequence's sampled token with its logprob and top alternatives."""
    rows = [i for i, s in enumerate(seqs) if s.logprobs is not None]
    if not rows:
        return
    n = max(seqs[i].sampling.logprobs for i in rows)
    for i, entry in zip(rows, token_logprobs(logits[rows], [tokens[i] for i in rows], n)):
        seqs[i].logprobs.append(TokenLogprob(entry.token_id, entry.logprob, entry.top[:seqs[i].sampling.logprobs]))


# ---- OpenAI response shapes --------------------------------------------------------------------

def _with_chosen(entry: TokenLogprob) -> list[tuple[int, float]]:
    """The top alternatives plus the chosen token (OpenAI: up to N + 1 entries)."""
    top = list(entry.top)
    if all(t != entry.token_id for t, _ in top):
        top.append((entry.token_id, entry.logprob))
    return top


def completion_logprobs(entries: list[TokenLogprob | None], token_ids: list[int], decode,
                        text_offset: int = 0) -> dict:
    """The legacy completions object: per token its text, logprob (None for an unscored first
    prompt token), ``{text: logprob}`` of the top alternatives and its character offset in the
    returned text. ``decode(ids) -> str``; ``token_ids`` covers the entries (same length)."""
    tokens = [decode([t]) for t in token_ids]
    offsets, pos = [], text_offset
    for text in tokens:
        offsets.append(pos)
        pos += len(text)
    token_logprobs_, top_logprobs = [], []
    for entry in entries:
        if entry is None:
            token_logprobs_.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs_.append(entry.logprob)
        top_logprobs.append({decode([t]): lp for t, lp in _with_chosen(entry)})
    return {"tokens": tokens, "token_logprobs": token_logprobs_, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprob], decode) -> dict:
    """The chat completions object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def item(token_id: int, logprob: float) -> dict:
        text = decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}
