#!/usr/bin/env bash
# Install (idempotently) and run the main job on the bundled default models.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The bundled target on osd's Q4 kernel (auto), the shipped cheap draft behind the n-gram lookup: the fast path
# (README, "A cheap draft"). Any flag given here overrides these (e.g. --draft bundled:qwen2.5-coder-0.5b).
exec .venv/bin/osd demo --draft derived:cheap-0.5b-v3 --lookup "$@"
