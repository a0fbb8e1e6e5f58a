"""Tokenizer compatibility: speculative decoding needs draft and target to share token ids."""
from __future__ import annotations

from osd.errors import TokenizerMismatch


def check_same_tokenizer(target_tokenizer, draft_tokenizer) -> None:
    """Refuse a pair whose vocabularies or special tokens differ."""
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target_vocab != draft_vocab:
        only_target = len(set(target_vocab.items()) - set(draft_vocab.items()))
        only_draft = len(set(draft_vocab.items()) - set(target_vocab.items()))
        raise TokenizerMismatch(
            f"draft and target tokenizers differ ({len(draft_vocab)} vs {len(target_vocab)} tokens; "
            f"{only_target} target entries and {only_draft} draft entries have no exact match). "
            "Speculative decoding needs a draft that shares the target's tokenizer."
        )
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id"):
        t, d = getattr(target_tokenizer, attr, None), getattr(draft_tokenizer, attr, None)
        if t is not None and d is not None and t != d:
            raise TokenizerMismatch(f"draft and target disagree on {attr}: draft {d}, target {t}")


def special_ids(tokenizer) -> list[int]:
    """The tokenizer's special and added token ids: a draft's narrowed LM head always keeps them (EOS included)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return sorted(int(i) for i in ids)
