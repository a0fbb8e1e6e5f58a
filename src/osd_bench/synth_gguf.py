"""`osd bench synth-gguf`: real-size GGUFs whose weights do not matter for speed.

A decoder's speed depends on its shapes and its tensors' types, not on the values it holds. This writes a GGUF at the
real configuration of a public model with seeded random weights (normal, std 0.02; norms 1, so activations stay
finite), then quantizes its matrices with llama.cpp's own quantizer (`llama_model_quantize`, the tool the public
GGUFs were made with), so the types per tensor are exactly those of a downloaded Q4_K_M (Q6_K for the output/tied
embedding and half of attn_v/ffn_down, fallbacks where a row is not a multiple of 256). osd and llama.cpp then run
the very same file: `osd bench speed --target FILE`, `osd bench rows --target FILE`, `osd bench serve-vs --target
FILE`. Outputs are gibberish; tokens/s are real.

Shapes (Hugging Face config.json of each model; tied = the output head is the token embedding):

| shape         | arch   | hidden | inter | layers | heads | kv | head dim | vocab   | rope theta | rms eps | tied | notes                      |
|---------------|--------|--------|-------|--------|-------|----|----------|---------|------------|---------|------|----------------------------|
| qwen2.5-1.5b  | qwen2  | 1536   | 8960  | 28     | 12    | 2  | 128      | 151936  | 1e6        | 1e-6    | yes  | q/k/v biases               |
| llama-3.2-1b  | llama  | 2048   | 8192  | 16     | 32    | 8  | 64       | 128256  | 5e5        | 1e-5    | yes  | llama3 rope scaling omitted|
| llama-3.2-3b  | llama  | 3072   | 8192  | 28     | 24    | 8  | 128      | 128256  | 5e5        | 1e-5    | yes  | llama3 rope scaling omitted|
| qwen3-1.7b    | qwen3  | 2048   | 6144  | 28     | 16    | 8  | 128      | 151936  | 1e6        | 1e-6    | yes  | q/k RMSNorm per head       |
| gemma-3-1b    | gemma3 | 1152   | 6912  | 26     | 4     | 1  | 256      | 262144  | 1e6 (1e4 local) | 1e-6 | yes | window 512 on 5 of 6 layers, 4 norms a layer, GELU |

The tokenizer is synthetic: a GPT-2 byte-level BPE learned on the public datasets' train splits (~27,000 merges,
deterministic, ~3.6 characters a token on code as the real ones), ChatML specials (<|endoftext|>, <|im_start|>,
<|im_end|> = EOS) at the end of the vocabulary, a ChatML chat template, and filler tokens up to the real vocabulary
size (never produced by tokenizing; a random model may emit them). gemma3 files hold a SentencePiece vocabulary instead
(transformers reads a Gemma GGUF's tokenizer only so): byte fallback, letters and letter pairs (~2 characters a
token). Text prompts tokenize the same in osd (transformers reads the GGUF's tokenizer) and llama.cpp. Files are
cached by (shape, type, seed) under <cache root>/synth; the F16 intermediate is removed once quantized.

Limitations: the llama3 rope-frequency scaling tensor (rope_freqs) is not written (it changes no cost); gemma3's
tokenizer compresses text about half as well as the real one, so its prompts hold ~2x the tokens (on a gemma3 file
give serve-vs --prefill-chars 2000 for a ~1,000-token prefill).
"""
from __future__ import annotations

import ctypes
import functools
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from osd.errors import InvalidArgument

ARCHS = ("qwen2", "llama", "qwen3", "gemma3")
STD = 0.02  # weights ~ N(0, STD^2): the usual initialisation scale; with unit norms activations stay finite


