#!/usr/bin/env bash
# Creates .venv-llamacpp: llama-cpp-python built from source (PyPI ships only its sdist), the peer that
# bench.single_stream times next to the engine on the same GGUF file and thread count. Optional: the engine
# does not need it, and the bench says how to run this script where it is missing.
#   bench/llamacpp_env.sh          # once; the build takes a while on few cores
# An AVX2-only build beside it, to compare with the engine's AVX2 path (INFINILM_CPU_ISA=avx2) on an AVX-512 host:
#   LLAMACPP_VENV=.venv-llamacpp-avx2 CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
#     -DGGML_F16C=ON -DGGML_AVX512=OFF" bench/llamacpp_env.sh
#   INFINILM_CPU_ISA=avx2 LLAMACPP_VENV=.venv-llamacpp-avx2 .venv/bin/python -m bench.single_stream --rounds 3
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LLAMACPP_VENV:-$ROOT/.venv-llamacpp}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# pip caches a wheel it built: a build with other CMAKE_ARGS must not reuse it.
# Native build for this CPU (GGML_NATIVE: the AVX2 or AVX-512 paths this host has), as a llama.cpp user builds it.
CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" "$VENV/bin/python" -m pip install -q --no-cache-dir --no-binary llama-cpp-python \
  llama-cpp-python
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'in', '$VENV')"
