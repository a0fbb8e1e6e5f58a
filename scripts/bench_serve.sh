#!/usr/bin/env bash
# `osd bench serve` against three live servers on loopback, one after another, on the same prompts:
# speculative + online learning (the default), speculative without learning, target-only (k = 0).
# PAIR_ROUNDS=N: instead, one learning server measured with its learner running vs paused (--pair-learning N).
# ROUTED=a,b,c,d,e: instead, one learning server with those adapter drafts and the router (--drafts): its
#   routing + scoring share of serving time and the drafts' memory against one draft's, from its /metrics.
# SERVE_ARGS: more `osd serve` flags for every server (e.g. --draft derived:cheap-0.5b-v2).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PORT=${PORT:-8765}
TAG=${TAG:-}                # suffix of the JSON file names (keeps earlier results)
MARKDOWN=${MARKDOWN:-}         # a markdown file to append each table to (default: none)
ARGS=${BENCH_ARGS:---prompts code --limit 4 --max-tokens 32 --concurrency 1 2 4}
run() {  # name, serve flags...
  local name=$1; shift
  .venv/bin/osd serve --port "$PORT" --checkpoint-dir "runs/bench-serve-ckpt-$name" ${SERVE_ARGS:-} "$@" > "runs/serve-$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 600); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 1; done
  .venv/bin/osd bench serve --url "http://127.0.0.1:$PORT" $ARGS --out "benchmarks/serve/bench-serve-$name$TAG.json" --markdown "$MARKDOWN"
  kill -INT "$pid"; wait "$pid" || true
}
mkdir -p runs benchmarks/serve
rm -rf runs/bench-serve-ckpt-*
if [ -n "${PAIR_ROUNDS:-}" ]; then  # one learning server, its learner running vs paused in alternating rounds
  ARGS="$ARGS --pair-learning $PAIR_ROUNDS"
  run speculative-learning-paired --learn --every-requests 4
  exit 0
fi
if [ -n "${ROUTED:-}" ]; then
  run routed-learning --learn --every-requests 4 --drafts "$ROUTED"
  exit 0
fi
run speculative-learning --learn --every-requests 4
run speculative --no-learn
run target-only --no-learn --k 0
