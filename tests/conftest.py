"""Tiny seeded models built in-process, and a toy tokenizer. No network, no files."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import importlib

import pytest
import torch

VOCAB = 48
EOS = 1


class ToyTokenizer:
    """Token id i <-> one character; id 1 is EOS. Enough for decoding, stop strings and templates."""

    eos_token_id = EOS
    bos_token_id = None
    pad_token_id = 0
    alphabet = "_$abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTU"[:VOCAB]

    def __init__(self, vocab=None):
        self._vocab = vocab or {c: i for i, c in enumerate(self.alphabet)}

    def get_vocab(self):
        return dict(self._vocab)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.alphabet[i] for i in ids if not (skip_special_tokens and i == EOS))

    def encode(self, text, add_special_tokens=False):
        return [self._vocab[c] for c in text]

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": self.encode(text)}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **kw):
        text = "".join(f"${m['role'][0]}{m['content']}" for m in messages) + ("$a" if add_generation_prompt else "")
        return self.encode(text) if tokenize else text


def tiny_qwen2(seed: int, layers: int = 2, hidden: int = 32, vocab: int = VOCAB, tied: bool = False):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=EOS, bos_token_id=None, pad_token_id=0, tie_word_embeddings=tied)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # sharpen the output distribution so greedy text is not uniform noise
        model.lm_head.weight.mul_(8.0)
    return model.eval().requires_grad_(False)


TOKENIZER_CHARS = ["<pad>", "<eos>"] + list("abcdefghijklmnopqrstuvwxyz") + list(" .?ABCDEFGHIJKLMNOPQ")


def tiny_tokenizer():
    """A Hugging Face fast tokenizer over TOKENIZER_CHARS (one token per character), for model directories on disk."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(BPE({c: i for i, c in enumerate(TOKENIZER_CHARS)}, [])),
                                  eos_token="<eos>", pad_token="<pad>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}?"
    return tok


def save_tiny_pair(root, draft_layers: int = 2) -> None:
    """root/target (seed 0, 2 layers) and root/draft (seed 1) as HF model directories with tiny_tokenizer()."""
    for name, seed, layers in (("target", 0, 2), ("draft", 1, draft_layers)):
        tiny_qwen2(seed=seed, layers=layers).save_pretrained(root / name)
        tiny_tokenizer().save_pretrained(root / name)


def kernels_required() -> bool:
    """scripts/test.sh sets OSD_REQUIRE_KERNELS=1 where setup built the kernels (a CPU with AVX2): there a missing
    kernel or llama.cpp fails the test instead of skipping it, so the identity evidence cannot go missing quietly."""
    return os.environ.get("OSD_REQUIRE_KERNELS") == "1"


def skip_or_fail(reason: str) -> None:
    """Skip (a machine that cannot build the kernels), or fail where they are required (kernels_required)."""
    if kernels_required():
        pytest.fail(f"required here (OSD_REQUIRE_KERNELS=1) but unavailable: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require_module(name: str):
    """pytest.importorskip that fails instead where the kernels are required (llama.cpp is built by setup)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        skip_or_fail(f"{name} cannot be imported: {e}")


def require_glue():
    """The Q4 backend's compiled glue (the glue draft runner runs on it): skip where it cannot be built, fail where
    the kernels are required."""
    try:
        from osd.models.q4_runner import glue

        return glue()
    except Exception as e:  # noqa: BLE001
        skip_or_fail(f"the glue kernels cannot be built here: {e}")


def require_q4() -> None:
    """Osd's Q4 kernel: skip where it cannot run, fail where it is required."""
    from osd.models import q4

    if not q4.available():
        skip_or_fail(f"the Q4 kernel is unavailable on this machine: {q4.build_error()}")


@pytest.fixture(scope="module")
def compiled():
    """The compiled rows_linear kernels (models/kernels.py); skipped only where they cannot be built (and not
    required: kernels_required)."""
    from osd.errors import KernelUnavailable
    from osd.models import kernels

    try:
        return kernels.load()
    except KernelUnavailable as e:
        skip_or_fail(f"the compiled kernels cannot be built here: {e}")


@pytest.fixture
def tokenizer():
    return ToyTokenizer()


@pytest.fixture
def target_model():
    return tiny_qwen2(seed=0)


@pytest.fixture
def draft_model():
    return tiny_qwen2(seed=1, layers=1)
