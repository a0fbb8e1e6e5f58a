"""Tiny seeded Qwen2 / Llama / Qwen3 / Gemma 3 models built in transformers, written as GGUFs the way llama.cpp's
converter (convert_hf_to_gguf.py) writes them, and the same models holding exactly the weights the GGUF holds.

The GGUF: metadata and tensor names as the converter gives them (names from gguf-py's own TensorNameMap, which the
converter uses), a Llama's q/k rows permuted for llama.cpp's adjacent-pair RoPE (`LlamaModel.permute`) and its Llama 3
RoPE factors as a `rope_freqs` tensor, Gemma's norms stored as 1 + w (`norm_shift`); matrices quantized to Q4_K
(Q6_K for layer 0's v and down projections and for the LM head, as a Q4_K_M file mixes them) by osd's own quantizer
(models/q4_quantize.py), norms and an untied embedding float32. The reference: the transformers model with every
tensor replaced by what the GGUF holds, dequantized by gguf-py and un-transformed (permutation undone, 1 taken off),
run in fp32 with eager attention.

Widths: hidden 256 (a Q4_K block is 256 weights wide: every matrix's input width must be whole blocks), 4 heads of 64
over 2 KV heads, 2 layers (Gemma 3: 6, so that layers 0-4 slide and layer 5 is global, llama.cpp's fixed pattern),
Gemma's window 8 positions: every test prompt crosses it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.models.tiny_gguf import EOS, SPECIALS, VOCAB, _byte_tokens

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 4, 2, 64
WINDOW = 8  # Gemma 3's sliding window in the tiny model
LAYERS = {"qwen2": 2, "llama": 2, "qwen3": 2, "gemma3": 6}
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # wavelengths 16..64 smoothed: every branch of the factors
GEMMA_ROPE = {"rope_type": "linear", "factor": 8.0}  # global layers only (the 4B and larger have it)
FAMILIES = tuple(LAYERS)


def hf_config(arch: str):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS[arch],
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
                  rms_norm_eps=1e-6, eos_token_id=EOS, bos_token_id=256, initializer_range=0.08,
                  attn_implementation="eager")
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, rope_theta=10000.0, tie_word_embeddings=False)
    if arch == "llama":  # SmolLM2 / Llama 3.2 style: tied, Llama 3 RoPE scaling
        return transformers.LlamaConfig(**common, rope_theta=10000.0, rope_scaling=dict(LLAMA3_ROPE),
                                        tie_word_embeddings=True)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=HEAD_DIM, rope_theta=1e6, tie_word_embeddings=False)
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(**common, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM,
                                             sliding_window=WINDOW, rope_theta=1e6, rope_local_base_freq=10000.0,
                                             rope_scaling=dict(GEMMA_ROPE), hidden_activation="gelu_pytorch_tanh",
                                             final_logit_softcapping=None, attn_logit_softcapping=None,
                                             tie_word_embeddings=True, pad_token_id=0)
    raise ValueError(arch)


def hf_model(arch: str, seed: int, config=None):
    """A seeded tiny transformers model of the family, its norms perturbed (so that each one matters), an untied LM
    head times 8 (peaked outputs, as a trained model's). With a tied table, a random model's residual stream is mostly
    the input token's own embedding and greedy decoding repeats the last token: the Llama's table stays as drawn, and
    Gemma's post-attention/post-MLP norms are 8 (1 + w), so that the layers outweigh the sqrt(hidden)-scaled
    embedding and greedy outputs vary (what the speculative tests need). `config`: another config of the family
    (hf_config(arch) changed) instead of hf_config(arch)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config or hf_config(arch), attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # gemma: 0 means 1 (1 + w); the others: 1 means 1
                p.copy_((0.0 if arch == "gemma3" else 1.0) + 0.1 * torch.randn_like(p))
            if arch == "gemma3" and name.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
                p.copy_(8 * (1 + p) - 1)  # gemma's branch norms: 8 (1 + w)
        if not model.config.tie_word_embeddings:
            model.get_output_embeddings().weight.mul_(8.0)
    return model.float().eval().requires_grad_(False)


def permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter (`LlamaModel.permute`): a q or k matrix's rows per head (2, D/2) -> (D/2, 2)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(config) -> torch.Tensor:
    """The converter's `rope_freqs` (LlamaModel.generate_extra_tensors): per frequency, the factor dividing it. The
    draft copy computes them with the same formula (models/q4_draft.py); transformers' own scaled RoPE, which the
    logits are compared with, checks both."""
    from osd.models.q4_draft import llama3_factors

    return llama3_factors(config, config.rope_scaling)


def _quant_type(gguf_name: str, tied: bool) -> str:
    if gguf_name == "output.weight" or (tied and gguf_name == "token_embd.weight"):
        return "Q6_K"
    if gguf_name.startswith("blk.0.") and gguf_name.endswith(("attn_v.weight", "ffn_down.weight")):
        return "Q6_K"
    if gguf_name.endswith(("norm.weight", ".bias")) or gguf_name == "token_embd.weight":
        return "F32"
    return "Q4_K"


def write_arch_gguf(path: Path, arch: str, seed: int = 0, extra: dict | None = None):
    """Write the family's tiny model as a Q4_K/Q6_K GGUF at `path` (plus `extra` float32 tensors by GGUF name);
    return the transformers model holding exactly the GGUF's (dequantized) weights."""
    import gguf

    from osd.models.q4_quantize import quantize_q4k, quantize_q6k

    model = hf_model(arch, seed)
    config, state = model.config, model.state_dict()
    tied = bool(config.tie_word_embeddings)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS[arch])
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    if arch in ("qwen3", "gemma3"):
        writer.add_key_length(HEAD_DIM)
        writer.add_value_length(HEAD_DIM)
    if arch == "llama":
        writer.add_vocab_size(VOCAB)
        writer.add_rope_dimension_count(HEAD_DIM)
    if arch == "gemma3":
        writer.add_sliding_window(WINDOW)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(GEMMA_ROPE["factor"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(_byte_tokens() + SPECIALS)
    writer.add_token_types([gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * len(SPECIALS))
    writer.add_token_merges(["Ġ t"])
    writer.add_eos_token_id(EOS)
    writer.add_bos_token_id(256)

    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), LAYERS[arch])
    written = {}  # gguf name -> hf name
    for hf_name, t in state.items():
        if tied and hf_name == "lm_head.weight":
            continue
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        t = t.float()
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            t = permute(t, HEADS if "q_proj" in hf_name else KV_HEADS)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            t = t + 1.0
        kind = _quant_type(gguf_name, tied)
        if kind == "F32":
            writer.add_tensor(gguf_name, t.numpy().astype(np.float32))
        else:
            raw = (quantize_q4k if kind == "Q4_K" else quantize_q6k)(t.contiguous())
            writer.add_tensor(gguf_name, raw.numpy(), raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
        written[gguf_name] = hf_name
    if arch == "llama":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(config).numpy())
    for name, values in (extra or {}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    for tensor in gguf.GGUFReader(str(path)).tensors:  # the reference holds what the file holds
        if tensor.name not in written:
            continue
        hf_name = written[tensor.name]
        target = state[hf_name]
        values = torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
        values = values.reshape(target.shape)
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            values = unpermute(values, HEADS if "q_proj" in hf_name else KV_HEADS)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            values = values - 1.0
        target.copy_(values)
    if tied:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def q8k_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) -> x rounded as llama.cpp's Q8_K activations (quantize_row_q8_K_ref, the osd kernel's quantize_q8k):
    per 256-block, d = -x[i] / 127 for the first element i of largest magnitude, quants round-half-even(x / d) capped
    at 127; back to d * q. A K that is not a multiple of 256 gets zero columns first and loses them after, as a draft
    copy's runner pads its rows (q4_runner.padded)."""
    pad = -x.shape[-1] % 256
    if pad:
        return q8k_round_trip(torch.nn.functional.pad(x.float(), (0, pad)))[..., : x.shape[-1]]
    blocks = x.float().reshape(-1, 256)
    first = blocks.abs().argmax(dim=1, keepdim=True)  # the first maximum, as ggml keeps it
    iscale = -127.0 / blocks.gather(1, first)
    iscale = torch.where(torch.isfinite(iscale), iscale, torch.zeros_like(iscale))  # an all-zero block stays zero
    q = torch.round(blocks * iscale).clamp(max=127)  # torch.round: half to even, as _mm256_cvtps_epi32
    d = torch.where(iscale != 0, 1.0 / iscale, torch.zeros_like(iscale))
    return (q * d).reshape(x.shape)


class Q8KInputs:
    """Within the block, every nn.Linear of `model` sees its input rounded as the kernel rounds activations: the
    reference then differs from the osd forward only in float summation order, exp and rsqrt (not in 8-bit rounding)."""

    def __init__(self, model):
        self.model, self.handles = model, []

    def __enter__(self):
        for module in self.model.modules():
            if isinstance(module, torch.nn.Linear):
                self.handles.append(module.register_forward_pre_hook(lambda _, args: (q8k_round_trip(args[0]),)))
        return self.model

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles.clear()
