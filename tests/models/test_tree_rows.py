"""Token trees on the Q4 kernel (models/tree_rows.py, Q4Slots tree feeds): every node's logits are bitwise those of
its path fed as a chain, and keeping an accepted path leaves the cache bitwise as feeding that path does."""
from __future__ import annotations

import pytest
from conftest import require_module, require_q4
import torch

require_module("llama_cpp")

from osd.models.q4_runner import Q4Runner  # noqa: E402
from osd.models.slots import Feed, Q4Slots  # noqa: E402
from osd.models.tree_rows import accepted_moves, tree_rows  # noqa: E402
from osd.propose.tree import Tree  # noqa: E402
from tests.models.tiny_gguf import PROMPT, tiny  # noqa: E402,F401

require_q4()

SHAPES = {  # parents of the nodes (-1: the root), tokens chosen per node below
    "chain": [-1, 0, 1, 2],
    "star": [-1, -1, -1, -1],
    "two chains": [-1, 0, 1, -1, 3, 4],
    "bushy": [-1, -1, 0, 0, 1, 2, 2, 5],
    "deep right": [-1, -1, 1, 2, 3, -1, 5],
}


@pytest.fixture(scope="module")
def runner(tiny):
    return Q4Runner(tiny[0], n_ctx=256)


def node_tokens(parents: list[int], seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (len(parents),), generator=g).tolist()


def chain_logits(runner, prefix: list[int], path_tokens: list[int]) -> torch.Tensor:
    """(1 + len(path), V): the logits of prefix's last token and each path token, fed as one chain."""
    runner.reset()
    runner.feed(prefix[:-1], n_logits=0)
    return runner.feed([prefix[-1]] + path_tokens, n_logits=1 + len(path_tokens))


def cache_rows(slots: Q4Slots, slot: int, n: int) -> list[torch.Tensor]:
    return [t[:, :n].clone() for kv in slots._caches[slot] for t in kv]


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("exclusive", [False, True])
def test_each_node_gets_the_logits_of_its_path_fed_alone(runner, name, exclusive):
    parents = SHAPES[name]
    tokens = node_tokens(parents, seed=len(name))
    tree = Tree(tokens, parents)
    prefix = PROMPT[:11]
    slots = Q4Slots(runner, 2 if exclusive else 1, exclusive=exclusive)
    slot = 1 if exclusive else 0
    slots.reset(slot)
    slots.feed([Feed(slot, prefix[:-1], 0)])
    got = slots.feed([Feed(slot, [prefix[-1]] + tokens, 1 + len(tokens), tree=parents)])[0]
    assert got.shape[0] == 1 + len(tokens)
    for j in range(len(tokens)):
        path = tree.path(j)
        want = chain_logits(runner, prefix, [tokens[i] for i in path])
        assert torch.equal(got[1 + j], want[-1]), (name, j, path)
        assert torch.equal(got[0], want[0])


@pytest.mark.parametrize("name", ["bushy", "deep right", "two chains"])
def test_keeping_an_accepted_path_leaves_the_cache_the_chain_leaves(runner, name):
    parents = SHAPES[name]
    tokens = node_tokens(parents, seed=7)
    tree = Tree(tokens, parents)
    prefix = PROMPT[:9]
    deepest = max(range(len(tokens)), key=lambda j: (len(tree.path(j)), j))
    path = tree.path(deepest)
    path_tokens = [tokens[i] for i in path]
    slots = Q4Slots(runner, 2, exclusive=True)
    slots.reset(1)
    slots.feed([Feed(1, prefix[:-1], 0)])
    slots.feed([Feed(1, [prefix[-1]] + tokens, 1 + len(tokens), tree=parents)])
    slots.keep_path(1, len(prefix), path)
    assert slots.length(1) == len(prefix) + len(path)
    chain = Q4Slots(runner, 2, exclusive=True)
    chain.reset(1)
    chain.feed([Feed(1, prefix + path_tokens, 1)])
    for got, want in zip(cache_rows(slots, 1, len(prefix) + len(path)), cache_rows(chain, 1, len(prefix) + len(path))):
        assert torch.equal(got, want)
    # and the next token's logits after it are the chain's
    nxt = [5]
    assert torch.equal(slots.feed([Feed(1, nxt, 1)])[0], chain.feed([Feed(1, nxt, 1)])[0])


def test_a_tree_beside_other_sequences_is_unchanged(runner):
    """A tree feed sharing the pass with a chain feed and a prompt chunk of other slots: bitwise the same rows."""
    parents = SHAPES["bushy"]
    tokens = node_tokens(parents, seed=3)
    prefix = PROMPT[:10]
    alone = Q4Slots(runner, 3, exclusive=True)
    alone.feed([Feed(0, prefix[:-1], 0)])
    want = alone.feed([Feed(0, [prefix[-1]] + tokens, 1 + len(tokens), tree=parents)])[0]
    shared = Q4Slots(runner, 3, exclusive=True)
    shared.feed([Feed(0, prefix[:-1], 0), Feed(1, PROMPT[:5], 0)])
    got = shared.feed([Feed(1, [7, 8, 9], 3), Feed(0, [prefix[-1]] + tokens, 1 + len(tokens), tree=parents),
                       Feed(2, PROMPT[:12], 0)])[1]
    assert torch.equal(got, want)


def test_layout_and_moves():
    rows = tree_rows(length=5, trunk=1, parents=[-1, -1, 0, 2])
    assert rows.pos.tolist() == [5, 6, 6, 7, 8]
    assert rows.at.tolist() == [5, 6, 7, 8, 9]
    assert rows.prefix.tolist() == [6, 6, 6, 6, 6]
    extra = rows.extra.tolist()
    per_row = [extra[a:b] for a, b in zip(rows.offsets.tolist(), rows.offsets.tolist()[1:])]
    assert per_row == [[], [6], [7], [6, 8], [6, 8, 9]]
    assert accepted_moves(6, [0, 2, 3]) == [(8, 7), (9, 8)]
    assert accepted_moves(6, [1]) == [(7, 6)]
    assert accepted_moves(6, [0]) == []
    with pytest.raises(ValueError):
        tree_rows(0, 1, [1])


@pytest.mark.parametrize("exclusive", [False, True])
def test_rollback_keeps_a_prefix_and_never_claims_positions_it_has_not_computed(runner, exclusive):
    """rollback(n) past what a slot holds leaves it as it is (a caller asking for more cannot make unwritten cache
    positions count as fed); rolling back to n and feeding on gives the logits of feeding that prefix fresh."""
    slots = Q4Slots(runner, 2 if exclusive else 1, exclusive=exclusive)
    slot = 1 if exclusive else 0
    slots.reset(slot)
    slots.feed([Feed(slot, PROMPT[:9], 0)])
    slots.rollback(slot, 40)
    assert slots.length(slot) == 9
    slots.rollback(slot, 6)
    assert slots.length(slot) == 6
    got = slots.feed([Feed(slot, [5, 17, 33], 3)])[0]
    assert torch.equal(got, chain_logits(runner, PROMPT[:6] + [5], [17, 33]))
    with pytest.raises(Exception):
        slots.rollback(slot, -1)
