"""The torch runner (models/runner.py): a causal LM plus its KV cache over one sequence. Rollback is a crop."""
from __future__ import annotations

import torch

from osd.models.eos import eos_ids_of


class CachedModel:
    """Feeds tokens into a model whose KV cache holds the first `length` tokens of one sequence.

    Row invariance: over a serving copy made with the compiled kernels (models/prepack.py for the target,
    the int8 draft of models/serving_draft.py) a position's logits are bitwise the same whether it is fed
    alone or with up to any number of other rows (tests/models/test_kernel_invariance.py checks 1..9), so
    greedy output does not depend on the k chosen. Over a plain torch model they are not: torch's matmuls,
    attention and SiLU sum differently by row count (differences ~1e-6), which can flip an exact near-tie.

    Limitations: one sequence per instance (models/slots.py RunnerSlots keeps one per slot, fed one after another);
    the cache is a transformers DynamicCache (cropping is O(1) views).
    """

    def __init__(self, model):
        self.model = model
        self.cache = None
        self.length = 0  # tokens whose keys/values are in the cache
        config = model.config
        self.vocab_size = int(config.vocab_size)
        self.context_window = int(getattr(config, "max_position_embeddings", 0) or 0)
        self.eos_ids = eos_ids_of(getattr(model, "generation_config", None), config)

    def reset(self) -> None:
        self.cache, self.length = None, 0

    @torch.inference_mode()
    def feed(self, token_ids: list[int], n_logits: int = 1) -> torch.Tensor:
        """Append tokens to the cache; return float32 logits (n_logits, V) for the last positions."""
        from transformers import DynamicCache

        if self.cache is None:
            self.cache = DynamicCache()
        input_ids = torch.tensor([token_ids], dtype=torch.long)  # (1, T)
        out = self.model(input_ids=input_ids, past_key_values=self.cache, use_cache=True, logits_to_keep=n_logits)
        self.length += len(token_ids)
        return out.logits[0, -n_logits:].float()  # (n_logits, V)

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens."""
        if length < self.length:
            self.cache.crop(length)
            self.length = length
