"""The phase-aware serving engine: continuous batching over a paged KV cache, one expert policy
per step (prefill or decode), colocated or disaggregated, with an OpenAI-compatible server."""
from .llm import LLM, StepRecord
from .sampling import SamplingParams
from .outputs import RequestOutput, StreamDelta

__all__ = ["LLM", "SamplingParams", "RequestOutput", "StepRecord", "StreamDelta"]
