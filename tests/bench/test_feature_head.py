"""`osd bench feature-head`'s pieces: examples are aligned (feature at t, embedding of t + 1, label t + 2), the head
learns a rule that needs both inputs, and the draft is scored on the same positions."""
from __future__ import annotations

import torch

from osd_bench.feature_head import (Chains, FeatureHead, agreement, chain_examples, draft_chains, head_agreement,
                                    train_head)

H = 8


class FakeRunner:
    """Features are one-hot of the token at each position; embeddings one-hot of the token (H = 8 tokens)."""
    chunk_rows = 4

    def reset(self):
        pass

    def _forward(self, ids, taps=None):
        for i, kept in (taps or {}).items():  # layer i's output: the one-hot of the token shifted by i + 1
            kept.append(torch.nn.functional.one_hot((torch.tensor(ids) + i + 1) % H, H).float())
        return torch.nn.functional.one_hot(torch.tensor(ids), H).float()

    _glue = type("G", (), {"rms_norm": staticmethod(lambda x, w, eps: x)})
    shape = type("S", (), {"eps": 1e-6})
    output_norm = None

    def embed(self, ids):
        return torch.nn.functional.one_hot(torch.tensor(ids), H).float() * 2


def test_chains_take_the_feature_at_t_the_embedding_at_t_plus_1_and_labels_from_t_plus_2():
    index = torch.arange(H)
    c = chain_examples(FakeRunner(), [([1, 2], [3, 4, 5])], index, depth=2)
    # prompt [1, 2], answer [3, 4, 5]: t = 1, 2 (the prompt's last position, then the first answer position)
    assert c.features[c.rows].argmax(-1).tolist() == [2, 3] and c.first_embedding.argmax(-1).tolist() == [3, 4]
    assert c.labels.tolist() == [[4, 5], [5, -1]]  # past the answer's end: -1
    assert c.features[c.rows + 1].argmax(-1).tolist() == [3, 4]  # the target's feature at t + 1 (a fit's target)
    index[5] = -1  # outside the map
    assert chain_examples(FakeRunner(), [([1, 2], [3, 4, 5])], index, 1).labels.tolist() == [[4], [-1]]
    # two samples: rows index the concatenated features, each sample's own
    c = chain_examples(FakeRunner(), [([1, 2], [3, 4, 5]), ([6], [7, 0])], torch.arange(H), 1)
    assert c.features[c.rows].argmax(-1).tolist() == [2, 3, 6] and c.labels[:, 0].tolist() == [4, 5, 0]


def test_features_from_several_layers_come_first_and_the_last_layers_last():
    c = chain_examples(FakeRunner(), [([1, 2], [3, 4, 5])], torch.arange(H), 1, layers=(0, 3))
    blocks = c.features[c.rows].reshape(2, 3, H).argmax(-1)  # (start, block)
    assert blocks.tolist() == [[3, 6, 2], [4, 7, 3]]  # layer 0: token + 1, layer 3: token + 4, then the last
    assert c.blocks([1, 2], H).features[c.rows].reshape(2, 2, H).argmax(-1).tolist() == [[6, 2], [7, 3]]


def rule_chains(a: torch.Tensor, b: torch.Tensor, labels: torch.Tensor, features=None) -> Chains:
    """One start per row: feature a, first embedding b, labels (N, D)."""
    feats = torch.nn.functional.one_hot(a, H).float() if features is None else features
    return Chains(feats, torch.arange(len(a)), torch.nn.functional.one_hot(b, H).float(), labels)


def test_the_head_learns_a_rule_of_feature_and_embedding():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(0, H, (512,), generator=g), torch.randint(0, H, (512,), generator=g)
    data = rule_chains(a, b, ((a + b) % H)[:, None])
    torch.manual_seed(0)
    head = FeatureHead(H, 64, torch.randn(H, H))
    embeddings = torch.eye(H)
    before = head_agreement(head, data, embeddings)
    losses = train_head(head, data, embeddings, epochs=60, lr=3e-3, batch=64)
    assert losses[-1] < losses[0] and head_agreement(head, data, embeddings) > max(0.9, before + 0.5)


def test_the_training_time_test_trains_the_proposals_that_read_the_heads_own_features():
    """A chain rule: proposal d is (token + d + 1) % H, where the step count is only in the feature the head passes
    itself. A head trained one step deep never sees its own features; trained three deep, its later proposals hit."""
    from osd_bench.feature_head import head_chains

    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, H, (512,), generator=g)
    labels = torch.stack([(a + d + 1) % H for d in range(3)], dim=1)
    # the target's feature and the first embedding are one-hot of a; each later embedding is the previous label's
    data = rule_chains(a, a, labels)

    def later_hits(steps):
        torch.manual_seed(0)
        head = FeatureHead(H, 64, torch.randn(H, H))
        train_head(head, data, torch.eye(H), epochs=80, lr=3e-3, batch=64, steps=steps)
        return head_chains(head, data, torch.eye(H), 3)[:, 1:].float().mean().item()

    deep = later_hits(3)
    assert deep > 0.9 and deep > later_hits(1) + 0.3


