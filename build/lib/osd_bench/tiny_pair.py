"""A tiny seeded target/draft pair on disk, so that a real `osd serve` process can run without the bundled
models (`osd bench soak --models tiny`).

Two random Qwen2 models (target: 2 layers, draft: 1 layer, hidden 32; lm_head sharpened as in the tests'
tiny models, so greedy text is not uniform noise) and a character-level Hugging Face tokenizer over
printable ASCII plus newline, with a chat template. Written once per version under ~/.cache/osd/tiny;
the same seeds give the same weights, so a server and an in-process reference load identical models.
Limitations: the text the models write is meaningless; characters outside printable ASCII become <unk>.
"""
from __future__ import annotations

from pathlib import Path

VERSION = 1
SPECIALS = ["<pad>", "<eos>", "<unk>"]  # ids 0, 1, 2
CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
CONTEXT = 512  # max_position_embeddings of both models
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def tiny_pair_dir(root: str | Path | None = None) -> Path:
    if root is None:
        from osd.models.bundled import cache_root

        root = cache_root() / "tiny"
    return Path(root) / f"pair-v{VERSION}"


def write_tiny_pair(root: str | Path | None = None) -> tuple[str, str]:
    """-> (target dir, draft dir), written if absent (atomically: a finished pair has both config files)."""
    out = tiny_pair_dir(root)
    target, draft = out / "target", out / "draft"
    if (target / "config.json").exists() and (draft / "config.json").exists():
        return str(target), str(draft)
    tmp = out.with_name(out.name + ".partial")
    tokenizer = char_tokenizer()
    for name, seed, layers in (("target", 0, 2), ("draft", 1, 1)):
        tiny_model(seed, layers, len(tokenizer)).save_pretrained(tmp / name)
        tokenizer.save_pretrained(tmp / name)
    if not out.exists():
        tmp.replace(out)
    return str(target), str(draft)


def char_tokenizer():
    """One token per character (printable ASCII and newline), <eos> = 1, and a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")  # every character alone
    core.decoder = decoders.Fuse()  # join the characters back without spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_model(seed: int, layers: int, vocab: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                         eos_token_id=1, bos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()
