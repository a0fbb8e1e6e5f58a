"""A real GGUF on the osd runner vs llama.cpp on the same file: logits of one prompt, 24 greedy tokens (rough check).

    PYTHONPATH=src python scripts/check_gguf_vs_llama_cpp.py [path]   (default: the bundled Qwen2.5-Coder 0.5B Q4_K_M,
    whose matrices are Q4_K, Q6_K, Q5_0 and Q8_0)
"""
import collections
import sys
import time
from pathlib import Path

import gguf, torch
from osd.models.q4_runner import Q4Runner
from osd.models.llama_cpp_runner import LlamaCppRunner
path = sys.argv[1] if len(sys.argv) > 1 else str(Path.home() / ".cache/osd/gguf/qwen2.5-coder-0.5b.gguf")
torch.set_num_threads(1)
t0 = time.time()
runner = Q4Runner(path, n_ctx=512, cache=False)
print("repacked in", round(time.time() - t0, 1), "s", collections.Counter(w.TYPE for l in runner.layers for f in (l.qkv, l.attn_output, l.gate_up, l.ffn_down) for w in f.weights), runner.head.weights[0].TYPE, runner._embd_type)
prompt = [2, 750, 4361, 1588, 1006, 982, 284, 220, 16, 8, 1447, 262, 470, 308, 353] + list(range(1000, 1020))
got = runner.feed(prompt, n_logits=len(prompt))
llama = LlamaCppRunner(path, n_ctx=512, threads=1, repack=False)
want = llama.feed(prompt, n_logits=len(prompt))
err = (got - want).abs()
print("vs llama.cpp: max", (err.max() / want.std()).item(), "mean", (err.mean() / want.std()).item(), "argmax agree", (got.argmax(-1) == want.argmax(-1)).float().mean().item())
# greedy 24 tokens each
def greedy(r, n=24):
    r.reset(); out = []; logits = r.feed(prompt)[0]
    for _ in range(n):
        t = int(logits.argmax()); out.append(t); logits = r.feed([t])[0]
    return out
a, b = greedy(runner), greedy(llama)
print("greedy osd", a); print("greedy llama.cpp", b); print("identical", a == b, "first difference", next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None))
llama.close()
