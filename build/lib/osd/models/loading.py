"""Resolve any model spec and load it: plain models (models/plain.py: `bundled:<name>`, a local Hugging Face
directory, a `.gguf` file, a hub id) and `derived:<dir or shipped name>` (a cheap draft cut from a plain base,
models/derived.py), or a directory saved from a derived draft (its LM head covers a vocabulary map).
"""
from __future__ import annotations

from pathlib import Path

from osd.models.derived import load_derived, load_restricted_dir, read_recipe
from osd.models.plain import (DTYPES, converted_dir, gguf_file, load_plain_model, load_plain_tokenizer,  # noqa: F401
                              resolve_model_dir, tokenizer_kwargs)


def load_tokenizer(spec: str):
    if isinstance(spec, str) and spec.startswith("derived:"):  # a derived draft reads its base's tokens
        return load_plain_tokenizer(read_recipe(spec)["derive"]["base"])
    return load_plain_tokenizer(spec)


def _restricted_head(where: str) -> bool:
    import json

    from osd.models.vocab_map import CONFIG_KEY

    try:
        return CONFIG_KEY in json.loads((Path(where) / "config.json").read_text())
    except (OSError, ValueError):
        return False


def load_model(spec: str, dtype: str = "float32"):
    """Load a causal LM in eval mode, no grad, with the given dtype."""
    if isinstance(spec, str) and spec.startswith("derived:"):
        return load_derived(spec, dtype)
    where = resolve_model_dir(spec)
    if _restricted_head(where):  # saved from a derived draft: its LM head covers a vocabulary map
        return load_restricted_dir(where, DTYPES[dtype])
    return load_plain_model(spec, dtype, where)
