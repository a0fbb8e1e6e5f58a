"""Token trees: several candidate continuations verified in one target pass (SpecInfer, Sequoia, Token Recycling).

A `Tree` hangs off the sequence's pending token (the root, not a node): node j has a token and a parent
(`parents[j]` < j; -1 = the root). The target sees the root's row and one row per node, each row attending to the
committed prefix, its ancestors and itself (models/tree_rows.py), so every row's logits are bitwise those of its path
fed as a chain (tests/models/test_tree_rows.py); verification walks down the tree (verify/tree.py: greedy, or
recursive rejection sampling at T > 0, lossless either way).

`grow_tree` is the shape policy, a pure function: a chain proposal (the lookup's or the draft's tokens, each with its
estimated chance of acceptance) plus candidates from the recycled-token table (propose/recycle.py) at every node,
added best-first by the estimated chance that the node is on the accepted path, and cut where the expected tokens per
second of the step, with the measured cost of a pass by rows, is highest (dynamic trees under a row budget).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Tree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # parent node of each node; -1 = the root (the pending token)
    scores: list[float] = field(default_factory=list)  # estimated chance that the node is accepted (path included)
    chain: int = 0  # the first `chain` nodes are the chain proposal, each the child of the one before

    @property
    def size(self) -> int:
        return len(self.tokens)

    def depth(self, node: int) -> int:
        """0 for a child of the root."""
        d = 0
        while self.parents[node] != -1:
            node, d = self.parents[node], d + 1
        return d

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`."""
        out = []
        while node != -1:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def children(self, node: int) -> list[int]:
        return [j for j, p in enumerate(self.parents) if p == node]

    def shape(self) -> tuple[int, ...]:
        """Nodes per depth, e.g. (3, 2, 1): a compact name of the tree's shape for the metrics."""
        counts: dict[int, int] = {}
        for j in range(self.size):
            d = self.depth(j)
            counts[d] = counts.get(d, 0) + 1
        return tuple(counts[d] for d in sorted(counts))


def chain_tree(tokens: list[int], alpha: float = 1.0) -> Tree:
    """A chain as a tree: node d is the child of node d - 1."""
    return Tree(list(tokens), list(range(-1, len(tokens) - 1)), [alpha ** (d + 1) for d in range(len(tokens))],
                chain=len(tokens))


def grow_tree(chain: list[int], chain_alpha: float, candidates: Callable[[int], list[tuple[int, float]]],
              root_token: int, max_nodes: int, step_seconds: Callable[[int], float],
              min_score: float = 0.02, runners_up: list[list[tuple[int, float]]] | None = None) -> Tree:
    """The chain (kept whole: its length was chosen by the source's k policy) plus recycled candidates.

    candidates(token) -> [(next token, chance it is the target's next token)] after `token`, best first.
    runners_up[d]: the draft's next-best tokens where it proposed chain[d], each with the chance that it is the
    target's token given that chain[d] is not; offered beside chain[d] with (1 - chain_alpha) times that chance.
    step_seconds(rows) -> measured seconds of one target pass over `rows` rows (the root's row + nodes).
    Nodes are added best-first by score (a child's score is its parent's times its own chance; a chain node's is
    chain_alpha per depth), never twice the same token under one parent, up to max_nodes; the tree is then cut to
    the prefix of additions that maximises (1 + sum of scores) / step_seconds(1 + nodes): the expected tokens a step
    yields per second. Deterministic (ties broken by insertion order)."""
    tree = chain_tree(chain[:max_nodes], chain_alpha)
    seen = {(p, t) for p, t in zip(tree.parents, tree.tokens)}
    heap: list[tuple[float, int, int, int]] = []  # (-score, order, parent node, token)
    order = 0

    def offer(parent: int, parent_score: float, options: list[tuple[int, float]]) -> None:
        nonlocal order
        for nxt, chance in options:
            score = parent_score * chance
            if score >= min_score and (parent, nxt) not in seen:
                heapq.heappush(heap, (-score, order, parent, nxt))
                order += 1

    for d, options in enumerate((runners_up or [])[: tree.size]):  # beside chain node d, under its parent
        offer(d - 1, tree.scores[d - 1] if d else 1.0, [(t, (1 - chain_alpha) * c) for t, c in options])
    offer(-1, 1.0, candidates(root_token))
    for j in range(tree.size):
        offer(j, tree.scores[j], candidates(tree.tokens[j]))
    fixed = tree.size
    while heap and tree.size < max_nodes:
        neg, _, parent, token = heapq.heappop(heap)
        if (parent, token) in seen:
            continue
        seen.add((parent, token))
        tree.tokens.append(token)
        tree.parents.append(parent)
        tree.scores.append(-neg)
        offer(tree.size - 1, -neg, candidates(token))
    best, best_rate, expected = fixed, None, 1.0 + sum(tree.scores[:fixed])
    for n in range(fixed, tree.size + 1):
        if n > fixed:
            expected += tree.scores[n - 1]
        rate = expected / step_seconds(1 + n)
        if best_rate is None or rate > best_rate:
            best, best_rate = n, rate
    return Tree(tree.tokens[:best], tree.parents[:best], tree.scores[:best], chain=tree.chain)
