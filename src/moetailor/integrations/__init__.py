"""moetailor's techniques inside other serving systems (``vllm``: a vLLM general plugin)."""
