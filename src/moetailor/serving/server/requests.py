"""Request parsing: an OpenAI JSON body -> ``SamplingParams``, a prompt and the logprob options.

Every check of what a client sent lives here, once, before an engine sees the request (types and
finite ranges, body size, prompt characters before tokenizing, stop strings, plan name, tokenizer
routes' bodies); ``BadRequest`` is a 400, ``TooLarge`` a 413. What the engine checks itself (budget,
context, vocabulary; ``validation.check_request``) stays there, so both server kinds answer alike.
"""
from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass, replace

from ...models.chat import chat_prompt
from ...routing.budgets import expert_top_k_value
from ..logprobs import MAX_LOGPROBS
from ..sampling import SamplingParams
from ..validation import completion_room
from .limits import ServerLimits


class BadRequest(ValueError):
    pass


class TooLarge(BadRequest):
    pass


class ModelNotFound(BadRequest):
    """A model this server does not serve: 404 with code ``model_not_found`` (the OpenAI API)."""


class BodyTimeout(BadRequest):
    """The request body did not arrive in time (``--body-timeout``): 408."""


class ClientGone(Exception):
    """The client closed the connection while sending its body: logged in one line, nothing to answer."""


# OpenAI fields the server accepts and ignores (bookkeeping for the client), and fields it leaves
# to the code that implements them (log probabilities, echo).
IGNORED_FIELDS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls"}
PASSED_FIELDS = {"logprobs", "top_logprobs", "echo"}
SAMPLING_FIELDS = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                   "top_k", "seed", "stop", "stream", "stream_options", "ignore_eos", "expert_top_k", "expert_plan",
                   "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                   "suffix", "tools", "tool_choice", "functions", "function_call", "response_format"}
ROLES = ("system", "developer", "user", "assistant", "tool")
# unimplemented fields and the values that ask for nothing (a client library may send them): "none"
# is a tool choice, never a bias, a suffix or a tool list
NEUTRAL = {"logit_bias": (None, {}), "suffix": (None, ""), "tools": (None, []), "functions": (None, []),
           "tool_choice": (None, "none"), "function_call": (None, "none")}


def show(value) -> str:
    """A client's value in a message, short."""
    if isinstance(value, (list, dict)) and len(value) > 8:
        return f"a {'list' if isinstance(value, list) else 'object'} of {len(value)} items"
    try:
        text = repr(value) if isinstance(value, str) else json.dumps(value)
    except (ValueError, RecursionError):   # deeply nested
        text = type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def not_implemented(name: str, value) -> BadRequest:
    return BadRequest(f"{name}={show(value)} is not implemented by this server; leave it out "
                      "(or at its default)")


def check_unimplemented(body: dict) -> None:
    """A field the server does not implement is a 400 that says so (a silent 200 would mislead an
    evaluation harness); each at its neutral value is accepted."""
    for name in ("n", "best_of"):
        value = body.get(name)
        if value is not None:
            integer(body, name)
            if value != 1:
                raise not_implemented(name, value)
    for name, neutral, low, high in (("presence_penalty", 0.0, -2.0, 2.0), ("frequency_penalty", 0.0, -2.0, 2.0),
                                     ("repetition_penalty", 1.0, 0.0, 100.0)):
        value = number(body, name)
        if value is None:
            continue
        if not low <= value <= high:
            raise BadRequest(f"{name}={value!r} must be in [{low:g}, {high:g}]")
        if value != neutral:
            raise not_implemented(name, value)
    for name, neutral in NEUTRAL.items():
        if name in body and not any(body[name] == v and type(body[name]) is type(v) for v in neutral):
            raise not_implemented(name, body[name])
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise not_implemented("response_format", fmt)
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise BadRequest("stream_options must be an object")
        unknown = sorted(set(options) - {"include_usage", "continuous_usage_stats"})
        if unknown:
            raise BadRequest(f"unknown field stream_options.{unknown[0]}: this server does not implement it")
        for key in ("include_usage", "continuous_usage_stats"):
            boolean(options, key)   # (the field name in the message is the key's)
        if options.get("continuous_usage_stats"):
            raise not_implemented("stream_options.continuous_usage_stats", True)
        if options and body.get("stream") is not True:
            raise BadRequest("stream_options is only allowed with stream: true")
    unknown = sorted(set(body) - SAMPLING_FIELDS - IGNORED_FIELDS - PASSED_FIELDS)
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}: this server does not implement it; leave it out")


