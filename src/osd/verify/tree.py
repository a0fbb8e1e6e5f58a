"""Greedy verification of a token tree, a pure function: the longest path the target agrees with."""
from __future__ import annotations

import torch

from osd.propose.tree import Tree


def greedy_tree_verify(target_logits: torch.Tensor, tree: Tree) -> tuple[list[int], int]:
    """target_logits (1 + tree.size, V): row 0 at the root (the pending token), row 1 + j at node j
    -> (accepted nodes, root's child first; the target's next token after them).
    From the root, the target's argmax at the current row is taken; where a child of the current node holds that
    token the walk moves to it, else it stops and that argmax is the next token: exactly the tokens target-only
    greedy decoding emits, as many as the tree holds of them."""
    argmax = target_logits.argmax(dim=-1).tolist()  # first maximum, as torch's greedy everywhere here
    children: dict[int, dict[int, int]] = {}
    for j, (parent, token) in enumerate(zip(tree.parents, tree.tokens)):
        children.setdefault(parent, {}).setdefault(token, j)
    node, path = -1, []
    while True:
        token = argmax[node + 1]
        child = children.get(node, {}).get(token)
        if child is None:
            return path, token
        path.append(child)
        node = child