@dataclass(frozen=True)
class Shape:
    arch: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int
    rope_theta: float
    rms_eps: float
    tied: bool
    sliding_window: int = 0  # gemma3: the local layers' window
    rope_local_theta: float = 0.0  # gemma3: the local layers' rope base

    def __post_init__(self):
        if self.arch not in ARCHS:
            raise InvalidArgument(f"synth-gguf writes {', '.join(ARCHS)} files, not {self.arch!r}")
        if min(self.hidden, self.intermediate, self.layers, self.heads, self.kv_heads, self.head_dim) < 1:
            raise InvalidArgument(f"every dimension of a shape must be >= 1: {self}")
        if self.heads % self.kv_heads:
            raise InvalidArgument(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.vocab < MIN_VOCAB:
            raise InvalidArgument(f"vocab must be >= {MIN_VOCAB} (256 byte tokens and the specials), got {self.vocab}")

    def parameters(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        per_layer = attn + 3 * self.hidden * self.intermediate
        return self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied else 2)


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MIN_VOCAB = 256 + len(SPECIALS)

SHAPES = {
    "qwen2.5-1.5b": Shape("qwen2", 1536, 8960, 28, 12, 2, 128, 151936, 32768, 1e6, 1e-6, True),
    "llama-3.2-1b": Shape("llama", 2048, 8192, 16, 32, 8, 64, 128256, 131072, 5e5, 1e-5, True),
    "llama-3.2-3b": Shape("llama", 3072, 8192, 28, 24, 8, 128, 128256, 131072, 5e5, 1e-5, True),
    "qwen3-1.7b": Shape("qwen3", 2048, 6144, 28, 16, 8, 128, 151936, 40960, 1e6, 1e-6, True),
    "gemma-3-1b": Shape("gemma3", 1152, 6912, 26, 4, 1, 256, 262144, 32768, 1e6, 1e-6, True, 512, 1e4),
}

TYPES = {  # name -> llama.cpp file type (llama_cpp.LLAMA_FTYPE_*); F16 = left as written
    "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q4_K_S": "LLAMA_FTYPE_MOSTLY_Q4_K_S", "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
    "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K", "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
    "Q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1", "F16": None,
}

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def resolve_shape(shape: str | Shape, arch: str | None = None) -> Shape:
    """A shape by name (SHAPES) or as given; `arch`, when named, must be the shape's."""
    if arch is not None and arch not in ARCHS:
        raise InvalidArgument(f"synth-gguf writes {', '.join(ARCHS)} files, not {arch!r}")
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise InvalidArgument(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
        shape = SHAPES[shape]
    if arch is not None and arch != shape.arch:
        raise InvalidArgument(f"the shape is a {shape.arch} model, not {arch}")
    return shape


def check_type(qtype: str) -> str:
    if qtype not in TYPES:
        raise InvalidArgument(f"unsupported type {qtype!r}; synth-gguf writes {', '.join(TYPES)}")
    return qtype


# ---- the synthetic tokenizer -----------------------------------------------------------------------------------

def byte_tokens() -> list[str]:
    """GPT-2's byte -> printable character map: the 256 byte tokens of a byte-level BPE vocabulary, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    by_byte = dict(zip(printable, chars))
    return [chr(by_byte[b]) for b in range(256)]


TOKENIZER_RECIPE = 2  # bump when the synthetic tokenizer changes (it is part of a cached file's name)
BPE_MERGES = 32000  # at most this many merges learned (the data holds ~27,000 with a count of 2 or more)
BPE_SOURCES = ("code", "gsm8k", "spider", "support", "chat", "finance")  # train splits of ../shared/datasets


@functools.lru_cache(maxsize=4)
def trained_bpe(size: int) -> tuple[list[str], list[str]]:
    """(tokens by id, merges) of a byte-level BPE of at most `size` tokens learned on the public datasets' train
    splits (deterministic: the same data gives the same merges; ~4 s). Real tokenizers' compression follows: ~3.6
    characters a token on the code test prompts (the bundled Qwen2.5's ~3.5)."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from osd.data import load_records

    texts = []
    for name in BPE_SOURCES:
        for record in load_records(name, "train"):
            texts += [str(record["prompt"]), str(record.get("reference") or "")]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=min(size, 256 + BPE_MERGES), min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    model = json.loads(tokenizer.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def vocabulary(size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of `size` entries: a BPE learned on the public datasets (trained_bpe; where they
    cannot be found, the byte tokens with merges of a space + letter and of letter pairs, ~2 characters a token),
    fillers, the specials last."""
    import gguf

    from osd.errors import DatasetNotFound

    try:
        tokens, merges = trained_bpe(size - len(SPECIALS))
    except DatasetNotFound:
        space = byte_tokens()[ord(" ")]
        letters = "abcdefghijklmnopqrstuvwxyz"
        pairs = [(space, c) for c in letters] + [(a, b) for a in letters for b in letters]
        pairs = pairs[: max(0, size - MIN_VOCAB)]
        merges = [f"{a} {b}" for a, b in pairs]
        tokens = byte_tokens() + [a + b for a, b in pairs]
    tokens = tokens + [f"<|filler_{i}|>" for i in range(size - len(tokens) - len(SPECIALS))] + SPECIALS
    types = [gguf.TokenType.NORMAL] * (len(tokens) - len(SPECIALS)) + [gguf.TokenType.CONTROL] * len(SPECIALS)
    return tokens, [int(t) for t in types], merges or ["Ġ t"]  # llama.cpp refuses a BPE vocabulary without merges


def spm_vocabulary(size: int) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a SentencePiece-style vocabulary, as Gemma's GGUFs hold (transformers reads
    it as a Unigram model, llama.cpp as SPM): <pad> <eos> <bos> <unk>, the 256 byte-fallback tokens, "▁", the
    lowercase letters, "▁" + letter and letter pairs (scores falling in that order), fillers, the ChatML specials."""
    import gguf

    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = ["▁"] + list(letters) + ["▁" + c for c in letters] + [a + b for a in letters for b in letters]
    head = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces = pieces[: max(0, size - len(head) - len(SPECIALS))]
    fillers = [f"<|filler_{i}|>" for i in range(size - len(head) - len(pieces) - len(SPECIALS))]
    tokens = head + pieces + fillers + SPECIALS
    # log-probability-like scores: a pair scores above its two halves together (-12 > -20), so both tokenizers merge;
    # distinct by a little, so fewer ties are broken differently (llama.cpp merges greedily, transformers' Unigram
    # takes the best whole segmentation: the two can still split a word differently now and then)
    singles = 1 + len(letters)  # "▁" and the letters come first
    scores = ([0.0] * len(head) + [(-10.0 if i < singles else -12.0) - i * 1e-3 for i in range(len(pieces))]
              + [-1e9] * len(fillers) + [0.0] * len(SPECIALS))
    types = ([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.UNKNOWN] + [gguf.TokenType.BYTE] * 256
             + [gguf.TokenType.NORMAL] * (len(pieces) + len(fillers)) + [gguf.TokenType.CONTROL] * len(SPECIALS))
    return tokens, scores, [int(t) for t in types]


def add_tokenizer(writer, shape: Shape) -> None:
    """The synthetic tokenizer (see the module doc): GPT-2 BPE with EOS = <|im_end|> (the last id), or SentencePiece
    for gemma3 (transformers reads a Gemma GGUF's tokenizer as SentencePiece only) with EOS = <eos> (id 1); no BOS
    added."""
    if shape.arch == "gemma3":
        tokens, scores, types = spm_vocabulary(shape.vocab)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_unk_token_id(3)
        writer.add_bos_token_id(2)
        writer.add_pad_token_id(0)
        writer.add_add_space_prefix(False)
        writer.add_eos_token_id(1)  # <eos>: transformers' Gemma tokenizer takes it whatever the file says
    else:
        tokens, types, merges = vocabulary(shape.vocab)
        writer.add_tokenizer_model("gpt2")
        # the split before merging, as transformers converts each family's GGUF tokenizer: Qwen's regex (digits one
        # by one) for qwen2/qwen3, GPT-2's byte-level regex for llama (GGUFLlamaConverter); llama.cpp then agrees
        writer.add_tokenizer_pre("gpt-2" if shape.arch == "llama" else "qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(shape.vocab - 3)  # <|endoftext|>
        writer.add_pad_token_id(shape.vocab - 3)
        writer.add_eos_token_id(shape.vocab - 1)  # <|im_end|>
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


# ---- the tensors ---------------------------------------------------------------------------------------------------

def tensor_shapes(shape: Shape) -> dict[str, tuple[tuple[int, ...], str]]:
    """GGUF tensor name -> ((rows, cols) as numpy holds it, kind): kind "matrix" (random, quantized), "norm" (ones),
    "bias" (random, F32)."""
    s, q, kv = shape, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out = {"token_embd.weight": ((s.vocab, s.hidden), "matrix"), "output_norm.weight": ((s.hidden,), "norm")}
    if not s.tied:
        out["output.weight"] = ((s.vocab, s.hidden), "matrix")
    for i in range(s.layers):
        b = f"blk.{i}."
        out.update({b + "attn_norm.weight": ((s.hidden,), "norm"), b + "attn_q.weight": ((q, s.hidden), "matrix"),
                    b + "attn_k.weight": ((kv, s.hidden), "matrix"), b + "attn_v.weight": ((kv, s.hidden), "matrix"),
                    b + "attn_output.weight": ((s.hidden, q), "matrix"), b + "ffn_norm.weight": ((s.hidden,), "norm"),
                    b + "ffn_gate.weight": ((s.intermediate, s.hidden), "matrix"),
                    b + "ffn_up.weight": ((s.intermediate, s.hidden), "matrix"),
                    b + "ffn_down.weight": ((s.hidden, s.intermediate), "matrix")})
        if s.arch == "qwen2":
            out.update({b + "attn_q.bias": ((q,), "bias"), b + "attn_k.bias": ((kv,), "bias"),
                        b + "attn_v.bias": ((kv,), "bias")})
        if s.arch in ("qwen3", "gemma3"):
            out.update({b + "attn_q_norm.weight": ((s.head_dim,), "norm"), b + "attn_k_norm.weight": ((s.head_dim,), "norm")})
        if s.arch == "gemma3":
            out.update({b + "post_attention_norm.weight": ((s.hidden,), "norm"),
                        b + "post_ffw_norm.weight": ((s.hidden,), "norm")})
    return out


def tensor_values(name: str, dims: tuple[int, ...], kind: str, seed: int) -> np.ndarray:
    """Seeded per (seed, name): the same file for the same seed, whatever the order tensors are written in."""
    if kind == "norm":
        return np.ones(dims, dtype=np.float32)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    values = rng.standard_normal(dims, dtype=np.float32) * np.float32(STD)
    return values if kind == "bias" else values.astype(np.float16)


def write_f16(path: Path, shape: Shape, seed: int, name: str, progress=None) -> None:
    """The unquantized file: matrices F16, norms and biases F32; tensors streamed one at a time (a 3B model's F16
    weights never sit in memory together)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), shape.arch)
    writer.add_name(name)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_rope_freq_base(shape.rope_theta)
    if shape.arch == "llama":
        writer.add_rope_dimension_count(shape.head_dim)
        writer.add_vocab_size(shape.vocab)
    if shape.arch == "gemma3":
        writer.add_sliding_window(shape.sliding_window)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    add_tokenizer(writer, shape)
    layout = tensor_shapes(shape)
    for tensor, (dims, kind) in layout.items():
        dtype = np.float16 if kind == "matrix" else np.float32
        writer.add_tensor_info(tensor, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    bar = progress(total=len(layout), desc="synth weights", unit="tensor") if progress else None
    for tensor, (dims, kind) in layout.items():
        writer.write_tensor_data(tensor_values(tensor, dims, kind, seed))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    writer.close()


def quantize(src: Path, dst: Path, qtype: str, threads: int = 0) -> None:
    """llama.cpp's own quantizer (as `llama-quantize SRC DST TYPE`)."""
    import llama_cpp

    from osd.models.llama_cpp_runner import llama_cpp_lib

    llama_cpp_lib()  # initialised, its log quiet
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, TYPES[qtype])
    params.nthread = threads
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize failed on {src} -> {qtype}")


def synth_path(shape_name: str, shape: Shape, qtype: str, seed: int, root: Path | None = None) -> Path:
    from osd.models.bundled import cache_root

    recipe = [sorted(asdict(shape).items()), TOKENIZER_RECIPE]  # a custom shape of the same name differs
    digest = zlib.crc32(repr(recipe).encode())
    return (root or cache_root() / "synth") / f"{shape_name}-{shape.arch}-{qtype}-s{seed}-{digest:08x}.gguf"


def synth_gguf(shape: str | Shape, qtype: str = "Q4_K_M", seed: int = 0, arch: str | None = None,
               out: str | Path | None = None, threads: int = 0, progress=None, say=print) -> Path:
    """The GGUF of `shape` at `qtype` (cached: an existing file is returned as it is) -> its path."""
    name = shape if isinstance(shape, str) else "custom"
    shape = resolve_shape(shape, arch)
    check_type(qtype)
    path = Path(out) if out else synth_path(name, shape, qtype, seed)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    f16 = path.with_name(path.stem + ".f16.partial") if qtype != "F16" else path.with_name(path.name + ".partial")
    start = time.perf_counter()
    say(f"[osd] synth-gguf: {name} ({shape.arch}, {shape.parameters() / 1e9:.2f}B parameters), random weights "
        f"(seed {seed}) -> {qtype}: {path}")
    write_f16(f16, shape, seed, f"synthetic {name} (random weights, seed {seed})", progress)
    if qtype == "F16":
        f16.replace(path)
    else:
        partial = path.with_name(path.name + ".partial")
        quantize(f16, partial, qtype, threads)
        f16.unlink()
        partial.replace(path)
    say(f"[osd] synth-gguf: {path.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - start:.0f} s")
    return path


def gguf_description(spec: str) -> dict | None:
    """{name, architecture, file type} of a GGUF target from its metadata (a synth-gguf file is named
    "synthetic <shape> (random weights, seed N)"), or None for a target that is not a GGUF."""
    from osd.models.loading import gguf_file

    path = gguf_file(spec)
    if path is None:
        return None
    from osd.models.gguf_meta import gguf_metadata

    keys = ["general.name", "general.architecture", "general.file_type"]
    found = gguf_metadata(path, keys)
    value = found.get
    return {"path": str(path), "name": value("general.name"), "architecture": value("general.architecture"),
            "file_type": value("general.file_type"), "bytes": path.stat().st_size}


def register(bench) -> None:
    p = bench.add_parser("synth-gguf", help="a GGUF at a real model's shapes and types with random weights, for speed "
                         "runs where osd and llama.cpp serve the very same file (prints its path)")
    p.add_argument("--shape", required=True, choices=sorted(SHAPES), help="the public model whose config is copied")
    p.add_argument("--arch", default=None, help="checked against the shape's (qwen2, llama, qwen3, gemma3)")
    p.add_argument("--type", dest="qtype", default="Q4_K_M", help=f"one of {', '.join(TYPES)} (llama.cpp's quantizer)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="the file to write (default: cached under ~/.cache/osd/synth)")
    p.add_argument("--threads", type=int, default=0, help="quantizer threads (0 = all cores)")
    p.set_defaults(func=cmd_synth_gguf)


def cmd_synth_gguf(args) -> None:
    import sys

    from tqdm import tqdm

    path = synth_gguf(args.shape, args.qtype, args.seed, args.arch, args.out, args.threads, tqdm,
                      say=lambda line: print(line, file=sys.stderr, flush=True))
    print(path)
