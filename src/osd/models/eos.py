"""End-of-sequence ids, as configs and tokenizers name them."""
from __future__ import annotations


def token_ids_of(*sources, keys: tuple[str, ...] = ("eos_token_id",)) -> set[int]:
    """The ids configs / tokenizers name under `keys` (an int or a list each)."""
    ids = set()
    for source in sources:
        for key in keys:
            value = getattr(source, key, None)
            if isinstance(value, int):
                ids.add(value)
            elif value:
                ids.update(int(e) for e in value)
    return ids


def eos_ids_of(*sources) -> set[int]:
    """End-of-sequence ids named by configs / tokenizers (an int or a list each)."""
    return token_ids_of(*sources)


def eos_token_ids(model, tokenizer) -> set[int]:
    """A torch model's end-of-sequence ids (generation config, model config) plus the tokenizer's."""
    return eos_ids_of(getattr(model, "generation_config", None), model.config, tokenizer)
