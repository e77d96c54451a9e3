#!/usr/bin/env bash
# A lent GPU's checks in two or three prepared calls (docs/perf/gpu.md, "Running the device check").
#   bench/gpu_session.sh prepare [GGUF]   here: .device/ with SmolLM2's GGUF in two halves and the wheels the
#                                         device's Python 3.12 lacks (gguf, msgspec), then the calls to make
#   bench/gpu_session.sh run SECTIONS [gpu_check args]
#                                         there: install the wheels, join the GGUF once both halves have come,
#                                         run bench.gpu_check on SECTIONS (comma-separated), log and JSON to $OUT
# The device takes at most 64 MiB of tree and carried files a call, and the GGUF is about 98 MB: each half
# travels in its own call, and a half carried earlier stays there (ignored paths are kept between calls).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DEV="${GPU_SESSION_DIR:-.device}"  # the environment overrides are for tests/unit/bench/test_gpu_session.py
PART_BYTES="${GPU_SESSION_PART_BYTES:-50M}"

prepare() {
  local gguf="${1:-}"
  if [ -z "$gguf" ]; then
    gguf="$(.venv/bin/python -c "from engine.model_registry import gguf_file; print(gguf_file('smollm2'))")"
  fi
  [ -f "$gguf" ] || { echo "no GGUF at $gguf" >&2; exit 2; }
  if [ "$DEV" = .device ]; then grep -qxF "/$DEV/" .git/info/exclude 2>/dev/null || echo "/$DEV/" >> .git/info/exclude; fi
  rm -rf "$DEV" && mkdir -p "$DEV/whl"
  split -b "$PART_BYTES" -d "$gguf" "$DEV/smollm2.gguf.part-"
  local gguf_version msgspec_version parts=("$DEV"/smollm2.gguf.part-*)
  [ "${#parts[@]}" = 2 ] || { echo "expected two GGUF parts, got ${#parts[@]}: change PART_BYTES" >&2; exit 2; }
  gguf_version="$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("gguf"))')"
  msgspec_version="$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("msgspec"))')"
  if [ "${GPU_SESSION_WHEELS:-1}" = 1 ]; then
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$DEV/whl" "gguf==$gguf_version" "msgspec==$msgspec_version"
  fi
  cat <<EOF
Prepared $DEV/ ($(du -sh "$DEV" | cut -f1)). The device calls, inside a session's 15 minutes of device time
(machine start included); gpu_check starts no section after --time-budget seconds and rewrites its JSON after
every section, so a call cut off early still brings back what it finished:
  1. carry ["$DEV/whl", "${parts[0]}"], timeout_s 300, command:
     bench/gpu_session.sh run kernels,llama3_8b_unfused,llama3_8b_shaped,tiny_vs_hf_fp32,decode_sweep --time-budget 200
     (about 190 s of sections; the unfused decoder first, since the runs that timed the fused one first found its
     mixed-step prefill slower: docs/perf/gpu.md, "Open: prefill in mixed steps"; the launch sweeps last, about
     180 timed launches in some 100 s, so that a sweep that runs long costs no other section; it saves each
     shape's results as it goes)
  2. carry ["$DEV/whl", "${parts[1]}"], timeout_s 480, command:
     bench/gpu_session.sh run weight_formats,kv_formats,smollm2_vs_hf,smollm2_speed --time-budget 360
  3. only for sections the second call's JSON marks "skipped" or lacks: no carry, the same command on those.
Then, here: python -m bench.gpu_check --report <the JSON files>, which prints the issues' targets (met or missed)
and rewrites docs/perf/gpu.md's generated sections.
EOF
}

run() {
  local sections="${1:?sections, comma-separated}"
  shift
  local out="${OUT:-$DEV/out}" name
  name="gpu_check-$(echo "$sections" | tr ',' '-' | cut -c1-60)"
  mkdir -p "$out"
  if ! python3 -c "import gguf, msgspec" 2>/dev/null && [ -n "$(ls "$DEV"/whl/*.whl 2>/dev/null)" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$DEV"/whl/*.whl
  fi
  export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
  local gguf=()
  if [ ! -f "$DEV/smollm2.gguf" ] && [ "$(ls "$DEV"/smollm2.gguf.part-* 2>/dev/null | wc -l)" = 2 ]; then
    cat "$DEV"/smollm2.gguf.part-* > "$DEV/smollm2.gguf.tmp" && mv "$DEV/smollm2.gguf.tmp" "$DEV/smollm2.gguf"
  fi
  [ -f "$DEV/smollm2.gguf" ] && gguf=(--smollm2-gguf "$DEV/smollm2.gguf")
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/$name.log"
  fi
  python3 -m bench.gpu_check --sections "$sections" --name "$name" "${gguf[@]}" "$@" 2>&1 | tee -a "$out/$name.log"
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  run) shift; run "$@" ;;
  *) echo "usage: bench/gpu_session.sh {prepare [GGUF] | run SECTIONS [gpu_check args]}" >&2; exit 2 ;;
esac
