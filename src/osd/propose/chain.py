"""Several proposal sources behind one proposer, tried in order: e.g. the n-gram lookup, the feature head, the draft.

The engine asks `sources` itself, each under its own k policy (its own acceptance and cost): a step takes the
first source that finds tokens (alone), or, with company, the first free one that does, else the first with forwards
(schedule/scheduler.py). A source with nothing to say this step (the head before its sequence's first verification,
the lookup without a match) hands the turn on. `name` joins the sources'; `version` is the `versioned` one's (the
feature head's where one serves, else the draft model's: the one a learner publishes to).
"""
from __future__ import annotations

from osd.config import SamplingConfig
from osd.propose.base import Proposal, forkable


class Sources:
    def __init__(self, sources: list, versioned: int = -1):
        """versioned: the index of the source whose version labels the steps (a learner publishes to it)."""
        if not sources:
            raise ValueError("Sources needs at least one source")
        self.sources, self.versioned = list(sources), versioned
        self.name = "+".join(s.name for s in self.sources)

    @property
    def version(self) -> int:
        return self.sources[self.versioned].version

    @property
    def forkable(self) -> bool:
        return all(forkable(s) for s in self.sources)

    def fork(self) -> "Sources":
        return Sources([s.fork() for s in self.sources], self.versioned)

    def begin(self, prompt_ids: list[int], prefill: bool = True) -> None:
        for source in self.sources:
            source.begin(prompt_ids, prefill)

    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig, generator=None) -> Proposal:
        """The first source's proposal that holds tokens, all at the same k (the engine asks each at its own k)."""
        for source in self.sources:
            if (proposal := source.propose(tokens, k, sampling, generator)).k:
                return proposal
        return Proposal([])

    def rollback(self, length: int) -> None:
        for source in self.sources:
            source.rollback(length)

    def observe_request(self, token_ids: list[int]) -> None:
        """A finished request (prompt + output), for the sources that learn from it (the lookup's index)."""
        for source in self.sources:
            if hasattr(source, "observe_request"):
                source.observe_request(token_ids)
