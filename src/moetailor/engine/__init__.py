"""The phase-aware serving engine: continuous batching over a paged KV cache, one expert policy
per step (prefill or decode), colocated or disaggregated, with an OpenAI-compatible server."""
from .llm import LLM, RequestOutput, StepRecord, StreamDelta
from .sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "StepRecord", "StreamDelta"]
