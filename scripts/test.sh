#!/usr/bin/env bash
# Install (idempotently) and run the test suite. Real-model tests use the bundled pair (converted once, cached).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q "$@"
