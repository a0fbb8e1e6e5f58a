"""vocab_swap: the learner swaps a derived draft's map toward the tokens its traffic's target emits (learn/vocab.py);
a rejected or failed update undoes the swap; a checkpoint brings the swapped map back."""
import pytest
import torch
from conftest import EOS, VOCAB, tiny_qwen2

import osd.learn.online as online
from osd.learn.online import LearnConfig, OnlineLearner
from osd.learn.vocab import TokenCounts, choose_swap, special_ids_of, swap_head, undo
from osd.models.derived import base_head_rows, derive_model
from osd.models.vocab_map import vocab_ids_of
from osd.schedule.records import StepRecord

MAP = torch.tensor(sorted({0, EOS} | set(range(2, 40))))  # ids 40-47 are off the map
OFF = 45  # the token the traffic's target keeps emitting


def derived(seed=1, tied=True):
    return derive_model(tiny_qwen2(seed=seed, layers=2, tied=tied), [0, 1], MAP.clone())


def test_choose_swap_pairs_the_most_counted_off_the_map_with_the_least_counted_on_it():
    counts = torch.zeros(VOCAB)
    counts[[45, 41, 43]] = torch.tensor([9.0, 5.0, 1.0])  # off the map: 45, then 41 (43 under min_count)
    counts[MAP] = 3.0
    counts[[38, 39]] = 0.0  # on the map, never counted: dropped first, the higher id first
    counts[EOS] = 0.0  # ... but EOS is kept
    add, drop = choose_swap(counts, MAP, keep=[EOS, 0], max_swap=8, min_count=2.0)
    assert add.tolist() == [45, 41] and drop.tolist() == [39, 38]
    add, drop = choose_swap(counts, MAP, keep=[EOS, 0], max_swap=1, min_count=2.0)
    assert add.tolist() == [45] and drop.tolist() == [39]
    counts[MAP] = 6.0  # now every id on the map but 2 is counted more than 41 (5): 45 replaces 2, 41 replaces none
    counts[2] = 3.0
    add, drop = choose_swap(counts, MAP, keep=[EOS, 0], max_swap=8, min_count=2.0)
    assert add.tolist() == [45] and drop.tolist() == [2]
    assert [t.tolist() for t in choose_swap(counts, MAP, [EOS], max_swap=0, min_count=2.0)] == [[], []]


def test_a_swap_never_drops_the_config_s_eos_bos_or_pad():
    assert special_ids_of(derived().config) == [0, EOS]  # eos 1, pad 0, no bos


def test_token_counts_count_and_age():
    counts = TokenCounts(VOCAB, decay=0.5)
    counts.add(torch.tensor([[3, 3], [5, VOCAB + 7]]))  # an id past the vocabulary is ignored
    counts.age()
    assert counts.counts[3] == 1.0 and counts.counts[5] == 0.5 and counts.counts.sum() == 1.5


def test_swap_head_keeps_kept_rows_starts_new_ones_from_the_embedding_and_undoes():
    draft = derived()
    assert base_head_rows(draft) is not None and base_head_rows(derived(tied=False)) is None
    head_before = draft.lm_head.weight.clone()
    ids = torch.tensor([[5, 9, 45, 12, 41]])
    logits_before = draft(ids).logits
    state = swap_head(draft, torch.tensor([45, 41]), torch.tensor([38, 39]))
    new_map = vocab_ids_of(draft)
    assert new_map.tolist() == sorted(set(MAP.tolist()) - {38, 39} | {41, 45})  # sorted, same size
    assert draft.lm_head.weight.shape == head_before.shape and not draft.lm_head.weight.requires_grad
    row = {int(t): i for i, t in enumerate(new_map)}
    old_row = {int(t): i for i, t in enumerate(MAP)}
    for t in (5, 12, EOS):
        assert torch.equal(draft.lm_head.weight[row[t]], head_before[old_row[t]])
    for t in (41, 45):
        assert torch.equal(draft.lm_head.weight[row[t]], draft.model.embed_tokens.weight[t])
    logits_after = draft(ids).logits
    assert torch.allclose(logits_after[..., row[5]], logits_before[..., old_row[5]])
    undo(draft, state)
    assert torch.equal(vocab_ids_of(draft), MAP) and torch.equal(draft.lm_head.weight, head_before)
    assert swap_head(draft, torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long)) is None


