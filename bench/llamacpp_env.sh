#!/usr/bin/env bash
# Creates .venv-llamacpp: llama-cpp-python built from source (PyPI ships only its sdist), the peer that
# bench.single_stream times next to the engine on the same GGUF file and thread count. Optional: the engine
# does not need it, and the bench says how to run this script where it is missing.
#   bench/llamacpp_env.sh          # once; the build takes a while on few cores
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LLAMACPP_VENV:-$ROOT/.venv-llamacpp}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# Native build for this CPU (GGML_NATIVE: the AVX2 or AVX-512 paths this host has), as a llama.cpp user builds it.
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" "$VENV/bin/python" -m pip install -q --no-binary llama-cpp-python \
  llama-cpp-python
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'in', '$VENV')"