def number(body: dict, name: str, default=None):
    """A finite JSON number (not a boolean) or ``default`` when absent/null; BadRequest names the field."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"{name} must be a finite number, got {show(value)}")
    return float(value)


def integer(body: dict, name: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        value = int(value)   # 16.0 from some clients
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {show(value)}")
    return value


def boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {show(value)}")
    return value


def sampling_from(body: dict, limits: ServerLimits | None = None) -> SamplingParams:
    """SamplingParams from an OpenAI request body; BadRequest names the field and the limit."""
    limits = limits or ServerLimits()
    check_unimplemented(body)
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a non-empty string or a list of non-empty strings")
    if len(stop) > limits.max_stop_strings:
        raise BadRequest(f"stop has {len(stop)} strings; this server allows at most {limits.max_stop_strings} "
                         "(--max-stop-strings)")
    if any(len(s) > limits.max_stop_chars for s in stop):
        raise BadRequest(f"a stop string is longer than {limits.max_stop_chars} characters (--max-stop-chars)")
    for i, s in enumerate(stop):
        check_text(s, f"stop[{i}]")
    field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    seed = integer(body, "seed")
    if seed is not None and not 0 <= seed < 2**63:
        raise BadRequest(f"seed must be an integer in [0, 2**63 - 1], got {seed}")
    boolean(body, "stream")
    top_k = integer(body, "top_k", 0)
    if top_k == -1:   # vLLM's and many clients' spelling of "off"
        top_k = 0
    try:
        return SamplingParams(max_tokens=integer(body, field, 16),
                              temperature=number(body, "temperature", 1.0), top_p=number(body, "top_p", 1.0),
                              top_k=top_k, seed=seed, stop=tuple(stop),
                              ignore_eos=boolean(body, "ignore_eos"),
                              expert_top_k=expert_top_k_value(body.get("expert_top_k")))
    except ValueError as e:
        raise BadRequest(str(e)) from None


def check_text(text: str, name: str) -> None:
    """A JSON string may hold a lone surrogate ("\\ud800"), which no tokenizer can encode: a 400 naming the field."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRequest(f"{name} holds an unpaired UTF-16 surrogate ({text[e.start]!r} at character {e.start}), "
                         "which is not text; send valid Unicode") from None


def chat_message(m, i: int) -> dict:
    """One chat message in the forms the OpenAI API allows, as {role, content: str} (plus the tool
    fields a template may render): content as a string, a list of text parts (joined with newlines),
    or null in an assistant message that carries tool_calls. Non-text parts are refused by type."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise BadRequest(f"{where} must be an object with role and content, got {show(m)}")
    role = m.get("role", "user")
    if role not in ROLES:
        raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)}, got {show(role)}")
    content = m.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                if not isinstance(part, dict) or not isinstance(kind, str):
                    raise BadRequest(f"{where}.content[{j}] must be a part object like {{\"type\": \"text\", "
                                     f"\"text\": ...}}, got {show(part)}")
                raise BadRequest(f"{where}.content[{j}] has type {show(kind)}: only text parts are implemented by "
                                 "this server (the model reads text); send the text, or leave the part out")
            if not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}.content[{j}].text must be a string")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif content is None and role == "assistant" and m.get("tool_calls"):
        content = ""
    if not isinstance(content, str):
        raise BadRequest(f"{where}.content must be a string or a list of text parts, got {show(content)} (null is "
                         "allowed in an assistant message with tool_calls)")
    check_text(content, f"{where}.content")
    out = {"role": role, "content": content}
    for key in ("name", "tool_call_id", "tool_calls"):
        if m.get(key) is not None:
            out[key] = m[key]
    return out


def prompt_from(body: dict, tokenizer, chat: bool, max_chars: int, max_messages: int = 4096):
    """The request's prompt (text or token ids), its size checked before anything tokenizes it.
    Renders a chat template, so the server calls it off the event loop."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list of {role, content} objects with role one of "
                             f"{', '.join(ROLES)}")
        if len(messages) > max_messages:
            raise TooLarge(f"messages has {len(messages)} entries; this server allows at most {max_messages} "
                           "(--max-messages)")
        messages = [chat_message(m, i) for i, m in enumerate(messages)]
        chars = sum(len(m["content"]) for m in messages)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]   # a batch of one
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(t, (str, list)) for t in prompt):
            raise BadRequest(f"prompt holds {len(prompt)} prompts (a batch): several prompts in one request are not "
                             "implemented by this server; send one request per prompt (a string or one list of "
                             "token ids)")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt))):
            raise BadRequest("prompt must be a string or a non-empty list of token ids (integers)")
        chars = len(prompt) if isinstance(prompt, str) else 0
    if chars > max_chars:
        raise TooLarge(f"the prompt has {chars} characters; this server allows at most {max_chars} "
                       "(--max-prompt-chars)")
    if not chat and isinstance(prompt, str):
        check_text(prompt, "prompt")
    return render_chat(tokenizer, messages) if chat else prompt


