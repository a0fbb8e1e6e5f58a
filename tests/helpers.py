"""Shared builders for engine tests."""
from osd.config import SpeculationConfig
from osd.drafts import DraftRegistry
from osd.engine import SpeculativeEngine
from osd.propose import DraftModelProposer


def make_engine(target, draft, tokenizer, k=4, adaptive=False, name="draft", vocab_ids=None, max_batch=1):
    registry = DraftRegistry()
    registry.publish(name, draft, vocab_ids)
    proposer = DraftModelProposer(registry, name, target.config.vocab_size)
    return SpeculativeEngine(target, tokenizer, proposer, SpeculationConfig(k=k, adaptive=adaptive, max_batch=max_batch)), registry


def plain_greedy(model, prompt, n, eos=None):
    """Reference: the model's own greedy decoding, recomputing the full prefix each token (no cache)."""
    import torch

    ids = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(n):
            token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            if token == eos:
                break
            ids.append(token)
            out.append(token)
    return out
