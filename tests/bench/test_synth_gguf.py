"""`osd bench synth-gguf` on tiny custom shapes: each architecture's file loads in llama.cpp and decodes finite
logits, its synthetic tokenizer reads the same in transformers (osd's tokenizer path) and llama.cpp, the writer is
seeded, and osd's Q4 backend serves the architectures it serves today (qwen2; the others turn on by themselves when
`q4_runner.serves` accepts their files). Unsupported architectures, shapes and types are named errors."""
import numpy as np
import pytest
from conftest import require_module, require_q4

require_module("llama_cpp")

from osd.errors import InvalidArgument  # noqa: E402
from osd_bench.synth_gguf import SHAPES, Shape, resolve_shape, synth_gguf, tensor_shapes, tensor_values  # noqa: E402

TEXT = "hello world, this is a test of the tokenizer: x = 1 + 2"
Q4_NOW = ("qwen2",)  # architectures osd's Q4 backend serves on main now


def tiny_shape(arch: str) -> Shape:
    """K-quant rows need multiples of 256; tied heads except qwen2 (both layouts covered)."""
    return Shape(arch, 256, 512, 2, 4, 2, 64, 1024, 512, 1e4, 1e-6, tied=arch != "qwen2",
                 sliding_window=64 if arch == "gemma3" else 0, rope_local_theta=1e4 if arch == "gemma3" else 0.0)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OSD_CACHE", str(root / "cache"))  # the GGUF tokenizers' converted copies
        yield {arch: synth_gguf(tiny_shape(arch), "Q4_K_M", seed=0, out=root / f"{arch}.gguf", threads=1,
                                say=lambda line: None) for arch in ("qwen2", "llama", "qwen3", "gemma3")}


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "gemma3"])
def test_llama_cpp_loads_and_decodes_the_file_and_osd_reads_the_same_tokens(files, arch):
    import llama_cpp

    from osd.data import load_records
    from osd.models.llama_cpp_runner import LlamaCppRunner
    from osd.models.plain import load_plain_tokenizer

    vocab = llama_cpp.Llama(str(files[arch]), n_ctx=64, n_threads=1, verbose=False, vocab_only=True)
    ids = vocab.tokenize(TEXT.encode(), add_bos=False, special=False)
    assert 10 < len(ids) < len(TEXT) * (0.7 if arch == "gemma3" else 0.5)  # merges apply: fewer tokens than bytes
    logits = LlamaCppRunner(files[arch], 64, 1).feed(ids, n_logits=2)
    assert logits.shape == (2, 1024) and np.isfinite(logits.numpy()).all() and float(logits.std()) > 0
    tokenizer = load_plain_tokenizer(str(files[arch]))
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer(TEXT, add_special_tokens=False)["input_ids"] == ids
    for text in [r["prompt"] for d in ("code", "gsm8k", "spider", "chat") for r in load_records(d, "test", 2)]:
        ours, theirs = tokenizer(text, add_special_tokens=False)["input_ids"], vocab.tokenize(text.encode(), False, False)
        if arch == "gemma3":  # SentencePiece: transformers' Unigram and llama.cpp's greedy merges split some words apart
            assert abs(len(ours) - len(theirs)) <= 0.1 * len(theirs) and tokenizer.decode(theirs) == text
        else:
            assert ours == theirs, text
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_the_matrices_are_quantized_by_llama_cpp_as_a_downloaded_q4_k_m(files):
    import gguf

    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(files["qwen2"])).tensors}
    assert types["blk.0.attn_q.weight"] == "Q4_K" and types["output.weight"] == "Q6_K"
    assert {types[f"blk.{i}.ffn_down.weight"] for i in range(2)} <= {"Q4_K", "Q6_K"}
    assert types["blk.0.attn_norm.weight"] == "F32" and types["blk.0.attn_q.bias"] == "F32"
    tied = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(files["llama"])).tensors}
    assert "output.weight" not in tied and tied["blk.1.ffn_up.weight"] == "Q4_K"


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "gemma3"])
def test_osd_q4_backend_serves_the_file_where_it_serves_the_architecture(files, arch):
    require_q4()
    from osd.models.llama_cpp_runner import LlamaCppRunner
    from osd.models.q4_runner import Q4Runner, serves

    if arch not in Q4_NOW and not serves(str(files[arch])):
        pytest.skip(f"osd's Q4 backend does not serve {arch} files yet (llama.cpp does)")
    assert serves(str(files[arch]))
    ids = list(range(100, 130))
    ours = Q4Runner(files[arch], 64).feed(ids, n_logits=4)
    theirs = LlamaCppRunner(files[arch], 64, 1).feed(ids, n_logits=4)
    assert np.isfinite(ours.numpy()).all()
    assert float((ours - theirs).abs().max()) < 0.05 * float(theirs.abs().max())  # same weights, other kernels