@dataclass(frozen=True)
class LogprobRequest:
    """What a request asked for beside the tokens: logprobs with the top N alternatives per token,
    and (completions) the prompt echoed back before the completion, with its logprobs."""
    top: int | None = None      # None = no logprobs
    echo: bool = False
    generate: bool = True       # False for echo with max_tokens 0: the prompt is scored, nothing generated


def logprob_request(body: dict, chat: bool) -> LogprobRequest:
    """The ``logprobs`` / ``top_logprobs`` / ``echo`` fields, type-checked; BadRequest names the field."""
    def top_n(name: str, value) -> int | None:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
            raise BadRequest(f"{name} must be an integer from 0 to {MAX_LOGPROBS} (alternatives per token), "
                             f"got {value!r}")
        return value
    if chat:
        wanted, top = body.get("logprobs"), top_n("top_logprobs", body.get("top_logprobs"))
        if wanted is not None and not isinstance(wanted, bool):
            raise BadRequest(f"logprobs must be true or false in chat completions (top_logprobs sets how many "
                             f"alternatives), got {wanted!r}")
        if top is not None and not wanted:
            raise BadRequest("top_logprobs needs logprobs: true")
        if body.get("echo") not in (None, False):   # a completions field: chat has no prompt text to echo
            raise not_implemented("echo", body["echo"])
        return LogprobRequest(top=(top or 0) if wanted else None)
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise BadRequest(f"echo must be true or false, got {echo!r}")
    limit = body.get("max_completion_tokens")
    limit = body.get("max_tokens") if limit is None else limit
    no_tokens = type(limit) in (int, float) and limit == 0   # 0 or 0.0, as 16.0 is read as 16
    if no_tokens and not echo:
        raise BadRequest("max_tokens must be at least 1 (0 is allowed with echo: true, which scores the prompt)")
    return LogprobRequest(top=top_n("logprobs", body.get("logprobs")), echo=bool(echo),
                          generate=not (echo and no_tokens))




def render_chat(tokenizer, messages: list[dict]) -> str:
    """The tokenizer's chat template when it has one, else plain "role: content" lines."""
    try:
        return chat_prompt(tokenizer, messages)
    except Exception as e:   # e.g. a template that wants alternating user/assistant turns
        raise BadRequest(f"the model's chat template rejected these messages: {str(e)[:200]}") from None


def completion_request(body: dict, chat: bool, limits: ServerLimits,
                       has_tokenizer: bool) -> tuple[SamplingParams, LogprobRequest]:
    """The sampling parameters and logprob options of a /v1/completions or /v1/chat/completions body."""
    extra = logprob_request(body, chat)
    # echo with max_tokens 0 scores the prompt: one token is generated (and dropped) to run the prefill
    one_token = {**body, "max_tokens": 1, "max_completion_tokens": None}
    sampling = sampling_from(body if extra.generate else one_token, limits)
    if (extra.top is not None or extra.echo) and not has_tokenizer:
        raise BadRequest("logprobs and echo need the model's tokenizer to return token text; serve a "
                         "checkpoint directory that has tokenizer files")
    if extra.top is not None:
        sampling = replace(sampling, logprobs=extra.top, prompt_logprobs=extra.top if extra.echo else None)
    return sampling, extra


def default_budget(body: dict, chat: bool) -> bool:
    """A chat request without max_tokens (or max_completion_tokens) may run to the end of the context,
    as in the OpenAI API and vLLM; a completion's default stays 16 tokens (the OpenAI completions API)."""
    return chat and body.get("max_tokens") is None and body.get("max_completion_tokens") is None


