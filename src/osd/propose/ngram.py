"""Drafting from the traffic itself: n-gram lookup over this request and earlier ones (cost ~0).

The longest suffix of the sequence (max_n down to min_n tokens) that occurred before, in this request's
prompt and output or in recent requests' outputs, proposes the tokens that followed it. A proposal is
deterministic, so its draft distribution is one-hot: rejection sampling stays lossless (accept with the
target's probability of the token, else draw from the target with that token removed).
It learns online for free: every finished request's tokens enter the traffic index (`observe_request`).
Served (build.py), the traffic index is a source of its own (`TrafficLookup`), after the request's lookup and before
the draft: its acceptance is measured apart from the request's, and the scheduler lets a free source's proposal go
first only where that source is accepted at least as often as the draft behind it (schedule/scheduler.py
`_outranked`). On chat's varied answers, a match in another request's answer proposed worse than the draft proposal it
displaced: 0.93x live with the index learning (`bench-live-chat300-lookup-load05-il25-zen4.json`).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from osd.config import SamplingConfig
from osd.propose.base import Proposal
from osd.propose.chain import Sources


def ngrams_before(tokens: list[int], i: int, min_n: int, max_n: int):
    """The n-grams (min_n <= n <= max_n) that end right before position i."""
    return (tuple(tokens[i - n : i]) for n in range(min_n, max_n + 1) if i - n >= 0)


def suffixes_longest_first(tokens: list[int], min_n: int, max_n: int):
    """The sequence's last n tokens as tuples, n = max_n (or fewer if shorter) down to min_n."""
    return (tuple(tokens[-n:]) for n in range(min(max_n, len(tokens)), min_n - 1, -1))


class NgramIndex:
    """n-gram (tuple of n ids, min_n <= n <= max_n) -> the position right after its latest occurrence."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.where: dict[tuple[int, ...], int] = {}

    def extend(self, new_tokens: list[int], upto: int | None = None) -> None:
        """Append tokens; index every n-gram whose continuation is known (ends before the last token)."""
        start = len(self.tokens)
        self.tokens += new_tokens
        end = len(self.tokens) if upto is None else upto
        for i in range(max(start, 1), end):  # continuation position i: n-grams ending at i - 1
            for key in ngrams_before(self.tokens, i, self.min_n, self.max_n):
                self.where[key] = i

    def lookup(self, suffix: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest matching suffix, or []."""
        for key in suffixes_longest_first(suffix, self.min_n, self.max_n):
            i = self.where.get(key)
            if i is not None:
                return self.tokens[i : i + k]
        return []


class TrafficIndex:
    """Continuations seen in recent requests: n-gram -> next tokens, least recently written dropped first."""

    def __init__(self, min_n: int, max_n: int, span: int = 16, capacity: int = 200_000):
        self.min_n, self.max_n, self.span, self.capacity = min_n, max_n, span, capacity
        self.table: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def add(self, tokens: list[int]) -> None:
        for i in range(1, len(tokens)):
            follow = tuple(tokens[i : i + self.span])
            for key in ngrams_before(tokens, i, self.min_n, self.max_n):
                self.table[key] = follow
                self.table.move_to_end(key)
        while len(self.table) > self.capacity:
            self.table.popitem(last=False)

    def lookup(self, suffix: list[int], k: int) -> list[int]:
        for key in suffixes_longest_first(suffix, self.min_n, self.max_n):
            follow = self.table.get(key)
            if follow:
                return list(follow[:k])
        return []


