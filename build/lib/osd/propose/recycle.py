"""Token Recycling ("Turning Trash into Treasure", Luo et al. 2024): the target's own top tokens after each token,
kept from verification, proposed again as tree branches (cost ~0, learned from the traffic).

Every row the target verifies (the pending token's, each proposal's, each tree node's, accepted or not) gives the
target's top `width` next tokens after that row's token in that context; the table keeps the latest for each token.
Nothing else writes it: no extra target pass, no prompt rows (they have no logits). `chance(rank)` is the measured
rate at which the table's rank-r entry was the target's next token when it was asked, smoothed by a prior, so the
tree's shape policy (propose/tree.py) weighs recycled branches by what they have delivered on this traffic.
"""
from __future__ import annotations

import torch

PRIOR = (0.30, 0.10, 0.05, 0.03, 0.02, 0.01, 0.01, 0.01)  # rank hit rates assumed before evidence
PRIOR_WEIGHT = 20.0  # the prior is worth this many asks


class RankRates:
    """How often a ranked list of candidates held the target's next token at rank r: hits[r] / asks, smoothed by a
    prior worth PRIOR_WEIGHT asks."""

    def __init__(self, prior: tuple[float, ...], width: int):
        self.prior, self.hits, self.asks = prior, [0] * width, 0

    def chance(self, rank: int) -> float:
        prior = self.prior[rank] if rank < len(self.prior) else self.prior[-1]
        return (self.hits[rank] + PRIOR_WEIGHT * prior) / (self.asks + PRIOR_WEIGHT)

    def observe(self, candidates: list[int], target_token: int) -> None:
        self.asks += 1
        if target_token in candidates[: len(self.hits)]:
            self.hits[candidates.index(target_token)] += 1

    def stats(self) -> dict:
        return {"asks": self.asks, "hit_rate_by_rank": [h / max(self.asks, 1) for h in self.hits]}


class RecycledTable:
    def __init__(self, vocab_size: int, width: int = 4):
        self.width = int(width)
        self.next = torch.full((vocab_size, self.width), -1, dtype=torch.int32)
        self.rates = RankRates(PRIOR, self.width)
        self.rows = 0  # verification rows the table learned from

    @property
    def asks(self) -> int:
        return self.rates.asks

    @property
    def hits(self) -> list[int]:
        return self.rates.hits

    def chance(self, rank: int) -> float:
        return self.rates.chance(rank)

    def candidates(self, token: int) -> list[tuple[int, float]]:
        """[(next token, chance)] after `token`, best first; [] where the target has not been seen after it."""
        return [(t, self.chance(r)) for r, t in enumerate(self.next[token].tolist()) if t >= 0]

    def observe(self, row_tokens: list[int], target_logits: torch.Tensor) -> None:
        """row_tokens[i]: the token at verification row i; target_logits (n, V): the target's logits there. Counts
        how the table's entries did against the target's argmax, then stores the target's top tokens."""
        if not row_tokens:
            return
        top = target_logits.topk(self.width, dim=-1).indices.to(torch.int32)  # (n, width)
        ids = torch.tensor(row_tokens, dtype=torch.long)
        before = self.next[ids]  # (n, width)
        self.rates.asks += int((before[:, 0] >= 0).sum())
        for rank in (before == top[:, :1]).nonzero()[:, 1].tolist():  # the target's argmax among the old entries
            self.rates.hits[rank] += 1
        last = {token: i for i, token in enumerate(row_tokens)}  # a token seen twice: its latest row wins
        self.next[torch.tensor(list(last), dtype=torch.long)] = top[torch.tensor(list(last.values()), dtype=torch.long)]
        self.rows += len(row_tokens)

    def stats(self) -> dict:
        return {"rows": self.rows, **self.rates.stats()}
