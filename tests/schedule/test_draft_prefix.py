"""The draft's prompt-prefix reuse (propose/draft_model.py `DraftModelProposer._start_from`): a new prompt starts from
the longest prefix that this draft proposer or one of its forks (the drafts of the scheduler's other slots) has cached
under the same snapshot, in place or copied (`copy_prefix_from`); only the rest is fed.

On the compiled draft runners (the int8 copy's glue runner, the Q4 copy's Q4 runner) every row is computed alone, so
reused keys/values are bitwise what feeding would write: the proposals after reuse are those of a proposer that fed the
whole prompt. A `held` list out of step with the cache (a missed rollback, a proposal not noted) or keys/values reused
from another snapshot would show as different proposals or as reuse where none may happen.
"""
from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, require_glue, require_q4, tiny_qwen2

from osd.config import SamplingConfig
from osd.drafts import DraftRegistry
from osd.errors import InvalidArgument
from osd.propose import DraftModelProposer
from osd.propose.draft_model import propose_together

GREEDY = SamplingConfig(max_new_tokens=8)
HEAD = [7, 8, 9, 10, 11, 12, 13, 14]  # a shared head, as a chat template's system prompt gives every request


def _serving(copy: str, seed: int = 1):
    from osd.models.serving_draft import make_serving_draft

    require_glue()
    if copy == "q4":
        require_q4()
    return make_serving_draft(tiny_qwen2(seed=seed, hidden=64), copy)[0]


def _proposer(serving) -> tuple[DraftModelProposer, DraftRegistry]:
    registry = DraftRegistry()
    registry.publish("draft", serving)
    return DraftModelProposer(registry, "draft", VOCAB), registry


def _fresh_proposal(serving, tokens: list[int], k: int = 5) -> list[int]:
    """What a proposer that fed the whole prompt (nothing cached before) proposes after `tokens`."""
    p, _ = _proposer(serving)
    p.begin(tokens)
    return p.propose(tokens, k, GREEDY).tokens


@pytest.fixture(scope="module", params=["int8", "q4"])
def serving(request):
    return _serving(request.param)


def test_a_fork_starts_from_the_prefix_another_fork_cached_and_proposes_as_if_it_had_fed_it(serving):
    first, _ = _proposer(serving)
    second = first.fork()
    a = HEAD + [20, 21, 22, 23]
    first.begin(a)
    picked = first.propose(a, 4, GREEDY).tokens
    b = HEAD + [30, 31]
    second.begin(b, prefill=False)  # lazy: only what it reused is cached
    assert second.runner.length == len(HEAD) and second.reused_rows == len(HEAD)
    assert second.lag(b) == 1  # the first proposal feeds the one token no cache held
    assert second.propose(b, 5, GREEDY).tokens == _fresh_proposal(serving, b)
    assert first.held == a + picked[:3] and first.runner.length == len(a) + 3  # the donor's cache as it was


def test_a_proposer_reuses_its_own_cache_in_place_up_to_where_the_new_prompt_differs(serving):
    p, _ = _proposer(serving)
    a = HEAD + [20, 21, 22]
    p.begin(a)
    proposed = p.propose(a, 4, GREEDY).tokens
    p.rollback(len(a) + 1)  # the target accepted the first proposal
    assert p.held == a + proposed[:1]
    turn = a + proposed[:1] + [40, 41]  # a conversation's next turn: the earlier one and more
    p.begin(turn)
    assert p.reused_rows == len(a) + 1 and p.runner.length == len(turn) - 1
    assert p.propose(turn, 5, GREEDY).tokens == _fresh_proposal(serving, turn)


def test_joint_proposals_keep_every_forks_cached_tokens_for_later_reuse(serving):
    first, _ = _proposer(serving)
    second = first.fork()
    a, b = HEAD + [20, 21], [40, 41, 42]
    first.begin(a), second.begin(b)
    proposals = propose_together([first, second], [a, b], [3, 2], [GREEDY, GREEDY], [None, None])
    assert first.held == a + proposals[0].tokens[:2] and second.held == b + proposals[1].tokens[:1]
    third = first.fork()
    c = b + proposals[1].tokens[:1] + [30]
    third.begin(c)
    assert third.reused_rows == len(b) + 1
    assert third.propose(c, 5, GREEDY).tokens == _fresh_proposal(serving, c)


def test_nothing_cached_under_an_older_snapshot_is_reused():
    serving = _serving("int8")
    first, registry = _proposer(serving)
    second = first.fork()
    first.begin(HEAD + [20])
    registry.publish("draft", _serving("int8", seed=2))  # new weights: keys/values cached before are stale
    second.begin(HEAD + [21], prefill=False)
    assert second.reused_rows == 0 and second.runner.length == 0
    first.begin(HEAD + [22], prefill=False)  # its own cache too: the new snapshot's runner starts empty
    assert first.reused_rows == 0 and first.runner.length == 0


def test_copy_prefix_from_refuses_what_it_cannot_copy():
    serving = _serving("int8")
    first, _ = _proposer(serving)
    second = first.fork()
    first.begin(HEAD + [20])
    second.begin([1, 2])
    with pytest.raises(InvalidArgument):
        second.runner.copy_prefix_from(first.runner, first.runner.length + 1)  # more than it holds
    with pytest.raises(InvalidArgument):
        first.runner.copy_prefix_from(first.runner, 2)  # itself
    second.runner.copy_prefix_from(first.runner, 3)
    assert second.runner.length == 3
    ks = [torch.equal(a[0][:, :3], b[0][:, :3]) for a, b in zip(first.runner._kv, second.runner._kv)]
    assert all(ks)