def one_hot_rows(tokens: list[int], vocab_size: int) -> torch.Tensor:
    """(k,) ids -> (k, V) one-hot draft distributions of a deterministic proposer."""
    probs = torch.zeros(len(tokens), vocab_size)
    if tokens:
        probs[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return probs


def lookup_proposal(tokens: list[int], vocab_size: int, sampling: SamplingConfig) -> Proposal:
    """A lookup's tokens as a proposal: no draft forwards timed, one-hot draft rows where sampling."""
    return Proposal(tokens, None if sampling.greedy else one_hot_rows(tokens, vocab_size), single_token_seconds=None)


class NgramProposer:
    """Proposes by lookup in this request (prompt + output so far), then in earlier traffic."""

    version = 0

    def __init__(self, vocab_size: int, min_n: int = 2, max_n: int = 4, traffic: bool = True, name: str = "ngram"):
        self.vocab_size, self.min_n, self.max_n, self.name = vocab_size, min_n, max_n, name
        self.request = NgramIndex(min_n, max_n)
        self.traffic = TrafficIndex(min_n, max_n) if traffic else None

    def fork(self) -> "NgramProposer":
        """A proposer for another sequence: its own request index, the same traffic index (shared learning)."""
        twin = NgramProposer(self.vocab_size, self.min_n, self.max_n, traffic=False, name=self.name)
        twin.traffic = self.traffic
        return twin

    def begin(self, prompt_ids: list[int], prefill: bool = True) -> None:
        self.request = NgramIndex(self.min_n, self.max_n)

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig, generator=None) -> Proposal:
        self.request.extend(tokens[len(self.request.tokens) :])
        proposed = self.request.lookup(tokens, k)
        if not proposed and self.traffic is not None:
            proposed = self.traffic.lookup(tokens, k)
        return lookup_proposal(proposed, self.vocab_size, sampling)

    def rollback(self, length: int) -> None:
        """Only committed tokens are indexed: nothing to discard."""

    def observe_request(self, token_ids: list[int]) -> None:
        """Learn continuations from a finished request (prompt + output)."""
        if self.traffic is not None:
            self.traffic.add(token_ids)


class TrafficLookup:
    """Proposes what followed the longest matching suffix in earlier requests only (a shared `TrafficIndex`): the
    traffic as a source of its own, its acceptance measured apart from the request's own lookup (module docstring).
    learns=False (a server that does not learn): the index stays empty, so the source proposes nothing, and the
    engine's sources (and the calibration it measures or reads, one cost per source) are the same either way."""

    version = 0

    def __init__(self, vocab_size: int, min_n: int = 2, max_n: int = 4, index: TrafficIndex | None = None,
                 name: str = "traffic", learns: bool = True):
        self.vocab_size, self.name, self.learns = vocab_size, name, learns
        self.index = index if index is not None else TrafficIndex(min_n, max_n)

    def fork(self) -> "TrafficLookup":
        """Another sequence's: the same index (what one request teaches serves the next)."""
        return TrafficLookup(self.vocab_size, index=self.index, name=self.name, learns=self.learns)

    def begin(self, prompt_ids: list[int], prefill: bool = True) -> None:
        """Nothing per sequence."""

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig, generator=None) -> Proposal:
        return lookup_proposal(self.index.lookup(tokens, k), self.vocab_size, sampling)

    def rollback(self, length: int) -> None:
        """Nothing cached."""

    def observe_request(self, token_ids: list[int]) -> None:
        if self.learns:
            self.index.add(token_ids)


class LookupThenDraft(Sources):
    """The n-gram lookup first (the request's, then the traffic's where given); where it finds nothing, the draft model
    (if any) proposes (propose/chain.py Sources).

    The engine tries `sources` in order, each under its own k policy (lookup proposals cost ~nothing, model
    proposals cost draft forwards). The draft model's cache catches up on the tokens committed without it
    the next time it drafts.
    """

    def __init__(self, lookup: NgramProposer, draft=None, traffic: TrafficLookup | None = None):
        super().__init__([lookup] + ([traffic] if traffic is not None else []) + ([draft] if draft is not None else []))
        self.lookup, self.traffic, self.draft = lookup, traffic, draft

    def fork(self) -> "LookupThenDraft":
        return LookupThenDraft(self.lookup.fork(), self.draft.fork() if self.draft is not None else None,
                               self.traffic.fork() if self.traffic is not None else None)
