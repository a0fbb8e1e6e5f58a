"""Frozen-trunk split, LoRA adapters, and per-request merging in the replay buffer."""
import copy

import pytest
import torch
from conftest import tiny_qwen2

from osd.errors import InvalidArgument
from osd.learn.batch import draft_logits_at
from osd.learn.buffer import ReplayBuffer, ReplayItem
from osd.learn.compact import compress
from osd.learn.trainable import (configure_trainable, head_logits_at, merge_lora, rows_only_supported, split_index,
                                 trunk_features)


def _item(tokens, positions, request="r", vocab=48):
    return ReplayItem(tokens, positions, compress(torch.randn(len(positions), vocab), 8), request, 0, 0.0)


def test_trunk_plus_head_equals_the_full_forward():
    model = tiny_qwen2(seed=3, layers=3)
    ids = torch.tensor([[5, 9, 11, 20, 7, 3]])
    full = model(ids).logits[0]
    for split in (1, 2, 3):
        features = trunk_features(model, ids, split)
        rows, cols = torch.zeros(6, dtype=torch.long), torch.arange(6)
        assert torch.allclose(head_logits_at(model, features, split, rows, cols), full, atol=1e-5)


@pytest.mark.parametrize("trainable", ["no_embeddings", "lora"])
def test_last_layer_at_supervised_rows_only_matches_the_whole_layer_values_and_gradients(trainable):
    """Right-padded batch of two contexts, supervised positions scattered (not the last ones)."""
    model = tiny_qwen2(seed=3, layers=3)
    params = configure_trainable(model, trainable, train_layers=2)
    split = split_index(model, 2)
    assert rows_only_supported(model, model.model.layers[-1])
    ids = torch.tensor([[5, 9, 11, 20, 7, 3, 12, 30], [7, 8, 9, 10, 0, 0, 0, 0]])
    features = trunk_features(model, ids, split)
    rows, cols = torch.tensor([0, 0, 0, 1, 1]), torch.tensor([1, 4, 6, 0, 3])
    results = []
    for rows_only in (False, True):
        model.zero_grad(set_to_none=True)
        logits = head_logits_at(model, features, split, rows, cols, rows_only=rows_only)
        (logits.log_softmax(-1)[:, :7].sum() + logits.pow(2).mean()).backward()
        results.append((logits.detach(), [p.grad.clone() for p in params]))
    (full, full_grads), (rows_only, grads) = results
    torch.testing.assert_close(rows_only, full, rtol=1e-4, atol=1e-5)
    for a, b in zip(grads, full_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_draft_logits_with_cached_features_match_and_are_kept_on_items():
    model = tiny_qwen2(seed=3, layers=3)
    items = [_item([5, 9, 11, 20], [2, 4]), _item([7, 8, 9], [3], "q")]
    dense = draft_logits_at(model, items, split=0)
    assert all(it.features is None for it in items)
    split = split_index(model, 1)
    first = draft_logits_at(model, items, split)
    assert all(it.features is not None for it in items)  # computed once, cached (bf16)
    again = draft_logits_at(model, items, split)
    assert torch.allclose(first, again) and torch.allclose(first, dense, atol=0.05)


def test_configure_trainable_sets_exactly_the_requested_parameters():
    model = tiny_qwen2(seed=3, layers=3)
    params = configure_trainable(model, "no_embeddings", train_layers=1)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names and all(n.startswith(("model.layers.2.", "model.norm")) for n in names)
    assert len(params) == len(names)
    with pytest.raises(InvalidArgument, match="train_layers"):
        configure_trainable(tiny_qwen2(seed=3, layers=3), "no_embeddings", train_layers=-1)
    assert split_index(tiny_qwen2(seed=3, layers=3), 5) == 0  # deeper than the draft: every layer trains
    with pytest.raises(InvalidArgument, match="trainable"):
        configure_trainable(tiny_qwen2(seed=3), "everything")


def test_lora_starts_as_identity_trains_only_adapters_and_merges_exactly():
    model = tiny_qwen2(seed=3, layers=2)
    ids = torch.tensor([[5, 9, 11, 20]])
    before = model(ids).logits
    params = configure_trainable(model, "lora", lora_rank=4)
    assert torch.allclose(model(ids).logits, before, atol=1e-6)
    assert all(p.requires_grad for p in params) and not model.lm_head.weight.requires_grad
    with torch.no_grad():
        for p in params:
            p.add_(0.05 * torch.randn_like(p))
    adapted = model(ids).logits
    assert not torch.allclose(adapted, before, atol=1e-4)
    merge_lora(model)
    assert not any("lora_" in n for n, _ in model.named_parameters())
    assert torch.allclose(model(ids).logits, adapted, atol=1e-4)


def test_buffer_merges_the_steps_of_one_request():
    buffer = ReplayBuffer(capacity=100)
    buffer.add(_item([1, 2, 3], [3]))
    buffer.add(_item([1, 2, 3, 4, 5], [5]))  # a later step of the same request: its context extends the first
    buffer.add(_item([1, 2, 9], [3], request="other"))
    items = buffer.snapshot()
    assert len(items) == 2 and len(buffer) == 3 and buffer.added == 3
    assert items[0].tokens == [1, 2, 3, 4, 5] and items[0].positions == [3, 5] and len(items[0].target) == 2


@pytest.mark.parametrize("n_accepted, k", [(0, 3), (1, 3), (2, 3), (3, 3), (0, 1)])
def test_the_mismatch_item_cut_from_the_all_item_is_the_one_built_alone(n_accepted, k):
    """OnlineLearner.observe computes a step's top-k once (the guard's "all" item) and cuts the training item from
    it: the same tokens, position and distribution as item_from_step(..., "mismatch") builds alone."""
    import torch

    from osd.learn.buffer import item_from_step, mismatch_from_all
    from osd.schedule.records import StepRecord

    g = torch.Generator().manual_seed(n_accepted * 10 + k)
    record = StepRecord("r", ("d", 3), list(range(40)), [5, 6, 7][:k], n_accepted, 9,
                        torch.randn(k + 1, 50, generator=g), None, [], 0.0, 0.0, 0.0)
    every = item_from_step(record, "all", top_k=8, max_context=32, now=1.0)
    alone = item_from_step(record, "mismatch", top_k=8, max_context=32, now=1.0)
    cut = mismatch_from_all(every, record)
    if alone is None:
        assert cut is None
        return
    assert (cut.tokens, cut.positions, cut.request_id, cut.draft_version) == \
        (alone.tokens, alone.positions, alone.request_id, alone.draft_version)
    assert torch.equal(cut.target.ids, alone.target.ids) and torch.equal(cut.target.probs, alone.target.probs)
