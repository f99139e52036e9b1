"""Log-probabilities beside tokens, per generated token (``SamplingParams.logprobs``) and per prompt
token (``prompt_logprobs``, the server's ``echo``): from the raw next-token distribution (before
temperature / top-k / top-p), as vLLM reports them. Also the OpenAI completions and chat
``logprobs`` shapes, with ``TokenText``: each token's own bytes and the text pieces a run decodes to.
"""
from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from functools import lru_cache

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


# ---- token text ---------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` inverted: the character a byte-level BPE vocabulary writes for
    each byte -> that byte (printable Latin-1 bytes stand for themselves, the rest are shifted to 256+)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


@dataclass
class TokenText:
    """A tokenizer's view of single tokens for log-probabilities: each token's own raw bytes, and the
    pieces of the text that a run of tokens decodes to (which join to that text).

    Bytes come from the vocabulary, never from decoding: a byte-level BPE token (GPT-2, Qwen,
    OLMoE, DeepSeek) spells its bytes in GPT-2's byte-to-character map, so the two tokens of "é" are
    ``[195]`` and ``[169]`` (decoding either alone gives U+FFFD). A sentencepiece byte-fallback token
    ``<0xC3>`` is its byte; an added (special) token is its text."""
    tokenizer: object
    _raw: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        self.byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
        self.added = {i: t.content for i, t in (getattr(self.tokenizer, "added_tokens_decoder", None) or {}).items()}
        self.special = set(getattr(self.tokenizer, "all_special_ids", None) or ())

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def raw(self, token_id: int) -> bytes:
        """The token's own bytes (cached: a server asks for the same tokens again and again)."""
        found = self._raw.get(token_id)
        if found is None:
            found = self._raw[token_id] = self._raw_bytes(token_id)
        return found

    def _raw_bytes(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode("utf-8")
        token = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(token, str):
            table = _byte_of_char()
            if self.byte_level and all(c in table for c in token):
                return bytes(table[c] for c in token)
            if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                try:
                    return bytes([int(token[3:5], 16)])
                except ValueError:
                    pass
        text = self.decode([token_id])
        if "\ufffd" in text and isinstance(token, str):   # a piece of a character that decodes to nothing whole
            return token.replace("\u2581", " ").encode("utf-8")
        return text.encode("utf-8")

    def pieces(self, token_ids: list[int], context: list[int] = (), final: bool = True) -> list[str]:
        """Each token's share of the decoded text, so the pieces join to ``decode(token_ids)``: a token
        that ends inside a multi-byte character gets "" and the token completing it the character.
        ``context``: the tokens before them (streaming); ``final``: the last token ends the text (an
        incomplete character there is U+FFFD, as in the text), else it waits for the next token."""
        if self.byte_level:
            found = self._byte_pieces([*context, *token_ids], final)
            if found is not None:
                return found[len(context):]
        return self._window_pieces(token_ids, context, final)

    def _byte_pieces(self, ids: list[int], final: bool) -> list[str] | None:
        """Pieces from the tokens' raw bytes through one incremental UTF-8 decoder, or None when they
        do not join to the tokenizer's own decoding (a tokenizer that also rewrites text)."""
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        out = [decoder.decode(self.raw(t)) for t in ids]
        tail = decoder.decode(b"", final=True)
        if "".join(out) + tail != self.decode(ids):
            return None
        if final and out:
            out[-1] += tail
        return out

    def _window_pieces(self, token_ids: list[int], context: list[int], final: bool) -> list[str]:
        """Pieces from decoding a short window of tokens before each one (a token renders as it does
        inside the text); the window reaches back past any run of tokens that decode to nothing whole."""
        ids = [*context, *token_ids]
        pieces = []
        for i in range(len(context), len(ids)):
            start = max(0, i - CONTEXT_TOKENS)
            while start > 0 and not self.decode(ids[start:i]).strip("\ufffd"):
                start = max(0, start - CONTEXT_TOKENS)
            before = self.decode(ids[start:i]).rstrip("\ufffd")
            now = self.decode(ids[start:i + 1])
            if i < len(ids) - 1 or not final:   # an incomplete character waits for the token that completes it
                now = now.rstrip("\ufffd")
            pieces.append(now[len(before):] if now.startswith(before) else now)
        return pieces


CONTEXT_TOKENS = 8   # tokens decoded before each one (streaming: the tokens already returned that a piece needs)


def fit_to_text(pieces: list[str], start: int, end: int) -> list[str]:
    """The pieces (the first at text offset ``start``) that begin before offset ``end``, the last cut
    to end there: the tokens of a completion whose text was cut at a stop string end where the text
    ends. Tokens wholly inside the stop string are dropped; a token that straddles the cut is kept
    with its text up to the cut."""
    kept, pos = [], start
    for piece in pieces:
        if pos >= end:
            break
        kept.append(piece[:end - pos])
        pos += len(piece)
    return kept


# ---- OpenAI response shapes --------------------------------------------------------------------

def _finite(logprob: float) -> float | None:
    """A logprob JSON can carry: -inf (a token the model rules out) as -9999.0 (vLLM's value), NaN as null."""
    if logprob != logprob:
        return None
    return max(logprob, -9999.0) if logprob < 0 else logprob


def _with_chosen(entry: TokenLogprob) -> list[tuple[int, float]]:
    """The top alternatives plus the chosen token (OpenAI: up to N + 1 entries)."""
    top = list(entry.top)
    if all(t != entry.token_id for t, _ in top):
        top.append((entry.token_id, entry.logprob))
    return top


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


def completion_logprobs(entries: list[TokenLogprob | None], pieces: list[str], text: TokenText,
                        text_offset: int = 0) -> dict:
    """The legacy completions object: per token its text (``pieces``, from ``TokenText.pieces``),
    logprob (None for an unscored first prompt token), ``{text: logprob}`` of the top alternatives
    and its character offset in the returned text. ``entries`` and ``pieces`` are the same tokens."""
    offsets, pos = [], text_offset
    for piece in pieces:
        offsets.append(pos)
        pos += len(piece)
    token_logprobs_, top_logprobs = [], []
    for entry in entries:
        if entry is None:
            token_logprobs_.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs_.append(_finite(entry.logprob))
        top = _with_chosen(entry)
        top_logprobs.append(dict(zip(_alternative_keys([t for t, _ in top], text.decode),
                                     (_finite(lp) for _, lp in top))))
    return {"tokens": list(pieces), "token_logprobs": token_logprobs_, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprob], text: TokenText, cut: str | None = None) -> dict:
    """The chat completions object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``, each
    ``bytes`` the token's own raw bytes. ``cut``: the last entry's text when the content ended
    inside it (a stop string): its token and bytes stop there too."""
    def item(token_id: int, logprob: float) -> dict:
        return {"token": text.decode([token_id]), "logprob": _finite(logprob), "bytes": list(text.raw(token_id))}
    content = [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
    if cut is not None and content:
        last, raw = content[-1], text.raw(entries[-1].token_id)
        kept = cut.encode("utf-8")
        last["token"], last["bytes"] = cut, list(raw[:len(kept)] if raw.startswith(kept) else kept)
    return {"content": content}