def test_the_weights_are_seeded_and_scaled():
    a = tensor_values("blk.0.attn_q.weight", (64, 32), "matrix", 0)
    assert a.dtype == np.float16 and np.array_equal(a, tensor_values("blk.0.attn_q.weight", (64, 32), "matrix", 0))
    assert not np.array_equal(a, tensor_values("blk.0.attn_q.weight", (64, 32), "matrix", 1))
    assert not np.array_equal(a, tensor_values("blk.0.attn_k.weight", (64, 32), "matrix", 0))
    assert 0.015 < float(a.astype(np.float32).std()) < 0.025
    assert (tensor_values("output_norm.weight", (8,), "norm", 0) == 1).all()


def test_the_real_shapes_hold_their_parameter_counts():
    billions = {name: round(shape.parameters() / 1e9, 2) for name, shape in SHAPES.items()}
    assert billions == {"qwen2.5-1.5b": 1.54, "llama-3.2-1b": 1.24, "llama-3.2-3b": 3.21, "qwen3-1.7b": 1.72,
                        "gemma-3-1b": 1.0}
    names = tensor_shapes(SHAPES["gemma-3-1b"])
    assert names["blk.0.attn_q.weight"][0] == (1024, 1152) and "blk.25.post_ffw_norm.weight" in names
    assert "output.weight" not in names  # tied


def test_unsupported_architecture_shape_and_type_are_named_errors(tmp_path):
    with pytest.raises(InvalidArgument, match="writes qwen2, llama, qwen3, gemma3 files, not 'mamba'"):
        resolve_shape("llama-3.2-1b", arch="mamba")
    with pytest.raises(InvalidArgument, match="the shape is a llama model, not qwen3"):
        resolve_shape("llama-3.2-1b", arch="qwen3")
    with pytest.raises(InvalidArgument, match="unknown shape 'llama-9b'; known: qwen2.5-1.5b, llama-3.2-1b"):
        resolve_shape("llama-9b")
    with pytest.raises(InvalidArgument, match="unsupported type 'Q3_K_XL'; synth-gguf writes Q4_K_M"):
        synth_gguf(tiny_shape("llama"), "Q3_K_XL", out=tmp_path / "x.gguf")
    with pytest.raises(InvalidArgument, match="not 'mamba'"):
        Shape("mamba", 256, 512, 2, 4, 2, 64, 1024, 512, 1e4, 1e-6, True)


def test_the_header_reader_agrees_with_gguf_py(files):
    import gguf

    from osd.models.gguf_meta import gguf_metadata
    from osd_bench.synth_gguf import gguf_description

    reader = gguf.GGUFReader(str(files["gemma3"]))
    keys = ["general.architecture", "gemma3.block_count", "gemma3.attention.sliding_window", "gemma3.rope.freq_base",
            "tokenizer.ggml.eos_token_id", "tokenizer.chat_template"]
    got = gguf_metadata(files["gemma3"], keys + ["no.such.key"])
    for key in keys:
        field = reader.fields[key]
        part = field.parts[field.data[0]]
        want = bytes(part).decode() if part.dtype == np.uint8 else part.item()
        assert got[key] == pytest.approx(want) if isinstance(want, float) else got[key] == want, key
    assert "no.such.key" not in got
    assert gguf_description(str(files["gemma3"]))["name"] == "synthetic custom (random weights, seed 0)"
