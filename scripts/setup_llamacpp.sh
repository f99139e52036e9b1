#!/usr/bin/env bash
# Builds llama.cpp's environment (.venv-llamacpp): llama-cpp-python compiled from its PyPI sdist,
# llama.cpp's own converter (convert_hf_to_gguf.py) and gguf package from the same sdist, torch and
# moetailor. Usage: scripts/setup_llamacpp.sh VENV
#
# Why a cache outside the checkout: compiling the sdist takes 8-13 minutes on 2 cores, and a clean
# clone (CI) on the same machine should not pay it again. Why the key holds the CPU flags: the
# build is GGML_NATIVE (tuned to this processor), and a cloud machine's processor can change between runs; a
# wheel built for another one can die with SIGILL, so it is rebuilt instead of reused.
set -euo pipefail

VENV=${1:?usage: setup_llamacpp.sh VENV}
PYTHON=${PYTHON:-python3.11}
VERSION=0.3.36
CACHE=${MOETAILOR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/moetailor}
SDIST_DIR=$CACHE/sdist
SDIST=$SDIST_DIR/llama_cpp_python-$VERSION.tar.gz
CMAKE_FLAGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=ON"

cpu_key() {
    # The processor's model name and flag set, plus the build flags: what a native build depends on.
    { grep -m1 '^model name' /proc/cpuinfo || true
      grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | sort -u | tr '\n' ' '
      echo "$CMAKE_FLAGS"; } | sha256sum | cut -c1-16
}

KEY=$(cpu_key)
WHEEL_DIR=$CACHE/wheels/llama-cpp-python-$VERSION-$KEY

# `setup_llamacpp.sh --has-wheel`: exit 0 when this processor's wheel is cached (no compile needed);
# CI uses it to know the stage's worst case before starting it.
if [ "$VENV" = "--has-wheel" ]; then
    ls "$WHEEL_DIR"/llama_cpp_python-*.whl >/dev/null 2>&1
    exit
fi
PY=$VENV/bin/python
STAMP=$VENV/.installed

# Up to date: set up on this processor, after the last change of the dependencies or of this script.
# A stamp from another processor means its native wheel may not run here: the wheel is replaced.
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ] && [ "$STAMP" -nt pyproject.toml ] && [ "$STAMP" -nt "$0" ]; then
    exit 0
fi
rm -f "$STAMP"

test -x "$PY" || "$PYTHON" -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q -e '.[test]'

if [ ! -f "$SDIST" ]; then
    mkdir -p "$SDIST_DIR"
    "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SDIST_DIR"
fi

if ! ls "$WHEEL_DIR"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $VERSION for this CPU (minutes; cached in $WHEEL_DIR)"
    tmp=$(mktemp -d)
    "$PY" -m pip install -q 'scikit-build-core[pyproject]>=0.9.2' ninja cmake
    CMAKE_ARGS="$CMAKE_FLAGS" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        "$PY" -m pip wheel --no-deps --no-build-isolation -w "$tmp" "$SDIST"
    mkdir -p "$WHEEL_DIR"
    mv "$tmp"/llama_cpp_python-*.whl "$WHEEL_DIR"/
    rmdir "$tmp"
fi
"$PY" -m pip install -q --force-reinstall --no-deps "$WHEEL_DIR"/llama_cpp_python-*.whl
"$PY" -m pip install -q 'numpy>=1.20' 'typing-extensions>=4.5' 'diskcache>=5.6.1' 'jinja2>=2.11.3'

# llama.cpp's converter and the gguf package it was written against, both from the same sdist.
SHARE=$VENV/share/llama.cpp
rm -rf "$SHARE" && mkdir -p "$SHARE"
tar -xzf "$SDIST" -C "$SHARE" --strip-components=3 \
    "llama_cpp_python-$VERSION/vendor/llama.cpp/convert_hf_to_gguf.py" \
    "llama_cpp_python-$VERSION/vendor/llama.cpp/conversion" \
    "llama_cpp_python-$VERSION/vendor/llama.cpp/gguf-py"
"$PY" -m pip install -q "$SHARE/gguf-py"
"$PY" -m pip install -q sentencepiece

"$PY" -c "import llama_cpp, gguf, moetailor; print('llama.cpp', llama_cpp.__version__, 'gguf', gguf.__file__)"
echo "$KEY" > "$STAMP"
