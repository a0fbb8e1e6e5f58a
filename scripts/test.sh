#!/usr/bin/env bash
# Install (idempotently) and run the test suite. Real-model tests use the bundled pair (converted once, cached).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --llama-cpp  # the tests compare with llama.cpp: build it (once per machine)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# setup built the kernels where the CPU has AVX2: there a missing kernel fails its tests instead of skipping them
grep -qw avx2 /proc/cpuinfo 2>/dev/null && export OSD_REQUIRE_KERNELS=${OSD_REQUIRE_KERNELS:-1}
exec .venv/bin/python -m pytest -q -rs "$@"  # -rs: every skip and its reason in the summary (VNNI-only tests)
