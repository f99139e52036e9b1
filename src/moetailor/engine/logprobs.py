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


CONTEXT_TOKENS = 8   # tokens decoded before each one, so a token renders as it does inside the text


def token_pieces(token_ids: list[int], decode, context: list[int] = ()) -> list[str]:
    """Each token's share of the decoded text, so the pieces join to ``decode(token_ids)``: a token
    that ends inside a multi-byte character gets "" and the token completing it gets the character
    (decoding tokens one by one gives U+FFFD pieces that do not join). ``context``: tokens before."""
    ids = [*context, *token_ids]
    pieces = []
    for i in range(len(context), len(ids)):
        start = max(0, i - CONTEXT_TOKENS)
        before = decode(ids[start:i]).rstrip("\ufffd")
        now = decode(ids[start:i + 1])
        if i < len(ids) - 1:     # an incomplete character waits for the token that completes it
            now = now.rstrip("\ufffd")
        pieces.append(now[len(before):] if now.startswith(before) else now)
    return pieces


def _alternative_keys(ids: list[int], decode) -> list[str]:
    """Distinct keys for the top alternatives: a token's text, or where several render alike (bytes
    of one multi-byte character all decode to U+FFFD) ``token:ID`` for the later ones."""
    keys, seen = [], set()
    for t in ids:
        key = decode([t])
        if key in seen:
            key = f"token:{t}"
        seen.add(key)
        keys.append(key)
    return keys


def completion_logprobs(entries: list[TokenLogprob | None], token_ids: list[int], decode,
                        text_offset: int = 0, context: list[int] = ()) -> dict:
    """The legacy completions object: per token its text, logprob (None for an unscored first
    prompt token), ``{text: logprob}`` of the top alternatives and its character offset in the
    returned text. ``decode(ids) -> str``; ``token_ids`` covers the entries (same length);
    ``context``: the tokens returned before them (streaming)."""
    tokens = token_pieces(token_ids, decode, context)
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
        top = _with_chosen(entry)
        top_logprobs.append(dict(zip(_alternative_keys([t for t, _ in top], decode), (lp for _, lp in top))))
    return {"tokens": tokens, "token_logprobs": token_logprobs_, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprob], decode) -> dict:
    """The chat completions object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def item(token_id: int, logprob: float) -> dict:
        text = decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries]}
