"""Where each row of a token-tree feed sits: its RoPE position, its cache index and the keys it attends to.

A tree feed is a trunk (the tokens the cache lacks, a chain: in decoding, the pending token) followed by the tree's
nodes (propose/tree.py). Trunk row i is an ordinary row (position = cache index = length + i, attends to 0..itself).
Node j at depth d sits at RoPE position length + trunk + d, is written at cache index length + trunk + j (its place
in the feed) and attends to the committed prefix 0..length + trunk - 1, then to its ancestors and itself in path
order: the keys its path fed as a chain would see, in the same order, so its logits are bitwise the chain's
(the glue's `attention_at`). After verification `accepted_moves` says which cache rows to copy so that the cache
holds the accepted path where a chain would have written it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TreeRows:
    pos: torch.Tensor  # (M,) RoPE positions
    at: torch.Tensor  # (M,) cache indices written
    prefix: torch.Tensor  # (M,) each row attends to cache 0..prefix - 1 first
    offsets: torch.Tensor  # (M + 1,) then to extra[offsets[r]:offsets[r + 1]]
    extra: torch.Tensor  # (N,)


def tree_rows(length: int, trunk: int, parents: list[int]) -> TreeRows:
    """length: tokens cached before the feed; trunk >= 1 chain rows, then one row per node (parents[j] < j, -1 =
    the last trunk row)."""
    if trunk < 1:
        raise ValueError("a tree feed needs at least one trunk row (the tree's root)")
    base = length + trunk  # cache index of node 0; also the committed prefix every node sees
    pos, at, prefix, extra, offsets = [], [], [], [], [0]
    for i in range(trunk):
        pos.append(length + i)
        at.append(length + i)
        prefix.append(length + i + 1)
        offsets.append(len(extra))
    paths: list[list[int]] = []
    for j, parent in enumerate(parents):
        if not -1 <= parent < j:
            raise ValueError(f"node {j}'s parent {parent} must be -1 or an earlier node")
        path = (paths[parent] if parent >= 0 else []) + [base + j]
        paths.append(path)
        pos.append(base + len(path) - 1)
        at.append(base + j)
        prefix.append(base)
        extra += path
        offsets.append(len(extra))
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return TreeRows(as_long(pos), as_long(at), as_long(prefix), as_long(offsets), as_long(extra))


def accepted_moves(base: int, path: list[int]) -> list[tuple[int, int]]:
    """(from, to) cache indices that put the accepted nodes `path` (root's child first) where a chain writes them,
    `base` being node 0's cache index (length + trunk): node j at depth d moves from base + j to base + d. Ascending:
    a source is never overwritten before it is read (j >= d for every node, parents come first)."""
    return [(base + j, base + d) for d, j in enumerate(path) if j != d]
