"""The feature head's online learner: observe verification -> chains -> train (training-time test) -> guard -> publish.

The head (models/feature_head.py) learns from what serving computes anyway: every StepRecord of a sequence whose
source reads features holds the target's features at the rows it verified (`target_features`: the pending token's and
each accepted proposal's), so by the end of a request the learner holds the target's feature at every position from
the prompt's last token on. A finished request becomes chains (learn/head_chains.py `chains_of_sequence`: from each
position t, the target's tokens at t + 2, t + 3, ...), built on the learner's thread in a turn between serving steps
(`absorb`: the serving thread only queues the finished request's rows); every `holdout_every`-th request is held out,
never trained on, and is the guard's evidence. An update takes `steps_per_update` AdamW steps of EAGLE-3's
training-time test (`unrolled_loss`, chains `depth` deep) on starts drawn from the recent requests, one micro-batch
per chunk of work between the scheduler's steps, within `busy_share` of the busy time (learn/budget.py, as the draft's
learner); then the candidate and the serving head propose greedy chains from the same held-out starts, and the
candidate is published (its int8 copy, a new version: requests admitted from then on use it) unless its accepted
length per start is lower by more than guard_z standard errors (paired). A rejected or failed update puts the weights
and the optimizer's state back (learn/restore.py): a failed update never replaces a working head.
Memory: the head's float weights and Adam's moments (the bundled target's head: 39.3M parameters, ~0.5 GB), a copy
of both during an update, the map's embeddings (16,384 x 1,536 floats, ~0.1 GB) and the kept chains' features.
Limitations: it learns the head only (the draft beside it does not learn in the same server); no checkpoint is
written (a restart serves the --head file again); the held-out set holds the latest `guard_starts` starts only.
"""
from __future__ import annotations

import logging
import math
import threading
import time
import warnings
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

from osd.errors import InvalidArgument
from osd.flags import option
from osd.learn.budget import LearnBudget
from osd.learn.head_chains import (Chains, chain_lengths, chains_of_sequence, concat_chains, paired_mean_difference,
                                   unrolled_loss)
from osd.learn.precision import PRECISIONS, compute_in, training_dtype
from osd.learn.restore import RestorePoint
from osd.models.vocab_map import target_to_draft
from osd.schedule.turns import end_thread_team

log = logging.getLogger("osd.learn.head")
SCORE_DEPTH = 4  # the guard scores chains of this many proposals (accepted length per start)
IN_FLIGHT = 256  # requests whose features are kept while they run (a request that never finishes ages out)


@dataclass
class HeadLearnConfig:
    head_every_requests: int = option(8, "update the feature head every N finished requests")
    head_steps_per_update: int = option(16, "optimizer steps per update")
    head_batch: int = option(32, "chain starts per optimizer step: one chunk of work between two serving steps "
                             "(64 took ~0.35 s a step for the bundled target's head, bf16, 2 Zen 4 cores: "
                             "benchmarks/drafts/feature-head-codetrain400.json)")
    head_depth: int = option(2, "training-time test: chains of this many proposals, the head reading its own predicted "
                        "feature past the first (2 paid offline, docs/feature-head.md)")
    head_lr: float = option(1e-3, "learning rate (AdamW; `osd bench feature-head` trains with the same)")
    head_feature_weight: float = option(1.0, "weight of the smooth-L1 fit of the predicted feature to the target's")
    head_capacity: int = option(8192, "chain starts kept for training, the oldest requests' dropped first")
    head_holdout_every: int = option(5, "every Nth finished request is held out: never trained on, the guard's "
                                     "evidence")
    head_guard_starts: int = option(384, "the guard compares candidate and serving head on the latest N held-out "
                                    "starts")
    head_guard_z: float = option(1.64, "reject an update whose accepted length per held-out start is lower by more "
                                 "than this many standard errors (paired)")
    head_busy_share: float = option(0.1, "share of the busy time the learner may take while requests decode "
                               "(learn/budget.py); idle time is free")
    head_precision: str = option("auto", "the training step's matrix products (auto: bf16 where the CPU has it)",
                            choices=PRECISIONS)
    head_schedule: str = option("background", "background (own thread, chunks between serving steps) or sync (inside "
                           "after_request: tests, replays)", choices=("background", "sync"))
    head_seed: int = option(0, "seed of the batches' sampling")

    def __post_init__(self):
        if min(self.head_every_requests, self.head_steps_per_update, self.head_batch, self.head_depth) < 1:
            raise InvalidArgument("--head-every-requests, --head-steps-per-update, --head-batch and --head-depth must be >= 1")
        if self.head_holdout_every < 2:
            raise InvalidArgument("--head-holdout-every must be >= 2 (some requests must train)")


