"""The osd target backend on its own Q4_K/Q6_K kernel (models/q4.py): a Qwen2, Llama, Qwen3 or Gemma 3 GGUF served from
its 4-bit weights.

Same interface as the other runners (models/runner.py): `feed(tokens, n_logits) -> (n_logits, V)` float32 logits
for the last positions, `rollback(length)`, `reset()`, `length`, `vocab_size`, `context_window`, `eos_ids`,
`max_rows`. A forward per fed chunk of rows (M): the token embeddings dequantized from the GGUF's quantized table,
then per layer RMSNorm -> q/k/v (one kernel call per quant type: adjacent matrices of one type are concatenated at
load) -> biases, RoPE, KV-cache write -> attention over the cache -> output projection -> RMSNorm -> gate|up (one
call) -> SiLU * up -> down; the LM head only for the rows whose logits are asked. Matrices run on the kernel
(activations quantized per row to Q8_K, as llama.cpp does); the float work around them is q4_glue.cpp. What differs
by family (models/architectures.py, chosen from the file's `general.architecture`): q/k RMSNorm per head before RoPE
(Qwen3, Gemma 3), Llama 3's RoPE frequency factors and linear RoPE scaling, Gemma 3's sqrt(hidden) embedding scale,
GELU-tanh, norms of the attention and MLP outputs, and sliding-window layers with their own RoPE base.

Greedy identity by construction: every step of the forward computes each row alone and in a fixed order (the
kernel's rows are bitwise independent of the row count; the glue splits work by whole rows), so a position's
logits and its cached keys/values are bitwise the same whether it is fed alone, with 8 proposals, or inside a
prompt. `max_rows` = 9 (the pending token + 8 proposals: the kernel's 8-row pass plus one) is what the tests check;
larger feeds (prompts) run the same code in chunks of `chunk_rows`.

The KV cache is position-indexed (float32, (layers, KV heads, context, head dim)): rollback only sets `length`,
the next feed overwrites. Weights are repacked once per GGUF file (~1-3 min for the 1.5B on 2 cores) and cached
under ~/.cache/osd/q4 (memory-mapped on later loads); norms and biases are float32.

Limitations: the families of models/architectures.py only (qwen2, llama, qwen3, gemma3: any other is refused with
its name; no YaRN/LongRoPE scaling, partial RoPE or logit softcapping); matrices must be one of q4.MATRIX_TYPES
(Q4_K_M/S, Q5_K_M/S, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 files; an error names any other type and llama.cpp, nothing
is converted); the runner's own cache holds one sequence (models/slots.py Q4Slots runs several, one pass over the
weights for all their rows: `forward_rows`); CPU with AVX2; a float32 KV cache of the whole context window is
reserved (touched as it fills: ~235 MB at 4096 tokens; a sliding layer's too).
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch

from osd.errors import BackendUnavailable, ContextTooLong, InvalidArgument, ModelNotFound
from osd.models import q4
from osd.models.architectures import ARCHITECTURES as FAMILIES, architecture, sliding, unpermute_rows
from osd.models.kernels import compile_extension
from osd.models.runner import PositionCache
from osd.models.tree_rows import TreeRows

ARCHITECTURES = tuple(FAMILIES)  # general.architecture values this backend runs (models/architectures.py)
MATRIX_TYPES = q4.MATRIX_TYPES  # Q4_K, Q6_K, Q8_0, ...: the types the kernel runs (never converted)
LAYOUT_VERSION = 4  # bump when the cached repacked layout changes (4: the architecture table and the matrix types)
CACHE_MIN_BYTES = 64 << 20  # files at least this large keep their repacked weights on disk

_lock = threading.Lock()
_state: dict = {}


# ------------------------------------------------------------------------------------------ the glue kernels
def glue():
    """The compiled q4_glue.cpp (RMSNorm, RoPE + cache write, attention, SiLU/GELU * up), built once per machine."""
    with _lock:
        if "module" not in _state:
            _state["module"], _state["error"] = _build_glue()
        if _state["module"] is None:
            raise BackendUnavailable(f"the osd Q4 backend's glue kernels are unavailable here: {_state['error']}")
        return _state["module"]


def _build_glue():
    if not q4.available():
        return None, q4.build_error()
    return compile_extension("osd_q4_glue", "q4_glue.cpp", "the Q4 backend's glue kernels", "~1 min",
                             ["-mavx2", "-mfma"])


# ------------------------------------------------------------------------------------------ the model's shape
@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    eps: float
    context_length: int
    arch: str = "qwen2"  # general.architecture: what the forward does besides (models/architectures.py)
    rope_scale: float = 1.0  # linear RoPE scaling: positions divided by this (global layers)
    sliding_window: int = 0  # positions a sliding layer attends to (its own included); 0: none
    attention_scale: float = 0.0  # softmax(scale q k); 0: 1/sqrt(head_dim)
    # per layer, whether it slides (within sliding_window); (): the family's pattern (architectures.sliding). A draft
    # cut from some of a model's layers (models/derived.py) keeps each kept layer's own kind, which that pattern over
    # the shorter stack would not give.
    sliding_layers: tuple[bool, ...] = ()


Qwen2Shape = ModelShape  # the name before other families (a draft's copy builds one from its config: q4_draft.py)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise InvalidArgument(f"the GGUF has no {key!r}: not a complete model file")
        return default
    return field.contents()


def read_shape(reader) -> ModelShape:
    """The architecture's hyperparameters from a GGUF's metadata (its family from `general.architecture`, the rest as
    llama.cpp reads it); a clear error for what this backend cannot run."""
    family = architecture(_field(reader, "general.architecture"))
    arch = family.name
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "", *family.rope_scalings):
        raise InvalidArgument(f"the osd Q4 backend has no {scaling!r} RoPE scaling for {arch} (use --target-backend "
                              "llama.cpp)")
    for key in (f"{arch}.final_logit_softcapping", f"{arch}.attn_logit_softcapping"):
        if float(_field(reader, key, 0.0)):
            raise InvalidArgument(f"the GGUF sets {key}: the osd Q4 backend has no logit softcapping "
                                  "(use --target-backend llama.cpp)")
    hidden, heads = int(_field(reader, f"{arch}.embedding_length")), int(_field(reader, f"{arch}.attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    layers = int(_field(reader, f"{arch}.block_count"))
    if int(_field(reader, f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise InvalidArgument("the GGUF's key and value head sizes differ: the osd Q4 backend needs them equal")
    if int(_field(reader, f"{arch}.rope.dimension_count", head_dim)) != head_dim:
        raise InvalidArgument("the GGUF rotates part of each head only (partial RoPE): the osd Q4 backend rotates all")
    window = int(_field(reader, f"{arch}.attention.sliding_window", 0)) if family.swa_pattern else 0
    # Gemma 3 27B (62 layers) scales by 1/sqrt(hidden / heads), not 1/sqrt(head dim): llama.cpp's rule (no key says it)
    scale = (hidden / heads) ** -0.5 if arch == "gemma3" and layers == 62 else 0.0
    return ModelShape(
        layers=layers, hidden=hidden, intermediate=int(_field(reader, f"{arch}.feed_forward_length")), heads=heads,
        kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)), head_dim=head_dim,
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        context_length=int(_field(reader, f"{arch}.context_length", 0)), arch=arch,
        rope_scale=float(_field(reader, f"{arch}.rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0,
        sliding_window=window, attention_scale=scale)


def architecture_problem(config) -> str | None:
    """None when a Hugging Face config describes the architecture the int8 glue runner's Qwen2 forward runs (full
    attention, plain RoPE, SiLU MLP), else why not (one line); models/glue_draft.py checks its own widths after this.
    (A draft's Q4 copy runs every family of models/architectures.py: models/q4_draft.py `qualifies`.)"""
    if getattr(config, "model_type", None) != "qwen2":
        return "not a Qwen2 model"
    if getattr(config, "use_sliding_window", False) or getattr(config, "rope_scaling", None):
        return "sliding-window attention or scaled RoPE"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    return None


def rope_tables(positions: int, head_dim: int, theta: float, factors: torch.Tensor | None = None,
                scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (positions, head_dim / 2) float32 of NEOX RoPE, computed as transformers' Qwen2 does; `factors` (D/2)
    divide the frequencies (a Llama 3 GGUF's rope_freqs: llama.cpp's freq_factors), `scale` divides the positions
    (linear RoPE scaling: llama.cpp's freq_scale = 1 / factor)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # (D/2,)
    if factors is not None:
        inv_freq = inv_freq / factors.float()
    if scale != 1.0:
        inv_freq = inv_freq / scale
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]  # (T, D/2)
    return freqs.cos().contiguous(), freqs.sin().contiguous()


def serves(spec: str) -> bool:
    """Whether this backend runs the GGUF behind `spec` (bundled:<name> or a .gguf path) on this machine: the file
    exists, its architecture and matrix types are ones the kernel runs, and the kernel builds here. Reads the GGUF's
    header and tensor table only (memory-mapped); the answer is kept per file."""
    return why_not_served(spec) is None


def why_not_served(spec: str) -> str | None:
    """None where `serves(spec)`, else why not (one line: the file's family, a tensor or type it lacks or has)."""
    from osd.models.loading import gguf_file

    try:
        gguf = gguf_file(spec)
    except (ModelNotFound, InvalidArgument, OSError) as e:
        return str(e)
    if gguf is None:
        return "not a GGUF file"
    key = (str(gguf.resolve()), gguf.stat().st_mtime_ns)
    if key not in _serves:
        _serves[key] = _problem(gguf)
    return _serves[key]


_serves: dict = {}


def _problem(gguf: Path) -> str | None:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(gguf))
        s = read_shape(reader)
        tensors = {t.name: t for t in reader.tensors}
        check_tensors(s, tensors)
        check_matrices(tensors, matrix_names(s.layers, tied="output.weight" not in tensors))
    except (InvalidArgument, ValueError, OSError) as e:
        return str(e) or type(e).__name__
    return None if q4.available() else f"the Q4 kernel cannot be built here: {q4.build_error()}"


# ------------------------------------------------------------------------------------------ weights
QKV, GATE_UP = ("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up")


def fused_groups(types: list[str]) -> list[tuple[int, int]]:
    """Runs of adjacent equal quant types, as (start, stop) index pairs: matrices fused into one kernel call."""
    groups, start = [], 0
    for i in range(1, len(types) + 1):
        if i == len(types) or types[i] != types[start]:
            groups.append((start, i))
            start = i
    return groups


class FusedLinear:
    """Matrices that read the same input, side by side: (M, K) Q8_K records -> (M, sum of N) float32.

    One kernel call per run of adjacent matrices of one quant type (their GGUF rows concatenated before repacking).
    """

    def __init__(self, weights: list[q4.Weight]):
        module, code = q4.kernel(), q4.ISAS[q4.resolve_isa()]
        self.weights = weights
        self.calls = [_bound(module, w, code) for w in weights]
        self.n = sum(w.n for w in weights)

    def __call__(self, records: torch.Tensor) -> torch.Tensor:
        if len(self.calls) == 1:
            return self.calls[0](records)
        return torch.cat([call(records) for call in self.calls], dim=1)


def _bound(module, w, code):
    fn, tensors = getattr(module, w.KERNEL), w.tensors()
    return lambda records: fn(records, *tensors, w.n, code)


def _weight_tensors(w) -> dict:
    return {"type": w.TYPE, "n": w.n, **{f.name: getattr(w, f.name) for f in fields(w)[1:]}}


def _weight_from(d: dict):
    return q4.WEIGHTS[d["type"]](**{k: v for k, v in d.items() if k != "type"})


def matrix_names(layers: int, tied: bool) -> dict[str, list[str]]:
    """Fused weight name -> the GGUF matrices it holds, in output order (q|k|v, gate|up)."""
    names = {}
    for i in range(layers):
        names[f"blk.{i}.qkv"] = [f"blk.{i}.{r}.weight" for r in QKV]
        names[f"blk.{i}.attn_output"] = [f"blk.{i}.attn_output.weight"]
        names[f"blk.{i}.gate_up"] = [f"blk.{i}.{r}.weight" for r in GATE_UP]
        names[f"blk.{i}.ffn_down"] = [f"blk.{i}.ffn_down.weight"]
    names["output"] = ["token_embd.weight" if tied else "output.weight"]
    return names


def check_matrices(tensors: dict, names: dict[str, list[str]]) -> None:
    """InvalidArgument naming the first matrix the kernel cannot run: missing, another quant type, rows not a
    multiple of a block."""
    for name in (name for parts in names.values() for name in parts):
        if name not in tensors:
            raise InvalidArgument(f"the GGUF has no tensor {name!r}")
        kind = tensors[name].tensor_type.name
        if kind not in MATRIX_TYPES:
            raise InvalidArgument(q4.unsupported(kind, name))
        if tensors[name].shape[0] % q4.row_multiple(kind):
            raise InvalidArgument(f"{name}: rows of {tensors[name].shape[0]} are not a multiple of {q4.row_multiple(kind)}")


def repack_matrices(tensors: dict, names: dict[str, list[str]], row_order: dict | None = None) -> dict[str, list]:
    """GGUF tensors (by name) -> fused name -> repacked kernel weights (one per run of one quant type). row_order:
    matrix name -> the file rows to take, in order (a Llama's q/k rows permuted back: exact, rows are whole units)."""
    check_matrices(tensors, names)
    row_order = row_order or {}
    rows = lambda name: tensors[name].data[row_order[name]] if name in row_order else tensors[name].data  # noqa: E731
    out = {}
    for fused, parts in names.items():
        types = [tensors[name].tensor_type.name for name in parts]
        out[fused] = []
        for start, stop in fused_groups(types):
            raw = torch.from_numpy(np.concatenate([rows(name) for name in parts[start:stop]]))  # a copy
            out[fused].append(q4.repack(raw, types[start]))
    return out


@dataclass
class Q4Weights:
    """What a forward needs, read from a GGUF (or from its cache): matrices repacked, vectors float32."""

    shape: ModelShape
    eos_ids: list[int]
    vectors: dict[str, torch.Tensor]  # blk.{i}.attn_norm / ffn_norm / qkv_bias (q|k|v, zeros if absent), output_norm;
    # where the family has them: blk.{i}.q_norm / k_norm (D,), blk.{i}.attn_post_norm / ffn_post_norm, rope_freqs (D/2,)
    embd_type: str  # the token embedding table's GGML type (any type gguf can dequantize)
    embd: np.ndarray  # (V, bytes per row) uint8: the table as stored (rows dequantized when looked up)
    matrices: dict[str, list]  # fused name (matrix_names) -> repacked weights, one per run of one quant type

    def to_dict(self) -> dict:
        return {"layout": LAYOUT_VERSION, "shape": asdict(self.shape), "eos_ids": self.eos_ids, "vectors": self.vectors,
                "embd_type": self.embd_type, "embd": torch.from_numpy(np.array(self.embd)),  # a copy: the file is read-only
                "matrices": {k: [_weight_tensors(w) for w in v] for k, v in self.matrices.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "Q4Weights":
        return cls(ModelShape(**d["shape"]), d["eos_ids"], d["vectors"], d["embd_type"], d["embd"].numpy(),
                   {k: [_weight_from(w) for w in v] for k, v in d["matrices"].items()})


def vector_names(s: ModelShape, tensors: dict) -> dict[str, list[str]]:
    """Vector name (Q4Weights.vectors) -> the GGUF tensors it is read from (a q|k|v bias: three, zeros where absent),
    as the shape's family has them (models/architectures.py)."""
    family = architecture(s.arch)
    per_layer = {"attn_norm": "attn_norm", "ffn_norm": "ffn_norm"}  # vector name -> GGUF name, in blk.{i}
    if family.qk_norm:
        per_layer |= {"q_norm": "attn_q_norm", "k_norm": "attn_k_norm"}
    if family.post_norms:
        per_layer |= {"attn_post_norm": "post_attention_norm", "ffn_post_norm": "post_ffw_norm"}
    names = {"output_norm": ["output_norm.weight"]}
    for i in range(s.layers):
        names |= {f"blk.{i}.{key}": [f"blk.{i}.{name}.weight"] for key, name in per_layer.items()}
        names[f"blk.{i}.qkv_bias"] = [f"blk.{i}.{r}.bias" for r in QKV] if family.qkv_bias else []
    if family.rope_freqs and "rope_freqs.weight" in tensors:
        names["rope_freqs"] = ["rope_freqs.weight"]
    return names


def check_tensors(s: ModelShape, tensors: dict) -> None:
    """InvalidArgument where the GGUF lacks a tensor the family's forward reads, or holds one it would not compute
    with (an output or MLP bias, q/k/v biases in a family without, experts, ...: silently dropped otherwise)."""
    matrices = matrix_names(s.layers, tied="output.weight" not in tensors)
    vectors = vector_names(s, tensors)
    needed = {n for parts in matrices.values() for n in parts} | {"token_embd.weight"}
    needed |= {n for key, parts in vectors.items() if not key.endswith("qkv_bias") for n in parts}
    missing = sorted(needed - set(tensors))
    if missing:
        raise InvalidArgument(f"the GGUF has no tensor {missing[0]!r}")
    unread = sorted(set(tensors) - needed - {n for parts in vectors.values() for n in parts})
    if unread:
        raise InvalidArgument(f"the GGUF holds tensors the osd Q4 backend's {s.arch} forward does not compute with "
                              f"({', '.join(unread[:4])}{', ...' if len(unread) > 4 else ''}; use --target-backend "
                              "llama.cpp)")


def read_gguf(path: Path) -> Q4Weights:
    """Read and check a GGUF, repack its matrices (slow for a real model: minutes on 2 cores)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    s = read_shape(reader)
    tensors = {t.name: t for t in reader.tensors}
    check_tensors(s, tensors)
    widths = (s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim)
    vectors = {}
    for key, parts in vector_names(s, tensors).items():
        if key.endswith("qkv_bias"):
            vectors[key] = torch.cat([_vector(tensors, b, n) for b, n in zip(parts, widths)]) if parts else \
                torch.zeros(sum(widths))
        else:
            vectors[key] = _vector(tensors, parts[0])
    if "rope_freqs" in vectors and vectors["rope_freqs"].numel() != s.head_dim // 2:
        raise InvalidArgument(f"rope_freqs has {vectors['rope_freqs'].numel()} factors, not head_dim / 2")
    embd = tensors["token_embd.weight"]
    eos_ids = [int(_field(reader, k)) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
               if k in reader.fields]
    order = {}
    if architecture(s.arch).rope == "normal":  # the converter permuted q/k rows for adjacent-pair RoPE: undo it
        for i in range(s.layers):
            order[f"blk.{i}.attn_q.weight"] = unpermute_rows(s.heads * s.head_dim, s.heads).numpy()
            order[f"blk.{i}.attn_k.weight"] = unpermute_rows(s.kv_heads * s.head_dim, s.kv_heads).numpy()
    names = matrix_names(s.layers, tied="output.weight" not in tensors)
    return Q4Weights(s, eos_ids, vectors, embd.tensor_type.name, embd.data, repack_matrices(tensors, names, order))


def cache_path(gguf: Path, cache_dir: Path) -> Path:
    st = gguf.stat()
    digest = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}:{LAYOUT_VERSION}".encode()).hexdigest()
    return cache_dir / f"{gguf.stem}-{digest[:16]}.pt"


def load_weights(gguf: Path, cache: bool | None = None, cache_dir: str | Path | None = None,
                 mmap: bool = True) -> Q4Weights:
    """The GGUF's weights for the kernel: from the cache when there (memory-mapped, ~1 s; mmap=False reads it into
    process memory instead), else read and repacked (then cached where `cache`; None = for files of at least
    CACHE_MIN_BYTES). The cache is keyed by the file's path, size and mtime; a file of ~the GGUF's size (the 1.5B:
    1.1 GB) under ~/.cache/osd/q4. Mapped, because reading decoded no faster: 16.8 vs 17.1 tokens/s, alternating
    rounds in one process (scripts/bench_q4_weights.py, BENCHMARKS.md), while it costs the weights' size in
    anonymous memory instead of the shared page cache."""
    from osd.models.bundled import cache_root

    cache = gguf.stat().st_size >= CACHE_MIN_BYTES if cache is None else cache
    path = cache_path(gguf, Path(cache_dir) if cache_dir else cache_root() / "q4")
    if cache and path.exists():
        stored = torch.load(path, mmap=mmap, weights_only=True)
        if stored.get("layout") == LAYOUT_VERSION:
            return Q4Weights.from_dict(stored)
    if cache:
        print(f"[osd] repacking {gguf.name} for the Q4 kernel (once, a few minutes; cached in {path.parent}) ...",
              file=sys.stderr, flush=True)
    weights = read_gguf(gguf)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + f".{os.getpid()}.partial")
        torch.save(weights.to_dict(), partial)
        partial.replace(path)
    return weights


@dataclass
class Layer:
    attn_norm: torch.Tensor  # (hidden,)
    qkv: FusedLinear  # -> (M, (H + 2G) D)
    qkv_bias: torch.Tensor  # ((H + 2G) D,)
    attn_output: FusedLinear
    ffn_norm: torch.Tensor
    gate_up: FusedLinear  # -> (M, 2 I)
    ffn_down: FusedLinear
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin (T, D/2): the global or the sliding layers' tables
    window: int = 0  # a sliding layer's window (positions attended, its own included); 0: all
    q_norm: torch.Tensor | None = None  # (D,) per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    attn_post_norm: torch.Tensor | None = None  # (hidden,) RMSNorm of the attention / MLP output (Gemma 3)
    ffn_post_norm: torch.Tensor | None = None


# ------------------------------------------------------------------------------------------ the runner
@dataclass
class Rows:
    """Rows start:stop of a forward belong to one sequence: their positions and that sequence's KV cache."""
    start: int
    stop: int
    pos: torch.Tensor  # (stop - start,) int64
    kv: list  # per layer: (keys (G, T, D), values (G, T, D)) views
    tree: "TreeRows | None" = None  # a token-tree feed: positions, cache indices and keys per row (tree_rows.py)


class Q4Runner(PositionCache):
    """A Qwen2/Llama/Qwen3/Gemma 3 GGUF (Q4_K/Q6_K matrices) on osd's own kernel, holding the KV cache of one
    sequence."""

    max_rows = 9  # rows per feed checked bitwise equal to 1-row feeds: the pending token + 8 proposals
    rows_per_pass = q4.ROWS_PER_PASS  # the kernel's rows per pass over the weights (the goodput costs step there)

    def __init__(self, gguf_path: str | Path, n_ctx: int = 4096, chunk_rows: int = 64, cache: bool | None = None,
                 cache_dir: str | Path | None = None, mmap: bool = True):
        path = Path(gguf_path)
        if not path.is_file():
            raise ModelNotFound(f"GGUF file not found: {path}")
        self.path = path
        self._setup(load_weights(path, cache, cache_dir, mmap), n_ctx, chunk_rows)

    @classmethod
    def from_weights(cls, weights: Q4Weights, n_ctx: int = 4096, chunk_rows: int = 64) -> "Q4Runner":
        """A runner over weights built in memory (a draft's Q4 serving copy, models/q4_draft.py), not read from a file."""
        runner = cls.__new__(cls)
        runner.path = None
        runner._setup(weights, n_ctx, chunk_rows)
        return runner

    def _setup(self, w: Q4Weights, n_ctx: int, chunk_rows: int) -> None:
        self.chunk_rows = int(chunk_rows)
        self.shape = s = w.shape
        self._glue, self._quantize = glue(), q4.kernel().quantize_q8k
        if any(width % q4.QK for width in (s.hidden, s.heads * s.head_dim, s.intermediate)):
            self._quantize = padded(self._quantize)  # a draft's copy of ragged widths (a GGUF's are whole blocks)
        self.family = family = architecture(s.arch)
        self.context_window = min(int(n_ctx), s.context_length or int(n_ctx))
        v, m = w.vectors, w.matrices
        self.cos, self.sin = rope_tables(self.context_window, s.head_dim, s.rope_theta, v.get("rope_freqs"),
                                         s.rope_scale)  # the global layers'
        local = rope_tables(self.context_window, s.head_dim, family.swa_rope_base) if s.sliding_window else None
        self.layers = []
        for i in range(s.layers):
            slides = s.sliding_window > 0 and (s.sliding_layers[i] if s.sliding_layers else sliding(family, i))
            self.layers.append(Layer(
                v[f"blk.{i}.attn_norm"], FusedLinear(m[f"blk.{i}.qkv"]), v[f"blk.{i}.qkv_bias"],
                FusedLinear(m[f"blk.{i}.attn_output"]), v[f"blk.{i}.ffn_norm"], FusedLinear(m[f"blk.{i}.gate_up"]),
                FusedLinear(m[f"blk.{i}.ffn_down"]), local if slides else (self.cos, self.sin),
                s.sliding_window if slides else 0, v.get(f"blk.{i}.q_norm"), v.get(f"blk.{i}.k_norm"),
                v.get(f"blk.{i}.attn_post_norm"), v.get(f"blk.{i}.ffn_post_norm")))
        self._check_widths(s)
        self._activation = self._glue.gelu_mul if family.activation == "gelu_tanh" else self._glue.silu_mul
        self._embed_scale = float(np.float32(s.hidden**0.5)) if family.embed_scale else None
        self.output_norm, self.head = v["output_norm"], FusedLinear(m["output"])
        self._embd_type, self._embd = w.embd_type, w.embd
        self.vocab_size = self.head.n
        self.eos_ids = set(w.eos_ids)
        self._kv = self.new_cache()  # per layer (keys, values) of this runner's one sequence
        self.length = 0  # tokens whose keys/values are in the cache

    def _check_widths(self, s: ModelShape) -> None:
        want = {"qkv": (s.heads + 2 * s.kv_heads) * s.head_dim, "attn_output": s.hidden, "gate_up": 2 * s.intermediate,
                "ffn_down": s.hidden}
        for i, layer in enumerate(self.layers):
            for name, n in want.items():
                if getattr(layer, name).n != n:
                    raise InvalidArgument(f"blk.{i}: {name} gives {getattr(layer, name).n} outputs, the metadata says {n}")

    @torch.inference_mode()
    def feed(self, token_ids: list[int], n_logits: int = 1) -> torch.Tensor:
        """Append tokens to the cache; return float32 logits (n_logits, V) for the last positions."""
        if self.length + len(token_ids) > self.context_window:
            raise ContextTooLong(f"{self.length + len(token_ids)} tokens exceed the Q4 backend's context of "
                                 f"{self.context_window}")
        n_logits = min(n_logits, len(token_ids))
        first_logit, kept = len(token_ids) - n_logits, []
        for start in range(0, len(token_ids), self.chunk_rows):
            chunk = token_ids[start : start + self.chunk_rows]
            hidden = self._forward(chunk)  # (M, hidden)
            if start + len(chunk) > first_logit:
                kept.append(hidden[max(0, first_logit - start) :])
        if not kept:
            return torch.empty(0, self.vocab_size)
        return self.logits(torch.cat(kept))  # (n_logits, V)

    def embed(self, token_ids: list[int]) -> torch.Tensor:
        """(M, hidden) float32 rows of the quantized embedding table, dequantized (gguf's reference)."""
        from gguf import GGMLQuantizationType, dequantize

        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self._embd.shape[0]):
            raise InvalidArgument(f"token ids must be in [0, {self._embd.shape[0]})")
        rows = dequantize(self._embd[ids], GGMLQuantizationType[self._embd_type])
        x = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)).reshape(len(token_ids), self.shape.hidden)
        return x * self._embed_scale if self._embed_scale else x  # (M, hidden); Gemma: times sqrt(hidden)

    def _forward(self, token_ids: list[int], taps: dict[int, list] | None = None) -> torch.Tensor:
        """Run M tokens through the layers at positions length.., caching their keys/values -> (M, hidden).
        `taps` {layer index: list}: each listed layer's output (the residual stream, (M, hidden)) is appended."""
        pos = torch.arange(self.length, self.length + len(token_ids))  # (M,)
        x = self.forward_rows(self.embed(token_ids), [Rows(0, len(token_ids), pos, self._kv)], taps)
        self.length += len(token_ids)
        return x

    def forward_rows(self, x: torch.Tensor, groups: list["Rows"], taps: dict[int, list] | None = None) -> torch.Tensor:
        """x (M, hidden) through the layers -> (M, hidden). Each group of consecutive rows belongs to one sequence:
        its keys/values go to that sequence's cache at its positions, its queries attend to that cache only. The
        matrices see all M rows at once (one pass over each weight); everything else runs per row, so a row's
        result does not depend on the other rows or groups (bitwise)."""
        s, g, quantize = self.shape, self._glue, self._quantize
        joint = None
        if len(groups) > 1 and all(rows.tree is None for rows in groups):  # several sequences' chains: their RoPE and
            joint = (torch.cat([torch.full((rows.stop - rows.start,), j) for j, rows in enumerate(groups)]),  # attention
                     torch.cat([rows.pos for rows in groups]))  # in one call per layer (row r's cache: cache_of[r])
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(quantize(g.rms_norm(x, layer.attn_norm, s.eps)))  # (M, (H + 2G) D)
            attended = layer.attn_output(quantize(self._attend(qkv, i, groups, joint)))  # (M, hidden)
            x += attended if layer.attn_post_norm is None else g.rms_norm(attended, layer.attn_post_norm, s.eps)
            gate_up = layer.gate_up(quantize(g.rms_norm(x, layer.ffn_norm, s.eps)))  # (M, 2 I)
            out = layer.ffn_down(quantize(self._activation(gate_up)))  # (M, hidden)
            x += out if layer.ffn_post_norm is None else g.rms_norm(out, layer.ffn_post_norm, s.eps)
            if taps and i in taps:  # a layer's output kept for a reader of the target's features (bench feature-head)
                taps[i].append(x.clone())
        return x

    def _attend(self, qkv: torch.Tensor, i: int, groups: list["Rows"], joint) -> torch.Tensor:
        """Layer i's biases, RoPE, cache writes and attention for every row -> (M, H D): all groups in one call where
        `joint` = (cache_of, pos) is given (the same arithmetic per row as one call per group), else group by group."""
        s, g, layer = self.shape, self._glue, self.layers[i]
        (cos, sin), bias, norms = layer.rope, layer.qkv_bias, (layer.q_norm, layer.k_norm, s.eps)
        window = (s.attention_scale, layer.window)  # scale (0: 1/sqrt(D)), window (0: none)
        if joint is not None:
            cache_of, pos = joint
            k_caches, v_caches = zip(*(rows.kv[i] for rows in groups))
            q = g.qkv_rope_many(qkv, bias, cos, sin, pos, k_caches, v_caches, cache_of, s.heads, *norms)
            return g.attention_many(q, k_caches, v_caches, cache_of, pos, *window)
        attended = []
        for rows in groups:
            k_cache, v_cache, t = *rows.kv[i], rows.tree
            if t is None:
                q = g.qkv_rope(qkv[rows.start : rows.stop], bias, cos, sin, rows.pos, k_cache, v_cache, s.heads,
                               *norms)  # (m, H, D)
                attended.append(g.attention(q, k_cache, v_cache, rows.pos, *window))
            else:
                q = g.qkv_rope_at(qkv[rows.start : rows.stop], bias, cos, sin, t.pos, t.at, k_cache, v_cache, s.heads,
                                  *norms)
                attended.append(g.attention_at(q, k_cache, v_cache, t.prefix, t.offsets, t.extra, *window))
        return attended[0] if len(attended) == 1 else torch.cat(attended)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, hidden) final hidden states -> (n, V) float32 logits (final RMSNorm, LM head)."""
        return self.logits_of_features(self.features(hidden))

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """(n, hidden) final hidden states -> (n, hidden) the LM head's input (after the output norm): what a feature
        head reads (models/feature_head.py)."""
        return self._glue.rms_norm(hidden, self.output_norm, self.shape.eps)

    def logits_of_features(self, features: torch.Tensor) -> torch.Tensor:
        """(n, hidden) LM-head inputs -> (n, V) float32 logits."""
        return self.head(self._quantize(features))

    def new_cache(self, n_ctx: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """An empty KV cache of one sequence (per layer: keys, values) for forward_rows: the runner's own, or one more
        (models/q4_batch.py). Its pages are touched only as the cache fills."""
        s = self.shape
        shape = (s.layers, s.kv_heads, min(n_ctx or self.context_window, self.context_window), s.head_dim)
        k, v = torch.empty(shape), torch.empty(shape)
        return [(k[i], v[i]) for i in range(s.layers)]


@torch.inference_mode()
def feed_together(runners: list[Q4Runner], token_lists: list[list[int]]) -> torch.Tensor:
    """Several sequences' forwards in one, each runner (its own cache, all over the same weights: a Q4 draft copy's
    runners, models/q4_draft.py) appending its tokens -> (len(runners), V) float32 logits of each one's last position.
    The matrices read every row at once (one pass over the weights); attention stays per sequence on its own cache;
    each row's bits are those of its runner's own `feed` (forward_rows computes a row alone)."""
    first = runners[0]
    if len({id(getattr(r, "model", r)) for r in runners}) != 1:
        raise ValueError("feed_together: every runner must serve the same weights")
    for runner, tokens in zip(runners, token_lists):  # every check before any cache changes
        if not tokens:
            raise ValueError("feed: no tokens")
        if runner.length + len(tokens) > runner.context_window:
            raise ContextTooLong(f"{runner.length + len(tokens)} tokens exceed the context of {runner.context_window}")
    groups, ids = [], []
    for runner, tokens in zip(runners, token_lists):
        groups.append(Rows(len(ids), len(ids) + len(tokens), torch.arange(runner.length, runner.length + len(tokens)),
                           runner._kv))
        ids += tokens
    x = first.forward_rows(first.embed(ids), groups)
    for runner, tokens in zip(runners, token_lists):
        runner.length += len(tokens)
    return first.logits(x[[rows.stop - 1 for rows in groups]])


def padded(quantize):
    """Q8_K quantization of rows of any width: rows whose width is not a multiple of a block (256) get zero columns
    first, as the matrices that read them got zero columns at quantization (models/q4_quantize.py `pad_columns`: the
    Qwen2.5 0.5B's width 896). A GGUF's widths are whole blocks already: its runner does not use this."""
    def quantize_rows(x: torch.Tensor) -> torch.Tensor:
        pad = -x.shape[1] % q4.QK
        return quantize(torch.nn.functional.pad(x, (0, pad)) if pad else x)
    return quantize_rows


def _vector(tensors: dict, name: str, zeros_if_missing: int | None = None) -> torch.Tensor:
    """A norm weight or bias as float32 (any GGUF type, dequantized by gguf); zeros of the given size if absent."""
    from gguf import dequantize

    if name not in tensors:
        if zeros_if_missing is not None:
            return torch.zeros(zeros_if_missing)
        raise InvalidArgument(f"the GGUF has no tensor {name!r}")
    t = tensors[name]
    return torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1))