def test_a_chain_is_trained_only_while_its_labels_are_in_the_map():
    from osd_bench.feature_head import unrolled_loss

    torch.manual_seed(0)
    head = FeatureHead(H, 16, torch.randn(H, H))
    a = torch.arange(4)
    dead = rule_chains(a, a, torch.tensor([[1, -1, 3]] * 4))
    alive = rule_chains(a, a, torch.tensor([[1, 2, 3]] * 4))
    j = torch.arange(4)
    one = unrolled_loss(head, dead, torch.eye(H), j, 1)
    assert torch.allclose(unrolled_loss(head, dead, torch.eye(H), j, 3), one)  # step 1 out of the map: chain ends
    assert unrolled_loss(head, alive, torch.eye(H), j, 3) > one


class Oracle(torch.nn.Module):
    """A draft that predicts seq[i + 1] exactly except for token 5."""

    def __init__(self, seq):
        super().__init__()
        self.seq = seq

    def forward(self, ids):
        nxt = torch.tensor(self.seq[1 : ids.shape[1] + 1])
        logits = torch.nn.functional.one_hot(torch.where(nxt == 5, 0, nxt), H).float()[None]
        return type("O", (), {"logits": logits})


def draft_first_hits(draft, samples) -> list[bool]:
    """The draft's first proposal from every start: the first column of its chains."""
    return draft_chains(draft, samples, torch.arange(H), 1)[:, 0].tolist()


def test_the_draft_is_scored_at_the_same_positions():
    seq = [1, 2, 3, 4, 5]
    assert agreement(draft_first_hits(Oracle(seq), [([1, 2], [3, 4, 5])])) == 0.5  # 4 right, 5 wrong
    assert agreement([]) == 0.0  # no held-out position: 0, not a division by zero
    # per position, in the order `examples` makes them (a sample with no position adds none), so the head's and
    # the draft's hits pair up for the sign test
    samples = [([1, 2], [3, 4, 5]), ([1], [2])]
    hits = draft_first_hits(Oracle(seq), samples)
    assert hits == [True, False] and len(hits) == len(chain_examples(FakeRunner(), samples, torch.arange(H), 1).labels)


def test_sources_name_their_split_and_slice_and_a_held_out_slice_may_not_meet_a_training_one():
    import pytest

    from osd_bench.feature_head import check_disjoint, source_slices
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


def test_the_feature_fit_pulls_the_predicted_feature_to_the_targets_next_one():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, H, (256,), generator=g)
    nexts = torch.nn.functional.one_hot((a + 3) % H, H).float() * H ** 0.5  # RMS 1, as a normed feature
    # rows 2n: the feature at t; rows 2n + 1: the target's at t + 1, which the predicted feature is fitted to
    features = torch.stack([torch.nn.functional.one_hot(a, H).float(), nexts], dim=1).reshape(512, H)
    data = Chains(features, torch.arange(0, 512, 2), torch.zeros(256, H), a[:, None])

    def feature_error(weight):
        torch.manual_seed(0)
        head = FeatureHead(H, 64, torch.randn(H, H))
        train_head(head, data, torch.eye(H), epochs=40, lr=3e-3, batch=64, feature_weight=weight)
        with torch.no_grad():
            return float((head.step(features[data.rows], data.first_embedding)[1] - nexts).abs().mean())

    assert feature_error(10.0) < 0.5 * feature_error(0.0) and feature_error(1.0) < 0.7 * feature_error(0.0)


class StubHead:
    """Proposes (the fed token + the fed feature's argmax) % H and predicts the feature one-hot of the proposal, so a
    chain's later proposals show what it was fed."""

    def first_feature(self, feature):
        return feature

    def step(self, feature, embedding):
        guess = (embedding.argmax(-1) + feature.argmax(-1)) % H
        return torch.nn.functional.one_hot(guess, H).float(), torch.nn.functional.one_hot(guess, H).float()


def stub_chain_hits(samples, index, vocab_ids, depth):
    from osd_bench.feature_head import head_chains

    runner = FakeRunner()
    chains = chain_examples(runner, samples, index, depth)
    return head_chains(StubHead(), chains, runner.embed(vocab_ids.tolist()), depth)


