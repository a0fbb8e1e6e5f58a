"""A tiny seeded Qwen2 written as a quantized GGUF (gguf-py), and the same weights dequantized into torch.

The torch twin is the reference computation for the llama.cpp backend: same architecture, the exact
weights llama.cpp holds (each quantized tensor dequantized by gguf-py), fp32 arithmetic.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from osd_bench.synth_gguf import byte_tokens as _byte_tokens  # GPT-2's byte map, one copy

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2  # K-quants need rows of a multiple of 256
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB = 256 + len(SPECIALS)
EOS = 256 + 2  # <|im_end|>




def tiny_torch_model(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
                         rope_theta=10000.0, rms_norm_eps=1e-6, eos_token_id=EOS, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # a peaked output distribution, as real models have
    return model.eval().requires_grad_(False)


def _gguf_names(layers: int) -> dict[str, str]:
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
             "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
             "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    for i in range(layers):
        names.update({f"model.layers.{i}.{hf}": f"blk.{i}.{g}" for hf, g in parts.items()})
    return names


def write_tiny_gguf(path: Path, seed: int = 0, quantize: bool = True, ftype: str = "Q4_K_M"):
    """Write a Q4_K_M GGUF of a seeded tiny Qwen2 (quantized by llama.cpp itself, as the real GGUFs were);
    return the torch model holding exactly the dequantized weights llama.cpp serves. quantize=False: the float32
    GGUF as written (every tensor F32). `ftype`: llama.cpp's file type (LLAMA_FTYPE_MOSTLY_<ftype>: Q8_0, Q4_0, ...)."""
    import ctypes

    import gguf
    import llama_cpp

    from osd.models.llama_cpp_runner import llama_cpp_lib

    llama_cpp_lib()  # initialised, its log quiet
    model = tiny_torch_model(seed)
    f32 = path.with_name(path.stem + "-f32.gguf") if quantize else path
    writer = gguf.GGUFWriter(str(f32), "qwen2")
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(_byte_tokens() + SPECIALS)
    writer.add_token_types([gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * len(SPECIALS))
    writer.add_token_merges(["Ġ t"])  # llama.cpp refuses a BPE vocabulary without merges
    writer.add_eos_token_id(EOS)
    writer.add_bos_token_id(256)
    names = _gguf_names(LAYERS)
    state = model.state_dict()
    for hf_name, gguf_name in names.items():
        writer.add_tensor(gguf_name, state[hf_name].float().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if not quantize:
        return model

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 1
    if llama_cpp.llama_model_quantize(str(f32).encode(), str(path).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError("llama_model_quantize failed")
    f32.unlink()

    by_gguf = {g: h for h, g in names.items()}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        target = state[by_gguf[tensor.name]]
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        target.copy_(torch.from_numpy(np.array(values, dtype=np.float32)).reshape(target.shape))
    return model


PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 32, 84, 104, 105, 115, 32, 105, 115]  # bytes


class ByteTokenizer:
    """Decodes the tiny model's byte tokens (enough for the engine's stop checks)."""

    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 256).decode("latin-1")


def target_only(runner, prompt, n):
    """The runner's own greedy tokens (k = 0): what every speculative run must reproduce."""
    from osd.config import SamplingConfig, SpeculationConfig
    from osd.engine import SpeculativeEngine

    engine = SpeculativeEngine(runner, ByteTokenizer(), None, SpeculationConfig(k=0, adaptive=False))
    return engine.generate(prompt, SamplingConfig(max_new_tokens=n)).token_ids


ROW_TOKENS = PROMPT + [101, 32, 97, 32, 116, 101, 115, 116, 46, 10]  # PROMPT, then the positions the row tests check


def assert_argmax_agrees_where_clear(got: torch.Tensor, want: torch.Tensor, margin: float) -> None:
    """At positions whose top-2 gap in `want` exceeds `margin` (a winner the tolerance cannot flip; at least half of
    PROMPT's positions), `got` picks the same token."""
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > margin
    assert clear.sum() >= len(PROMPT) // 2
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def logits_one_at_a_time(runner, tokens: list[int], start: int) -> list[torch.Tensor]:
    """Feed tokens[: start - 1], then one token per feed: each position's logits computed alone (k = 0 style)."""
    runner.reset()
    runner.feed(tokens[: start - 1])
    return [runner.feed([t])[0] for t in tokens[start - 1 :]]


def assert_rows_match_one_at_a_time(runner, tokens: list[int], start: int, one_at_a_time: list[torch.Tensor]) -> None:
    """For every k the runner may verify (k + 1 <= max_rows), after a rollback to the pending token: the k + 1 rows
    fed together give bitwise the logits each position gives alone."""
    for k in range(0, runner.max_rows):
        runner.rollback(start - 1)
        rows = runner.feed(tokens[start - 1 : start + k], n_logits=k + 1)  # pending token + k proposals
        for i in range(k + 1):
            assert torch.equal(rows[i], one_at_a_time[i]), (k, i)


def speculative_runs(runner, draft, n: int = 24):
    """(k, result) for k = 1..8 of a fixed-k engine drafting with `draft`, each already checked to give the runner's
    target-only tokens and to verify up to min(k, max_rows - 1) proposals in one feed."""
    from osd.config import SamplingConfig, SpeculationConfig
    from osd.drafts import DraftRegistry
    from osd.engine import SpeculativeEngine
    from osd.propose.draft_model import DraftModelProposer

    plain = target_only(runner, PROMPT, n)
    assert len(plain) >= 8
    registry = DraftRegistry()
    registry.publish("d", draft)
    for k in range(1, 9):
        engine = SpeculativeEngine(runner, ByteTokenizer(), DraftModelProposer(registry, "d", VOCAB),
                                   SpeculationConfig(k=k, adaptive=False))
        result = engine.generate(PROMPT, SamplingConfig(max_new_tokens=n))
        assert result.token_ids == plain, k
        assert max(step_k for step_k, _ in result.steps) == min(k, runner.max_rows - 1)  # never more rows than invariant
        yield k, result


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(path, reference): a tiny Qwen2 GGUF quantized to Q4_K_M by llama.cpp, and its dequantized torch twin."""
    path = tmp_path_factory.mktemp("gguf") / "tiny-q4k.gguf"
    reference = write_tiny_gguf(path, seed=0)
    return path, reference


@pytest.fixture(scope="module")
def tiny_q4(tiny):
    """(a Q4Runner over the tiny GGUF, its vocabulary size); skipped (or failed under CI) where the kernel cannot run."""
    from conftest import require_module, skip_or_fail

    from osd.models import q4
    from osd.models.q4_runner import Q4Runner

    require_module("llama_cpp")
    if not q4.available():
        skip_or_fail("Q4 kernel unavailable on this machine")
    return Q4Runner(tiny[0], n_ctx=256), VOCAB
