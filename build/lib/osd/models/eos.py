"""End-of-sequence ids, as configs and tokenizers name them."""
from __future__ import annotations


def eos_ids_of(*sources) -> set[int]:
    """End-of-sequence ids named by configs / tokenizers (an int or a list each)."""
    ids = set()
    for source in sources:
        eos = getattr(source, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
    return ids


def eos_token_ids(model, tokenizer) -> set[int]:
    """A torch model's end-of-sequence ids (generation config, model config) plus the tokenizer's."""
    return eos_ids_of(getattr(model, "generation_config", None), model.config, tokenizer)