def test_the_head_chain_reads_its_own_predicted_feature_and_proposed_token():
    # start t = 0 (prompt [1]): proposal 0 = (token 2 + feature of 1) = 3, then (3 + 3) = 6, then (6 + 6) % 8 = 4
    index = torch.arange(H)
    hits = stub_chain_hits([([1], [2, 3, 6, 4])], index, index, 3)
    assert hits[0].tolist() == [True, True, True]
    # starts t = 1 and 2 run off the answer's end: proposals past it miss
    assert hits[1].tolist()[2] is False and hits[2].tolist()[1:] == [False, False]
    # a chain fed the target's token instead of its own would propose (3 + 3) only by luck: break the answer at 6
    hits = stub_chain_hits([([1], [2, 3, 5, 4])], index, index, 3)
    assert hits[0].tolist() == [True, False, True]  # proposal 2 reads its own 6, not the target's 5: (6 + 6) % 8 = 4
    # the map: a proposal is map row r, i.e. target token vocab_ids[r]; its embedding is that token's
    vocab_ids = (torch.arange(H) + 1) % H
    index = torch.empty(H, dtype=torch.long)
    index[vocab_ids] = torch.arange(H)
    hits = stub_chain_hits([([1], [2, 4, 0])], index, vocab_ids, 2)
    # proposal 0: row (token 2 + feature 1) = 3, i.e. token 4 (a hit); proposal 1 reads the embedding of token 4 (not
    # of row 3) and its predicted feature, one-hot of row 3: row (4 + 3) = 7, i.e. token 0 (a hit)
    assert hits[0].tolist() == [True, True]


def test_draft_chains_count_teacher_forced_hits_from_each_start():
    import pytest

    from osd_bench.feature_head import accepted_by_depth, leading_hits, paired_mean_difference

    seq = [1, 2, 3, 4, 5, 6]
    samples = [([1, 2], [3, 4, 5, 6])]
    chains = draft_chains(Oracle(seq), samples, torch.arange(H), 3)
    # starts t = 1, 2, 3 propose seq[3..], seq[4..], seq[5..]: 4 hit, 5 missed, 6 hit, past the end missed
    assert chains.tolist() == [[True, False, True], [False, True, False], [True, False, False]]
    assert chains[:, 0].tolist() == draft_first_hits(Oracle(seq), samples)  # a longer chain keeps the first column
    assert leading_hits(chains).tolist() == [1, 0, 1]
    from osd_bench.feature_head import head_then_draft

    head = torch.tensor([[False, True, True], [True, False, False], [True, True, True]])
    mixed = head_then_draft(head, chains)  # the head's first column, the draft's others
    assert mixed.tolist() == [[False, False, True], [True, True, False], [True, False, False]]
    assert leading_hits(mixed).tolist() == [0, 2, 1]
    assert accepted_by_depth(chains) == pytest.approx([2 / 3, 2 / 3, 2 / 3])
    assert accepted_by_depth(torch.tensor([[True, True], [True, False]])) == [1.0, 1.5]
    d = paired_mean_difference(torch.tensor([1, 0, 1, 2]), torch.tensor([2, 1, 1, 3]))
    assert d["mean_difference"] == 0.75 and d["z"] > 0 and d["n"] == 4
    assert paired_mean_difference(torch.tensor([1, 1]), torch.tensor([2, 2]))["z"] == 0.0  # no spread: no z


def test_arms_parse_and_bad_ones_are_refused():
    import pytest

    from osd.errors import InvalidArgument
    from osd_bench.feature_head_run import arm_name, parse_arms

    assert parse_arms("1, 3,3@2+14+25") == [(1, ()), (3, ()), (3, (2, 14, 25))]
    assert arm_name(3, (2, 14)) == "3 deep, layers 2+14 + last" and arm_name(1, ()) == "1 deep"
    for bad in ("", "0", "x", "3@a", "2@-1"):
        with pytest.raises(InvalidArgument):
            parse_arms(bad)


def test_a_data_cache_serves_a_configuration_with_fewer_layers_and_no_other(tmp_path):
    import json

    import pytest

    from osd_bench.feature_head_run import _data

    cache = tmp_path / "data.pt"
    config = ["bundled:t", [["code", "train", 0, 2]], [["code", "test", 0, 1]], 8, 4]
    torch.save({"key": json.dumps(config), "layers": [2, 14], "data": ("tr", "ho", "c1", "c2", 5.0)}, cache)
    args = dict(runner=None, tokenizer=None, target="bundled:t", train_slices=[("code", "train", 0, 2)],
                heldout_slices=[("code", "test", 0, 1)], max_new_tokens=8, index=None, depth=4, cache=str(cache),
                progress=None)
    assert _data(layers=(), **args) == ((2, 14), "tr", "ho", "c1", "c2", 5.0)  # the cached layers, read
    assert _data(layers=(14,), **args)[0] == (2, 14)
    with pytest.raises(AttributeError):  # a layer not cached: computed again (here: no runner to do it with)
        _data(layers=(3,), **args)
    with pytest.raises(AttributeError):  # another depth: computed again
        _data(layers=(), **{**args, "depth": 3})
