"""`osd bench kernel`: what our own Q4_K/Q6_K kernel (models/q4.py) costs for 1..8 rows on the target's matrices.

Verification pays only where k+1 rows cost little more than one. Measured here, per token:
- per matrix shape (q, k, v, o, gate, up, down, LM head, with the GGUF's quant types): ms for 1..8 rows, the
  ratio to one row, GB/s of weights read. Weights are random blocks in the kernel's layout (speed does not
  depend on values), rotated over enough copies that they stream from memory as a forward's would;
- a model pass: every matrix of the 28 layers plus the LM head, distinct weights (~1 GB), the activations
  quantized once per input as a forward would (q/k/v share one, gate/up another): the kernel's whole share of
  a forward;
- the torch "glue" a forward built on the kernel would add per token (RMSNorm, biases, RoPE, KV-cache write,
  attention over `context` cached positions, SiLU, residuals), timed on random tensors of the target's sizes;
- llama.cpp's whole forward (attention included) per row count on the same GGUF, same threads and clock, in
  the same run where llama-cpp-python is installed; else the stored `osd bench rows` result, if present.
Timings: best of `repeats` (the machine is shared: minima are what compare), by the wall clock with torch's
threads, or with `clock="cpu"` by the CPU time of one thread (torch set to 1 thread): per-core costs that other
processes' load does not inflate, except through memory bandwidth and caches.
Limitations: a model pass has no attention, so kernel + glue is an estimate of a forward, not a measured one.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from osd.models import q4

# Qwen2.5-Coder-1.5B (the bundled target): used where the GGUF cannot be read
HIDDEN, INTERMEDIATE, LAYERS, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 1536, 8960, 28, 151936, 12, 2, 128
ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
STREAM_BYTES = 96e6  # per-shape timings rotate over copies of at least this many bytes (> the L3 caches here)


# ------------------------------------------------------------------------------------------ the target's matrices
def target_matrices(gguf: Path | None) -> list[dict]:
    """Every layer matrix and the LM head: {name, role, layer, type, n, k}, types and shapes read from the GGUF
    (Q4_K_M mixes Q4_K and Q6_K), else Qwen2.5-1.5B's shapes with llama.cpp's Q4_K_M choice of types."""
    if gguf is not None and Path(gguf).exists():
        from gguf import GGUFReader

        out = []
        for t in GGUFReader(str(gguf)).tensors:
            parts = t.name.split(".")
            role = parts[2] if t.name.startswith("blk.") else parts[0]
            if t.name.endswith(".weight") and (role in ROLES or t.name == "output.weight"):
                out.append({"name": t.name, "role": role, "layer": int(parts[1]) if parts[0] == "blk" else None,
                            "type": t.tensor_type.name, "n": int(t.shape[1]), "k": int(t.shape[0])})
        return out
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTERMEDIATE, HIDDEN), "ffn_up": (INTERMEDIATE, HIDDEN),
              "ffn_down": (HIDDEN, INTERMEDIATE)}
    q6_layers = {0, 1, 5, 6, 7, 8, 9, 10, 13, 16, 19, 21, 24, 27}  # as in the bundled Q4_K_M file
    out = [{"name": f"blk.{i}.{role}.weight", "role": role, "layer": i,
            "type": "Q6_K" if role in ("attn_v", "ffn_down") and i in q6_layers else "Q4_K", "n": n, "k": k}
           for i in range(LAYERS) for role, (n, k) in shapes.items()]
    return out + [{"name": "output.weight", "role": "output", "layer": None, "type": "Q6_K", "n": VOCAB, "k": HIDDEN}]


def random_weight(type_name: str, n: int, k: int, gen: torch.Generator) -> q4.Q4KWeight | q4.Q6KWeight:
    """Random blocks already in the kernel's layout (valid: 6-bit scales, small finite fp16 factors)."""
    tb = -(-n // q4.TILE) * (k // q4.QK)  # (tile of 16 columns, block) pairs (q4.Q4KWeight, q4.Q6KWeight)
    u8 = lambda *shape, hi=256: torch.randint(0, hi, shape, dtype=torch.uint8, generator=gen)
    if type_name == "Q4_K":
        return q4.Q4KWeight(n, u8(tb, 2048), u8(tb, 256, hi=64), (torch.rand(tb, 32, generator=gen) * 0.01).half())
    if type_name == "Q6_K":
        return q4.Q6KWeight(n, u8(tb, 2048), u8(tb, 1024), u8(tb, 256).view(torch.int8),
                            (torch.rand(tb, 16, generator=gen) * 0.01).half())
    raise ValueError(f"no kernel for {type_name}")


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
_clock = CLOCKS["wall"]


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    best = math.inf
    for _ in range(repeats):
        t0 = _clock()
        fn()
        best = min(best, _clock() - t0)
    return best


# ------------------------------------------------------------------------------------------ measurements
def shape_costs(matrices: list[dict], max_rows: int, repeats: int, isa: str | None, gen: torch.Generator) -> list[dict]:
    """ms per call for each distinct (role, type, n, k), rows 1..max_rows, weights streaming from memory."""
    distinct = {}
    for m in matrices:
        distinct.setdefault((m["role"], m["type"], m["n"], m["k"]), 0)
        distinct[(m["role"], m["type"], m["n"], m["k"])] += 1
    out = []
    for (role, type_name, n, k), count in tqdm(distinct.items(), desc="bench kernel: shapes", unit="shape"):
        first = random_weight(type_name, n, k, gen)
        copies = [first] + [random_weight(type_name, n, k, gen) for _ in range(int(STREAM_BYTES // first.nbytes))]
        ms = []
        for rows in range(1, max_rows + 1):
            acts = q4.quantize_activations(torch.randn(rows, k, generator=gen))
            seconds = best_seconds(lambda: [q4.matmul(acts, w, isa) for w in copies], repeats) / len(copies)
            ms.append(1e3 * seconds)
        out.append({"role": role, "type": type_name, "n": n, "k": k, "count": count, "mbytes": first.nbytes / 1e6,
                    "ms": ms, "cost_vs_one_row": [t / ms[0] for t in ms], "gbps_one_row": first.nbytes / ms[0] / 1e6})
        del copies
    return out


def model_pass_costs(matrices: list[dict], max_rows: int, repeats: int, isa: str | None, gen: torch.Generator) -> dict:
    """ms of one pass over every matrix (distinct weights), activations quantized once per distinct input."""
    layers: dict = {}
    head = None
    for m in tqdm(matrices, desc="bench kernel: allocating the model's matrices", unit="matrix"):
        w = random_weight(m["type"], m["n"], m["k"], gen)
        if m["layer"] is None:
            head = w
        else:
            layers.setdefault(m["layer"], {})[m["role"]] = w
    weight_bytes = sum(w.nbytes for layer in layers.values() for w in layer.values()) + head.nbytes

    def forward(x_hidden, x_inter):
        for layer in layers.values():
            a = q4.quantize_activations(x_hidden)  # q, k, v share the normed input
            for role in ("attn_q", "attn_k", "attn_v"):
                q4.matmul(a, layer[role], isa)
            q4.matmul(q4.quantize_activations(x_hidden), layer["attn_output"], isa)
            a = q4.quantize_activations(x_hidden)  # gate and up share one
            q4.matmul(a, layer["ffn_gate"], isa)
            q4.matmul(a, layer["ffn_up"], isa)
            q4.matmul(q4.quantize_activations(x_inter), layer["ffn_down"], isa)
        return q4.matmul(q4.quantize_activations(x_hidden), head, isa)

    ms = []
    for rows in tqdm(range(1, max_rows + 1), desc="bench kernel: model pass", unit="rows"):
        x_hidden, x_inter = torch.randn(rows, HIDDEN, generator=gen), torch.randn(rows, INTERMEDIATE, generator=gen)
        ms.append(1e3 * best_seconds(lambda: forward(x_hidden, x_inter), repeats))
    return {"weight_gbytes": weight_bytes / 1e9, "ms": ms, "cost_vs_one_row": [t / ms[0] for t in ms],
            "gbps": [weight_bytes / t / 1e6 for t in ms]}


def glue_costs(max_rows: int, context: int, repeats: int, gen: torch.Generator) -> dict:
    """ms per token of the non-matmul work of 28 layers in plain torch (fp32), for 1..max_rows rows."""
    ms = []
    for rows in range(1, max_rows + 1):
        t = lambda *shape: torch.randn(*shape, generator=gen)
        h, qkv, o, gate, up, down = t(rows, HIDDEN), t(rows, HIDDEN + 2 * KV_HEADS * HEAD_DIM), t(rows, HIDDEN), \
            t(rows, INTERMEDIATE), t(rows, INTERMEDIATE), t(rows, HIDDEN)
        bias, norm = t(HIDDEN + 2 * KV_HEADS * HEAD_DIM), t(HIDDEN)
        cache_k, cache_v = t(1, KV_HEADS, context + rows, HEAD_DIM), t(1, KV_HEADS, context + rows, HEAD_DIM)
        cos, sin = t(rows, HEAD_DIM), t(rows, HEAD_DIM)
        mask = torch.ones(rows, context + rows, dtype=torch.bool).tril(context)  # row i sees context + i + 1 positions

        def rope(x):  # (heads, rows, head_dim)
            half = x.shape[-1] // 2
            return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

        def layer(hidden):
            x = F.rms_norm(hidden, (HIDDEN,), norm, 1e-6)  # feeds q/k/v (the matmul is the kernel's, excluded)
            y = qkv + bias
            q, k, v = y.split([HIDDEN, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
            q = rope(q.view(rows, HEADS, HEAD_DIM).transpose(0, 1))
            cache_k[0, :, context:] = rope(k.view(rows, KV_HEADS, HEAD_DIM).transpose(0, 1))
            cache_v[0, :, context:] = v.view(rows, KV_HEADS, HEAD_DIM).transpose(0, 1)
            att = F.scaled_dot_product_attention(q[None], cache_k, cache_v, attn_mask=mask, enable_gqa=True)
            att = att[0].transpose(0, 1).reshape(rows, HIDDEN)  # feeds the o projection
            hidden = hidden + o
            x = F.rms_norm(hidden, (HIDDEN,), norm, 1e-6)  # feeds gate/up
            act = F.silu(gate) * up  # feeds down
            return hidden + down, (x, att, act)  # eager torch: all of it is computed

        def forward():
            hidden = h
            for _ in range(LAYERS):
                hidden, _ = layer(hidden)
            return F.rms_norm(hidden, (HIDDEN,), norm, 1e-6)

        with torch.inference_mode():
            ms.append(1e3 * best_seconds(forward, repeats))
    return {"context": context, "ms": ms}


def llama_cpp_costs(gguf: Path | None, max_rows: int, repeats: int, context: int = 100) -> dict | None:
    """ms of one llama.cpp feed of n = 1..max_rows tokens after `context` tokens (its whole forward, logits at every
    row), same threads and clock as the kernel's timings; None where llama-cpp-python or the GGUF is missing."""
    if gguf is None:
        return None
    try:
        from osd.models.llama_cpp_runner import LlamaCppRunner

        runner = LlamaCppRunner(gguf, 2048, torch.get_num_threads())
    except Exception:  # noqa: BLE001 - not installed / cannot load: the stored result serves instead
        return None
    tokens = [1000 + (7 * i) % 5000 for i in range(context + max_rows)]
    runner.reset()
    runner.feed(tokens[:context])
    ms = []
    for n in tqdm(range(1, max_rows + 1), desc="bench kernel: llama.cpp rows", unit="rows"):
        best = math.inf
        for _ in range(repeats + 1):  # the first is a warm-up
            runner.rollback(context)
            t0 = _clock()
            runner.feed(tokens[context : context + n], n_logits=n)
            best = min(best, _clock() - t0)
        ms.append(1e3 * best)
    runner.close()
    return {"source": "measured in this run", "backend": "llama.cpp, Q4_K repacked (default)", "context": context,
            "ms": ms, "cost_vs_one_row": [t / ms[0] for t in ms]}


def llama_cpp_rows(path: str | Path = "benchmarks/bench-rows.json") -> dict | None:
    """llama.cpp's whole-forward seconds per row count, from a stored `osd bench rows` result (None if absent)."""
    path = Path(path)
    if not path.exists():
        return None
    stored = json.loads(path.read_text())
    name, backend = next(iter(stored["backends"].items()))  # the default configuration comes first
    return {"source": str(path), "git_revision": stored.get("git_revision"), "backend": name,
            "ms": [1e3 * s for s in backend["seconds"]], "cost_vs_one_row": backend["cost_vs_one_row"]}


def run_kernel(target: str, max_rows: int = 8, repeats: int = 5, isa: str | None = None, context: int = 512,
               model_pass: bool = True, clock: str = "wall", seed: int = 0) -> dict:
    from osd.errors import OsdError
    from osd.models.loading import gguf_file

    global _clock
    _clock = CLOCKS[clock]
    if clock == "cpu":
        torch.set_num_threads(1)  # thread_time counts the calling thread only

    try:
        gguf = gguf_file(target)
    except OsdError:
        gguf = None
    matrices = target_matrices(gguf)
    gen = torch.Generator().manual_seed(seed)
    result = {"config": {"target": target, "gguf": str(gguf) if gguf else None, "max_rows": max_rows,
                         "repeats": repeats, "isa": q4.resolve_isa(isa), "threads": torch.get_num_threads(),
                         "clock": clock, "context": context},
              "types": {t: sum(1 for m in matrices if m["type"] == t) for t in sorted({m["type"] for m in matrices})},
              "shapes": shape_costs(matrices, max_rows, repeats, isa, gen)}
    result["sum_of_shapes_ms"] = [sum(s["ms"][r] * s["count"] for s in result["shapes"]) for r in range(max_rows)]
    if model_pass:
        result["model_pass"] = model_pass_costs(matrices, max_rows, repeats, isa, gen)
    result["glue"] = glue_costs(max_rows, context, repeats, gen)
    result["llama_cpp"] = llama_cpp_costs(gguf, max_rows, repeats) or llama_cpp_rows()
    return result


# ------------------------------------------------------------------------------------------ report and CLI
def report_kernel(result: dict, out: str, markdown: str) -> None:
    from osd.records import emit_report, machine, redacted_command, write_result
    from osd_bench.report import table

    path = write_result(result, out)
    rows_n = result["config"]["max_rows"]
    head = [f"{r} rows" for r in range(1, rows_n + 1)]
    shapes = [[f"{s['role']} {s['n']}x{s['k']}", s["type"], s["count"], f"{s['gbps_one_row']:.1f}"]
              + [f"{t:.3f}" for t in s["ms"]] for s in result["shapes"]]
    t1 = table(shapes, ["matrix (N x K)", "type", "per token", "GB/s 1 row"] + [f"ms {h}" for h in head])

    def line(name, ms):
        return [name] + [f"{t:.1f} ({t / ms[0]:.2f}x)" for t in ms]

    per_token = [line("kernel: sum of shapes x count", result["sum_of_shapes_ms"])]
    if "model_pass" in result:
        per_token.append(line("kernel: model pass (28 layers + LM head)", result["model_pass"]["ms"]))
        kernel_ms = result["model_pass"]["ms"]
    else:
        kernel_ms = result["sum_of_shapes_ms"]
    glue = result["glue"]["ms"]
    per_token.append(line(f"torch glue, context {result['glue']['context']}", glue))
    per_token.append(line("estimate: kernel + glue", [k + g for k, g in zip(kernel_ms, glue)]))
    lc = result.get("llama_cpp")
    if lc:
        where = "this run" if lc["source"] == "measured in this run" else f"{Path(lc['source']).name}, rev {lc['git_revision']}"
        per_token.append(line(f"llama.cpp whole forward ({where})", lc["ms"][:rows_n]))
    t2 = table(per_token, ["per token: ms (x 1 row)"] + head)
    m, cfg = machine(), result["config"]
    notes = (f"kernel path {cfg['isa']}, {cfg['threads']} threads, {cfg['clock']} clock; weights {result['types']} matrices; best of "
             f"{cfg['repeats']} (shared machine). llama.cpp's row is its whole forward (attention "
             "included, after 100 context tokens), same threads and clock where measured in this run.")
    emit_report("Own Q4_K/Q6_K kernel by rows (`osd bench kernel`)",
                f"`{redacted_command(sys.argv[1:])}` target={cfg['target']}; machine: {m['cpu']} ({m['cpu_flags']}), "
                f"{m['cores']} cores", [t1, t2, notes], path, markdown)


def cmd_bench_kernel(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    report_kernel(run_kernel(args.target, args.max_rows, args.repeats, args.isa, args.context, not args.no_model_pass,
                             args.clock), args.out, args.markdown)


def register(bench) -> None:
    """Add `osd bench kernel` to the `osd bench` parser."""
    from osd.config import ModelConfig

    p = bench.add_parser("kernel", help="our Q4_K/Q6_K kernel: ms per matrix and per token for 1..8 rows")
    p.add_argument("--target", default=ModelConfig.target, help="GGUF whose matrix shapes and quant types to use")
    p.add_argument("--max-rows", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--isa", default=None, choices=list(q4.ISAS), help="kernel path (default: $OSD_Q4_ISA or the best)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--clock", default="wall", choices=list(CLOCKS), help="wall: elapsed time with torch's threads; "
                   "cpu: CPU time of one thread (torch set to 1 thread; robust to other processes' load)")
    p.add_argument("--context", type=int, default=512, help="cached positions attended to in the glue estimate")
    p.add_argument("--no-model-pass", action="store_true", help="skip the whole-model pass (allocates ~1 GB)")
    p.add_argument("--out", default="benchmarks/bench-kernel.json")
    p.add_argument("--markdown", default="BENCHMARKS.md", help="append a summary here ('' = no)")
    p.set_defaults(func=cmd_bench_kernel)


if __name__ == "__main__":  # python -m osd_bench.kernel [flags]
    import argparse

    parser = argparse.ArgumentParser(prog="osd")
    register(parser.add_subparsers(dest="bench", required=True))
    parsed = parser.parse_args(["kernel", *sys.argv[1:]])
    parsed.func(parsed)
