"""`osd bench feature-head`'s pieces: examples are aligned (feature at t, embedding of t + 1, label t + 2), the head
learns a rule that needs both inputs, and the draft is scored on the same positions."""
from __future__ import annotations

import torch

from osd.bench.feature_head import FeatureHead, agreement, draft_hits, examples, head_agreement, train_head

H = 8


class FakeRunner:
    """Features are one-hot of the token at each position; embeddings one-hot of the token (H = 8 tokens)."""
    chunk_rows = 4

    def reset(self):
        pass

    def _forward(self, ids):
        return torch.nn.functional.one_hot(torch.tensor(ids), H).float()

    _glue = type("G", (), {"rms_norm": staticmethod(lambda x, w, eps: x)})
    output_norm, shape = None, type("S", (), {"eps": 1e-6})

    def embed(self, ids):
        return torch.nn.functional.one_hot(torch.tensor(ids), H).float() * 2


def test_examples_take_the_feature_at_t_the_embedding_at_t_plus_1_and_the_label_at_t_plus_2():
    index = torch.arange(H)
    feats, embs, labels = examples(FakeRunner(), [([1, 2], [3, 4, 5])], index)
    # prompt [1, 2], answer [3, 4, 5]: t = 1, 2 (the prompt's last position, then the first answer position)
    assert feats.argmax(-1).tolist() == [2, 3] and embs.argmax(-1).tolist() == [3, 4] and labels.tolist() == [4, 5]
    index[5] = -1  # outside the map
    assert examples(FakeRunner(), [([1, 2], [3, 4, 5])], index)[2].tolist() == [4, -1]


def test_the_head_learns_a_rule_of_feature_and_embedding():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, H, (512,), generator=g), torch.randint(0, H, (512,), generator=g)
    data = (torch.nn.functional.one_hot(a, H).float(), torch.nn.functional.one_hot(b, H).float(), (a + b) % H)
    torch.manual_seed(0)
    head = FeatureHead(H, 64, torch.randn(H, H))
    before = head_agreement(head, data)
    losses = train_head(head, data, epochs=60, lr=3e-3, batch=64)
    assert losses[-1] < losses[0] and head_agreement(head, data) > max(0.9, before + 0.5)


def test_the_draft_is_scored_at_the_same_positions():
    class Oracle(torch.nn.Module):  # predicts seq[i + 1] exactly except for token 5
        def __init__(self, seq):
            super().__init__()
            self.seq = seq

        def forward(self, ids):
            nxt = torch.tensor(self.seq[1 : ids.shape[1] + 1])
            logits = torch.nn.functional.one_hot(torch.where(nxt == 5, 0, nxt), H).float()[None]
            return type("O", (), {"logits": logits})

    seq = [1, 2, 3, 4, 5]
    assert agreement(draft_hits(Oracle(seq), [([1, 2], [3, 4, 5])], torch.arange(H))) == 0.5  # 4 right, 5 wrong
    assert agreement([]) == 0.0  # no held-out position: 0, not a division by zero
    # per position, in the order `examples` makes them (a sample with no position adds none), so the head's and
    # the draft's hits pair up for the sign test
    samples = [([1, 2], [3, 4, 5]), ([1], [2])]
    hits = draft_hits(Oracle(seq), samples, torch.arange(H))
    assert hits == [True, False] and len(hits) == len(examples(FakeRunner(), samples, torch.arange(H))[2])


def test_sources_name_their_split_and_slice_and_a_held_out_slice_may_not_meet_a_training_one():
    import pytest

    from osd.bench.feature_head import check_disjoint, source_slices
    from osd.errors import InvalidArgument

    assert source_slices(["code", "multilingual_qa@de:test[100:130]"], "train", 40) == [
        ("code", "train", 0, 40), ("multilingual_qa@de", "test", 100, 130)]
    train = source_slices(["multilingual_qa@de:test[0:100]", "code"], "train", 40)
    check_disjoint(train, source_slices(["multilingual_qa@de:test[100:106]", "code"], "test", 6))  # disjoint: fine
    check_disjoint(train, source_slices(["multilingual_qa@ru:test[0:6]"], "test", 6))  # another language
    with pytest.raises(InvalidArgument, match="overlaps"):
        check_disjoint(train, source_slices(["multilingual_qa@de:test[99:105]"], "test", 6))
    with pytest.raises(InvalidArgument, match="overlaps"):
        check_disjoint(train, source_slices(["code:train[39:45]"], "test", 6))