class HeadLearner:
    def __init__(self, head, vocab_ids: torch.Tensor, vocab_size: int, embed, publish,
                 config: HeadLearnConfig | None = None, engine_busy=lambda: False, clock=time.monotonic):
        """head: the float FeatureHead that trains (the master); vocab_size: the target's; embed: target ids -> (n, H)
        embeddings; publish: head -> the published snapshot (its int8 copy, a new version)."""
        self.config = config or HeadLearnConfig()
        self.head, self.embed, self.publish, self.engine_busy, self.clock = head, embed, publish, engine_busy, clock
        self.index = target_to_draft(vocab_ids, vocab_size)  # (V,) target id -> map row, -1 off the map
        self.map_embeddings = embed(vocab_ids.tolist())  # (M, H): what a proposal past the first reads
        self.params = [p for p in head.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=self.config.head_lr, weight_decay=0.0)
        self.dtype = training_dtype(self.config.head_precision)
        self.generator = torch.Generator().manual_seed(self.config.head_seed)
        self._running: OrderedDict[str, list] = OrderedDict()  # request -> [first position, [(n, H) rows]]
        self.train: deque[Chains] = deque()
        self.holdout: deque[Chains] = deque()
        # finished requests not yet made chains: (held out, tokens, first position, feature rows), absorbed by the
        # learner's thread in a turn of its own (absorb), not on the serving thread that finishes them
        self.finished: deque[tuple[bool, list[int], int, list[torch.Tensor]]] = deque()
        self.version = 0
        self.counters = {"requests": 0, "requests_since_update": 0, "updates_published": 0, "updates_rejected": 0,
                         "update_errors": 0, "optimizer_steps": 0, "train_seconds": 0.0}
        self.last_update: dict = {}
        self._lock = threading.RLock()
        self._wake, self._stop = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None
        self.idle = LearnBudget(self.config.head_busy_share, lambda: self.engine_busy(), clock, stop=self._stop)
        self.training = self.paused = False

    # --- observing the engine ---------------------------------------------------------------------
    def attach(self, engine) -> "HeadLearner":
        engine.observers.append(self.observe)
        engine.request_observers.append(self.after_request)
        self.engine_busy = engine.busy
        self.idle.turns = getattr(engine, "turns", None)
        self.idle.pressure = getattr(engine, "pressure", lambda: False)
        return self

    def observe(self, record) -> None:
        """Keep the target's features at the rows this step committed (the pending token and the accepted ones)."""
        if record.target_features is None:
            return
        position = len(record.context) - 1  # row 0: the pending token
        entry = self._running.get(record.request_id)
        if entry is None or entry[0] + sum(len(r) for r in entry[1]) != position:  # new (or a gap: start again)
            entry = self._running[record.request_id] = [position, []]
            while len(self._running) > IN_FLIGHT:
                self._running.popitem(last=False)
        entry[1].append(record.target_features[: record.n_accepted + 1].clone())

    def after_request(self, result) -> None:
        """A finished request's features wait, as they are, for the learner's thread (absorb)."""
        entry = self._running.pop(result.request_id, None)
        self.counters["requests"] += 1
        if entry is not None and entry[1]:
            held = self.counters["requests"] % self.config.head_holdout_every == 0
            self.finished.append((held, list(result.prompt_ids) + list(result.token_ids), entry[0], entry[1]))
            while len(self.finished) > self.config.head_capacity:  # (a learner that never runs keeps a bounded queue)
                self.finished.popleft()
        self.counters["requests_since_update"] += 1
        if self.config.head_schedule == "sync":
            self.maybe_update()
        else:
            self._wake.set()

    def absorb(self) -> None:
        """The finished requests' chains (an embedding lookup of each answer, its features concatenated) into the
        training and held-out sets."""
        while self.finished:
            held, tokens, first, rows = self.finished.popleft()
            piece = chains_of_sequence(tokens, first, torch.cat(rows), self.embed, self.index,
                                       max(self.config.head_depth, SCORE_DEPTH))
            if piece is not None:
                self._keep(self.holdout if held else self.train, piece,
                           self.config.head_guard_starts if held else self.config.head_capacity)

    @staticmethod
    def _keep(pieces: deque, piece: Chains, most: int) -> None:
        pieces.append(piece)
        while len(pieces) > 1 and sum(len(p.labels) for p in pieces) - len(pieces[0].labels) >= most:
            pieces.popleft()

    # --- updating ---------------------------------------------------------------------------------
    def maybe_update(self) -> dict | None:
        if self.paused or self.counters["requests_since_update"] < self.config.head_every_requests or \
                not (self.train or self.finished):
            return None
        return self.update()

    def update(self) -> dict:
        """Train on the recent requests; publish if the guard agrees. Never leaves a broken head serving."""
        with self._lock:
            self.training, start = True, self.clock()
            self.counters["requests_since_update"] = 0
            restore = None
            try:
                self._wait()  # the chains and the copies below (weights, Adam moments) run in a chunk too
                self.absorb()
                if not self.train:
                    return {"published": False, "rejected_because": "nothing to train on"}
                restore = RestorePoint(self.params, self.optimizer)
                report = self._update()
            except Exception as e:
                if restore is not None:
                    restore.restore()
                self.counters["update_errors"] += 1
                self.last_update = {"error": repr(e), "published": False}
                raise
            finally:
                self.idle.release()
                self.head.eval()
                self.training = False
            if not report["published"]:
                restore.restore()
                self.counters["updates_rejected"] += 1
            self.counters["train_seconds"] += self.clock() - start
            self.last_update = report
            return report

    def _update(self) -> dict:
        cfg = self.config
        train = concat_chains(list(self.train))
        pool = (train.labels[:, 0] >= 0).nonzero().squeeze(1)
        holdout = concat_chains(list(self.holdout)) if self.holdout else None
        before = self._score(holdout)
        losses = []
        self.head.train()
        for _ in range(cfg.head_steps_per_update):
            if not len(pool):
                break
            self._wait()
            j = pool[torch.randint(len(pool), (min(cfg.head_batch, len(pool)),), generator=self.generator)]
            with compute_in(self.dtype), warnings.catch_warnings():  # RMSNorm's fp32 weight on bf16 rows: unfused
                warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
                loss = unrolled_loss(self.head, train, self.map_embeddings, j, cfg.head_depth, cfg.head_feature_weight)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if not math.isfinite(torch.nn.utils.clip_grad_norm_(self.params, 1.0).item()):
                continue
            self.optimizer.step()
            self.counters["optimizer_steps"] += 1
            losses.append(loss.item())
        self.head.eval()
        after = self._score(holdout)
        finite = all(torch.isfinite(p).all() for p in self.params)
        z = paired_mean_difference(before, after)["z"] if before is not None else None
        report = {"train_starts": int(len(pool)), "holdout_starts": 0 if before is None else len(before),
                  "losses": losses, "accepted_before": None if before is None else float(before.float().mean()),
                  "accepted_after": None if after is None else float(after.float().mean()), "z": z,
                  "published": False}
        if not losses or not finite or (z is not None and z < -cfg.head_guard_z):
            report["rejected_because"] = "no finite step" if not losses else "non-finite weights" if not finite \
                else "guard"
            return report
        self._wait()
        self.version = self.publish(self.head).version
        report.update(published=True, version=self.version)
        self.counters["updates_published"] += 1
        return report

    @torch.no_grad()
    def _score(self, holdout: Chains | None) -> torch.Tensor | None:
        """(N,) accepted proposals per held-out start for a greedy chain of SCORE_DEPTH (None: nothing held out), in
        chunks of 4 batches of starts, each between two serving steps (in one chunk, the whole held-out set's chains
        held the cores from every decoding request for as long)."""
        if holdout is None:
            return None
        out, order = [], torch.arange(len(holdout.rows))
        for i in range(0, len(order), self.config.head_batch * 4):
            self._wait()
            with compute_in(self.dtype):
                out.append(chain_lengths(self.head, holdout, self.map_embeddings, SCORE_DEPTH,
                                         order[i : i + self.config.head_batch * 4]))
        return torch.cat(out)

    def _wait(self) -> None:
        """Background: before a chunk of work, the turn between two serving steps (learn/budget.py)."""
        if self.config.head_schedule == "background":
            self.idle.release()
            self.idle.wait()

    # --- background thread, operator switches, stats -------------------------------------------------
    def start(self) -> None:
        if self.config.head_schedule != "background" or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="osd-head-learner", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            if self._stop.is_set():
                break
            try:
                self.maybe_update()
            except Exception:  # a failed update never takes serving down
                log.exception("feature head update failed; serving goes on with head version %d", self.version)
            finally:
                end_thread_team()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=120)
            self._thread = None

    def pause(self, timeout: float = 120.0) -> bool:
        """No update starts until unpause() (one in flight finishes)."""
        self.paused = True
        deadline = time.monotonic() + timeout
        while self.training and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self.training

    def unpause(self) -> None:
        self.paused = False
        self._wake.set()

    def stats(self) -> dict:
        # (list(): one atomic copy; iterating the deque itself while the serving thread appends to it could raise)
        train_starts = sum(len(p.labels) for p in list(self.train))
        holdout_starts = sum(len(p.labels) for p in list(self.holdout))
        return {"version": self.version, **self.counters, "train_starts": train_starts,
                "requests_waiting": len(self.finished),
                "holdout_starts": holdout_starts, "training": int(self.training), "paused": int(self.paused),
                "parked": 0, "head_accepted_heldout": self.last_update.get("accepted_after"), **self.idle.stats()}