def test_a_copy_sharing_the_head_keeps_it():
    """A replay's never-trained control shares the frozen head with the learner's copy (frozen_trunk_copy)."""
    from osd_bench.baselines import frozen_trunk_copy

    control = derived()
    learner_copy = frozen_trunk_copy(control, 1)
    assert learner_copy.lm_head is control.lm_head
    head_before = control.lm_head.weight.clone()
    swap_head(learner_copy, torch.tensor([45]), torch.tensor([39]))
    assert torch.equal(control.lm_head.weight, head_before) and torch.equal(vocab_ids_of(control), MAP)
    assert OFF in vocab_ids_of(learner_copy).tolist()


def step(request_id: str, position: int, token: int = OFF) -> StepRecord:
    """A step where the target's top token at both rows is `token` (the draft proposed 7; rejected)."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(position))
    logits[:, token] += 20.0
    return StepRecord(request_id, ("draft", 0), list(range(2, position + 2)), [7], 0, token, logits, None, [], 0.0,
                      0.0, 0.0)


def learner(draft, **cfg) -> OnlineLearner:
    published = []
    learn = OnlineLearner(draft, lambda master, version=None: published.append(vocab_ids_of(master)) or
                          type("Snap", (), {"version": len(published)})(),
                          LearnConfig(**{"mode": "all", "train_layers": 1, "vocab_swap": 4, "vocab_swap_min_count": 2.0,
                                         "every_requests": 0, **cfg}))
    learn.published = published
    return learn


def feed(learn: OnlineLearner, requests: int = 10) -> None:
    for r in range(requests):
        for position in range(4, 8):
            learn.observe(step(f"req-{r}", position))


def test_an_update_swaps_the_token_the_target_emits_into_the_map_and_publishes_it():
    learn = learner(derived(), guard=False)
    feed(learn)
    report = learn.update()
    assert report["published"] and report["vocab_swapped"] == 1  # 45 alone was counted (>= 2)
    assert OFF in vocab_ids_of(learn.master).tolist() and OFF in learn.published[-1].tolist()
    assert len(vocab_ids_of(learn.master)) == len(MAP) and learn.counters["vocab_swapped"] == 1
    assert "vocab_swapped" not in learn.update()  # nothing more to swap in


def test_a_rejected_update_undoes_the_swap(monkeypatch):
    learn = learner(derived(), drift_guard=False)
    feed(learn)
    monkeypatch.setattr(online, "is_worse", lambda *a, **k: True)
    head = learn.master.lm_head.weight.clone()
    report = learn.update()
    assert not report["published"] and report["rejected_because"] == "guard" and report["vocab_swap_undone"] == 1
    assert "vocab_swapped" not in report
    assert torch.equal(vocab_ids_of(learn.master), MAP) and torch.equal(learn.master.lm_head.weight, head)
    assert learn.counters["vocab_swapped"] == 0 and learn.published == []


def test_a_failed_update_undoes_the_swap(monkeypatch):
    learn = learner(derived(), guard=False)
    feed(learn)
    monkeypatch.setattr(learn, "_accumulate_gradients", lambda batch: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError):
        learn.update()
    assert torch.equal(vocab_ids_of(learn.master), MAP) and learn.counters["update_errors"] == 1


def test_a_checkpoint_brings_the_swapped_map_and_head_back(tmp_path):
    learn = learner(derived(), guard=False, checkpoint_dir=str(tmp_path / "ckpt"))
    feed(learn)
    learn.update()
    learn.save()
    swapped_map, swapped_head = vocab_ids_of(learn.master), learn.master.lm_head.weight.clone()
    fresh = learner(derived(), guard=False, checkpoint_dir=str(tmp_path / "ckpt"))
    assert torch.equal(vocab_ids_of(fresh.master), MAP)
    assert fresh.resume()
    assert torch.equal(vocab_ids_of(fresh.master), swapped_map) and torch.equal(fresh.master.lm_head.weight, swapped_head)
    assert fresh.published[-1].tolist() == swapped_map.tolist()


def test_off_or_without_a_row_to_start_from_the_map_stays():
    for learn in (learner(derived(), guard=False, vocab_swap=0), learner(derived(tied=False), guard=False)):
        feed(learn)
        assert learn.update()["published"] and torch.equal(vocab_ids_of(learn.master), MAP)