def fit_budget(sampling: SamplingParams, extra: "LogprobRequest", n_prompt: int, limits) -> SamplingParams:
    """The request's sampling with its budget set from the prompt's size: a chat request without
    max_tokens gets all the room left (``default_budget``); echo with max_tokens 0 runs one step.
    A prompt that leaves no room is a 400 that names the prompt and the limit, never a max_tokens
    the client did not send."""
    room, bound = completion_room(n_prompt, limits)
    if room < 1:
        why = ("echo with max_tokens 0 scores the prompt in one step, which needs room for one token more"
               if not extra.generate else "no room is left for the completion")
        raise BadRequest(f"the prompt has {n_prompt} tokens and fills {bound}: {why}; shorten the prompt to at most "
                         f"{n_prompt + room - 1} tokens")
    return sampling if not extra.generate else replace(sampling, max_tokens=room)


def resolve_plan(body: dict, plans: dict, colocated: bool):
    """(plan, name) the request's ``expert_plan`` names; (None, None) for the engine's own plan."""
    name = body.get("expert_plan")
    if name is None or name == "default":
        return None, None
    if not isinstance(name, str) or name not in plans:
        if not colocated:   # disaggregated: the decode worker holds one pool
            raise BadRequest(f"unknown expert_plan {show(name)}; a disaggregated server has only \"default\" "
                             "(the decode worker's pool); use expert_top_k, or a colocated server for plans")
        raise BadRequest(f"unknown expert_plan {show(name)}; this server has: "
                         f"{', '.join(['default', *sorted(plans)])} (start it with --expert-plan NAME=PATH to "
                         "add one)")
    return plans[name], name


async def read_body(request, limits: ServerLimits, model_name: str) -> dict:
    """The request's JSON object, its size bounded while it is read (Content-Length first)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_request_bytes:
        raise TooLarge(f"the request body has {int(declared)} bytes; this server allows at most "
                       f"{limits.max_request_bytes} (--max-request-bytes)")
    from starlette.requests import ClientDisconnect

    chunks, size = [], 0
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limits.max_request_bytes:
                    raise TooLarge(f"the request body is over {limits.max_request_bytes} bytes; this server allows "
                                   f"at most that (--max-request-bytes)")
                chunks.append(chunk)
    except TimeoutError:
        raise BodyTimeout(f"the request body was not complete {limits.body_timeout_s:g} s after the request head "
                          f"({size} bytes arrived; --body-timeout); send the whole body at once") from None
    except ClientDisconnect:
        raise ClientGone(f"the client closed the connection after {size} bytes of the request body") from None
    data = b"".join(chunks)
    try:   # a big body parses off the event loop (8 MiB takes ~0.1 s)
        body = await asyncio.to_thread(json.loads, data) if len(data) > 2**16 else json.loads(data)
    except (ValueError, RecursionError):   # also bad UTF-8 and integers of thousands of digits
        raise BadRequest("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("model") not in (None, model_name):
        raise ModelNotFound(f"unknown model {show(body.get('model'))}; this server serves {model_name!r}")
    return body


def tokenize_request(body: dict, max_chars: int) -> tuple[str, bool]:
    """(prompt, add_special_tokens) of a /tokenize body, sized like a prompt."""
    prompt, special = body.get("prompt"), body.get("add_special_tokens", False)
    if not isinstance(prompt, str):
        raise BadRequest("prompt must be a string")
    if not isinstance(special, bool):
        raise BadRequest(f"add_special_tokens must be true or false, got {special!r}")
    if len(prompt) > max_chars:
        raise TooLarge(f"the prompt has {len(prompt)} characters; this server allows at most "
                       f"{max_chars} (--max-prompt-chars)")
    check_text(prompt, "prompt")
    return prompt, special


def detokenize_request(body: dict, max_ids: int, vocab_size: int) -> list[int]:
    """The token ids of a /detokenize body: integers in the vocabulary (an id past it decoded to ""
    silently, a negative one was a 500), at most ``max_ids`` of them."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise BadRequest("tokens must be a list of token ids (integers)")
    if len(tokens) > max_ids:
        raise TooLarge(f"tokens has {len(tokens)} ids; this server allows at most {max_ids} "
                       "(--max-detokenize-ids)")
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise BadRequest(f"tokens holds {show(bad)}, outside the tokenizer's vocabulary (0..{vocab_size - 1})")
    return tokens
