"""Feature-head proposer: chains from the target's own feature (EAGLE family; the head: models/feature_head.py).

After each verification the scheduler hands every source that `reads_target_features` the target's feature at the
row that emitted the sequence's last token (`observe_feature(t, feature)`: the LM head's input at position t, whose
logits chose the token now at t + 1, the one not yet fed). A proposal then reads that feature and the embedding of
the token at t + 1, and each further token of the chain reads the feature the head predicted one step before and the
embedding of the token it proposed there. No KV cache, no prompt to feed, nothing to catch up: a proposal costs the
head's MLP once per token (int8, ~1.1 ms against the cheap draft's 1.8 ms on the AMD Zen 4 machine,
`benchmarks/drafts/feature-head-cost.json`).

The head is published in the draft registry like a draft's serving copy (its int8 copy, its vocabulary map, a
version); `begin` takes the latest snapshot, once per request. Sampling: the head's q is the softmax of its logits
over the map, warped as the target's (zero outside the map), so verification stays lossless as for any draft.
Limitations: with no feature for the sequence's current position (its first step, before any verification), it
proposes nothing; it reads the target's last layer only; only osd's Q4 target hands back features (models/slots.py).
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from osd.config import SamplingConfig
from osd.drafts import DraftRegistry, weights_fingerprint
from osd.models.vocab_map import expand_logits, target_to_draft
from osd.propose.base import Proposal
from osd.verify.sampling import sample_from, warp


class FeatureHeadProposer:
    reads_target_features = True  # the scheduler calls observe_feature after each verification

    def __init__(self, registry: DraftRegistry, name: str, embed: Callable[[list[int]], torch.Tensor],
                 vocab_size: int, _table: dict | None = None):
        """embed: target ids -> (n, H) the target's input embeddings (the Q4 runner's `embed`)."""
        self.registry, self.name, self.embed, self.vocab_size = registry, name, embed, vocab_size
        self.version, self.head, self.vocab_ids = -1, None, None
        self.position, self.feature = -1, None  # the target's feature (H,) at position `position`
        self._checksum = None
        # the map's embeddings (M, H), shared with the forks: a proposal past the first reads a map row's embedding
        # (dequantizing it from the GGUF per token: 1.69 ms a proposed token, read from here: 1.22 ms; AMD Zen 4)
        self._table = _table if _table is not None else {"vocab_ids": None, "embeddings": None, "rows": None}

    def fork(self) -> "FeatureHeadProposer":
        return FeatureHeadProposer(self.registry, self.name, self.embed, self.vocab_size, self._table)

    def begin(self, prompt_ids: list[int], prefill: bool = True) -> None:
        """Take the head's latest snapshot; the request's features come from its own verification steps."""
        snap = self.registry.get(self.name)
        if snap.model is not self.head:
            self.head, self.vocab_ids, self.version, self._checksum = snap.model, snap.vocab_ids, snap.version, None
        if self._table["vocab_ids"] is not self.vocab_ids:
            self._table.update(vocab_ids=self.vocab_ids, embeddings=self.embed(self.vocab_ids.tolist()),
                               rows=target_to_draft(self.vocab_ids, self.vocab_size))
        self.position, self.feature = -1, None

    def observe_feature(self, position: int, feature: torch.Tensor) -> None:
        """feature (H,): the target's LM-head input at `position` of the sequence (the token after it is committed)."""
        self.position, self.feature = position, feature

    @property
    def width(self) -> int:
        return self.head.hidden

    @torch.inference_mode()
    def propose(self, tokens: list[int], k: int, sampling: SamplingConfig, generator=None) -> Proposal:
        if self.feature is None or self.position != len(tokens) - 2 or k <= 0:
            return Proposal([])
        t0 = time.perf_counter()
        feature, embedding = self.feature, self.embed(tokens[-1:])[0]  # (H,), (H,): the pending token may be off the map
        table = self._table["embeddings"]  # (M, H)
        proposed, probs, timings = [], [], []
        for _ in range(k):
            logits, feature = self.head.step(feature, embedding)  # (M,), (H,)
            if sampling.greedy:
                row = int(logits.argmax())
            else:
                q = warp(expand_logits(logits[None], self.vocab_ids, self.vocab_size)[0], sampling)  # (V,): 0 off the map
                token = sample_from(q, generator)
                row = int(self._table["rows"][token])
                probs.append(q)
            proposed.append(int(self.vocab_ids[row]))
            embedding = table[row]
            timings.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
        return Proposal(proposed, torch.stack(probs) if probs else None, single_token_seconds=timings,
                        weights=self.fingerprint())

    def fingerprint(self) -> str:
        """'<name>@v<version>:<checksum of the head's weights>' (the checksum taken once per snapshot)."""
        if self._checksum is None:
            self._checksum = weights_fingerprint(self.head)
        return f"{self.name}@v{self.version}:{self._checksum}"

    def rollback(self, length: int) -> None:
        """A feature stays valid while the token after its position is kept."""
        if self.position >= length - 1:
            self.position, self.feature = -1, None
