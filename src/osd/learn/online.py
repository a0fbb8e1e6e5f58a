"""The online learner: observe verification -> buffer -> distill -> guard -> publish (PAPER.md section 4).

It touches the engine through two seams only: it observes StepRecords (which already hold the target's
logits) and it publishes new draft weights with a version through a `publish(master) -> snapshot`
callable. Training runs on its own fp32 master copy of the draft; serving uses published snapshots.

Schedules: "sync" trains inside `after_request` (deterministic; stream replay, tests); "background"
trains in its own thread, in chunks (a few items' forward/backward: chunk_positions) between the scheduler's steps:
freely while the engine is idle, and while requests decode within `busy_share` of the busy time, earned from the
measured seconds of the serving steps (learn/budget.py), so that a busy server learns too and pays a stated share.
A rejected update restores the weights and the optimizer's state (its Adam moments) as they were
(learn/restore.py RestorePoint); so does an update that an exception cuts short: the master is never left
half-updated (it returns to its state when the update began, or when this update last published).
Rehearsal (rehearsal > 0): a share of each batch comes from a uniform sample of the older traffic the buffer
evicted (learn/rehearsal.py), so that learning a new domain does not erase an old one; with rehearsal_uniform
that share is the older traffic's share of all traffic seen, so batches sample the whole history uniformly.
The learner's fixed memory (Adam moments, the drift guard's weight copies) is taken when it is built
(learn/memory.py).
Averaging (average > 0): the master holds an exponential moving average of the optimizer's weights, which is what
the guard judges and what is published and checkpointed; the optimizer steps its own trajectory, swapped in for
the steps only (learn/average.py).
Drift guard (drift_guard): after each update the draft that serves is also compared with the never-trained
base (and the best version so far) on the same held-out requests; significantly below the base (paired
z < -drift_z), it is rolled back to the best version or reset to the base (counters "rollbacks", "resets";
learn/guard.py drift_action, learn/drift.py). Held-out requests are ones no optimizer step has seen.
An exception inside an update is counted apart (`update_errors`, not `updates_rejected`: those are the guard's
verdicts) and re-raised; the background thread logs it and goes on with the next update, and serving goes on with
the last published draft. (In sync mode the exception reaches the caller of after_request.)
"""
from __future__ import annotations

import logging
import math
import random
import threading
import time
import zlib
from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass

import torch

from osd.errors import InvalidArgument
from osd.flags import option
from osd.learn.average import WeightAverage
from osd.learn.batch import acceptance_on, acceptance_summary, items_loss, position_chunks
from osd.learn.buffer import MODES, ReplayBuffer, fresh_first, items_of_step
from osd.learn.checkpoint import load_checkpoint, load_extra, save_checkpoint
from osd.learn.drift import VersionStore
from osd.learn.guard import drift_action, is_worse, paired_flips, paired_z
from osd.learn.budget import LearnBudget
from osd.learn.losses import LOSSES
from osd.learn.memory import items_bytes, optimizer_state_bytes, reserve_optimizer_state, tensor_bytes
from osd.learn.precision import PRECISIONS, compute_in, training_dtype
from osd.learn.rehearsal import Reservoir, Sweeps, history_share, mixed_batch
from osd.learn.residual import add_difference
from osd.learn.restore import RestorePoint
from osd.learn.trainable import configure_trainable, split_index
from osd.learn.triggers import Pace, UpdateTrigger, describe_value, learning_value, update_outcome
from osd.learn.vocab import TokenCounts, choose_swap, head_name, special_ids_of, swap_head, undo
from osd.models.derived import base_head_rows
from osd.models.vocab_map import vocab_ids_of
from osd.schedule.turns import end_thread_team

log = logging.getLogger("osd.learn")
UPDATE_PHASES = ("evaluate_serving", "train", "evaluate_candidate", "publish", "drift_guard")  # _update's work
TRAJECTORY = "learner_trajectory"  # checkpoint file (.pt) of the learner's own weights (and step count) when the
#   average serves


@dataclass
class LearnConfig:
    mode: str = option("mismatch", "which positions feed the training buffer: mismatch (where the draft missed) or "
                       "all (every output position)", choices=MODES)
    top_k: int = option(64, "target distribution kept per position: its top K tokens and the tail's mass")
    capacity: int = option(4096, "training buffer capacity in positions (oldest evicted first)")
    every_requests: int = option(8, "update the draft every N finished requests (0 = off)")
    min_positions: int = option(0, "... or when the buffer holds N positions (0 = off)")
    max_age_seconds: float = option(0.0, "... or when the oldest buffered position is this many seconds old (0 = off)")
    loss: str = option("forward_kl", "distillation loss: forward_kl (target||draft), reverse_kl, jsd, tv or "
                       "reference_mix", choices=LOSSES)
    beta: float = option(0.5, "the JSD's beta (loss jsd), in [0, 1]")
    # AdamW on the top layers; 1e-4 made the offline loss diverge within steps (BENCHMARKS.md)
    lr: float = option(1e-5, "learning rate (AdamW)")
    batch_size: int = option(8, "training items (about one request each) per optimizer step")
    micro_batch: int = option(0, "items per forward/backward, gradients summed into the same step; 0 = the whole "
                              "batch in the sync schedule, in background items up to chunk_positions supervised "
                              "positions (a decode then waits for at most one such chunk)")
    chunk_positions: int = option(64, (
        "background schedule, micro_batch 0: a chunk of work (forward/backward, or a held-out evaluation) takes items "
        "until it holds this many supervised positions (at least one item). Each chunk writes the trained layer's whole "
        "weight gradient (~60 MB for the cheap draft's last layer): one item per chunk cost 1.7x the whole batch's "
        "step on the Zen 4 machine (0.99 s against 0.59 s for 8 items of 64 positions), 4 items 1.2x (0.70 s); "
        "128 positions let chunks of up to 0.6 s stall a live server's decoding requests"))
    steps_per_update: int = option(8, "optimizer steps per update (batches sampled from the buffer)")
    back_off: int = option(1, (
        "space updates up to this many times every_requests while they stop paying: the interval doubles after an "
        "update that was rejected, when the last 4 published ones together did not raise held-out agreement, or when "
        "the speed their held-out gain buys over the next pace_horizon seconds does not cover their work; it halves "
        "when held-out agreement rose (z > 1); back to every_requests when the drift guard "
        "restores a version (learn/triggers.py Pace). 1 = a fixed pace"))
    pace_horizon: float = option(600.0, (
        "seconds of serving over which the pace amortises an update's work (learn/triggers.py learning_pays): the "
        "last 4 updates pay when the speed their held-out gain buys, over this many seconds or the learner's lifetime "
        "if longer, covers the seconds they took"))
    observe_with_pace: bool = option(True, (
        "while the pace has spaced updates out (back_off: every_requests x a factor F > 1), observe 1 request in F "
        "(whole requests, chosen by a hash of their id: the same ones at every F that divides it) instead of every "
        "one: the learner then trains F times less often and its buffer ages out what it never reaches, while "
        "observing costs the serving thread ~0.4-1.1 ms a sequence-step (osd bench observe). Back to every request "
        "as soon as the factor returns to 1 (updates pay again, or the drift guard restored a version)"))
    vocab_swap: int = option(0, (
        "a derived draft's map follows the traffic: at each update, swap up to N of the tokens the target emitted off "
        "the draft's map (counted at the observed positions, decayed 0.9 an update) for the least counted ones on it; "
        "the head keeps its size, a new row starts from the base's own LM head row (learn/vocab.py). Undone with a "
        "rejected update. 0 = the map as built"))
    vocab_swap_min_count: float = option(4.0, "... a token off the map is swapped in once counted this much")
    rehearsal: float = option(0.5, (
        "share of each training batch drawn from a uniform sample of older traffic (what the buffer evicted; "
        "learn/rehearsal.py), against forgetting after a shift (cheap draft, gsm8k -> spider -> code: gsm8k held-out "
        "-0.103 below the never-trained draft without it, +0.043 with 0.5; BENCHMARKS.md); 0 = the buffer alone"))
    keep_unused_seconds: float = option(600.0, (
        "background schedule: a sample no optimizer step has used yet stays in the buffer past the capacity until a "
        "step uses it or it is this many seconds old (up to 4x the capacity), and batches take unused samples first, "
        "oldest first: a burst of requests loses none that has not aged out (learn/buffer.py); 0 = plain FIFO"))
    rehearsal_capacity: int = option(256, "items (about one request each) kept in that sample of older traffic")
    rehearsal_uniform: bool = option(False, (
        "the older traffic's share of each batch follows its share of all traffic seen, at most the rehearsal share: "
        "batches sample the whole history uniformly, as an offline draft trained on everything so far does "
        "(learn/rehearsal.py history_share); slower to follow a shift. Measured on a 600-request code stream: "
        "held-out alpha 0.565 against 0.576 with the fixed share (BENCHMARKS.md), so it is off by default"))
    sweep: bool = option(False, (
        "draw each batch's recent and older items in shuffled sweeps (every item once before any twice, as offline "
        "epochs do; learn/rehearsal.py Sweeps) instead of independently per step; a resumed --fast replay starts "
        "new sweeps"))
    max_context: int = option(384, "tokens of context kept per training item")
    precision: str = option("auto", (
        "the training step's matrix products: bfloat16 (autocast; weights, gradients and Adam moments stay float32), "
        "float32, or auto = bfloat16 where the CPU has native bf16 (AVX-512 BF16, AMX), else float32 "
        "(learn/precision.py: forward + backward took 0.53x the float32 time on the Zen 4 machine, same learning)"),
        choices=PRECISIONS)
    # (learn/trainable.py's "adapter" is set by --drafts' own learners, not a flag)
    trainable: str = option("no_embeddings", "which draft weights train: all, no_embeddings or lora "
                            "(learn/trainable.py)", choices=("all", "no_embeddings", "lora"))
    train_layers: int = option(4, "only the top N decoder layers train (the rest frozen, their outputs cached); "
                               "0 = all")
    lora_rank: int = option(8, "rank of the LoRA update (trainable lora)")
    guard: bool = option(True, "publish an update only if the draft's acceptance on held-out recent requests does "
                         "not drop")
    guard_holdout: float = option(0.2, "newest share of the guard's requests held out of training, in [0, 1)")
    guard_capacity: int = option(2048, "positions of the guard's buffer (every output position of recent requests)")
    guard_tolerance: float = option(0.0, "drop in held-out greedy agreement the guard allows")
    guard_z: float = option(1.64, "... and a rejected drop must also exceed this many paired-noise standard "
                            "deviations (learn/guard.py; 0 = any drop)")
    drift_guard: bool = option(True, "(with the guard) also compare the serving draft with the never-trained one on "
                               "the held-out requests; significantly below it: roll back to the best version so far "
                               "or reset to the base")
    drift_z: float = option(1.64, "\"significantly below\" for the drift guard: paired z < -this")
    schedule: str = option("sync", "when updates train: sync = inside the finished request (deterministic; "
                           "replays), background = in a thread, in idle windows (serving)",
                           choices=("sync", "background"))
    busy_share: float = option(0.2, (
        "background schedule: the learner's share of the time while requests decode. Each second of serving steps "
        "earns it share / (1 - share) seconds, spent in chunks (a few items' forward/backward) between two steps, at "
        "most one chunk per step (learn/budget.py); idle windows (no request decoding) are free. In (0, 1]; "
        "1 = a chunk after every step"))
    average: float = option(0.98, (
        "serve an exponential moving average of the learner's weights over its optimizer steps (this decay per "
        "step; learn/average.py) instead of the last step's weights: held-out alpha +0.012 online, +0.017 offline "
        "on a 600-request code stream (BENCHMARKS.md); costs one more copy of the trainable weights; 0 = off, "
        "the last step's weights serve"))
    checkpoint_dir: str = option("", "directory where the learner saves its draft and state, and resumes from on "
                                 "restart; none = no checkpoints")
    checkpoint_every_seconds: float = option(0.0, (
        "write a checkpoint after an update only if the last one is at least this old (a rollback or reset by the "
        "drift guard is always written, and so is the last state when the learner stops); 0 = after every update"))
    seed: int = option(0, "seed of the learner's sampling of batches")

    @classmethod
    def serving(cls, **overrides) -> "LearnConfig":
        """`osd serve`'s defaults: learn in a background thread, and resume on restart.
        busy_share: the learner's share of the busy time (learn/budget.py: earned from the serving steps' seconds),
        what learning costs there on top of observing. Under the old idle-window rule 0.05 let a 75 s load at 8
        clients take 0 optimizer steps (benchmarks/scale/bench-scale-noray-48-steps.json). 0.03: on a code stream at
        0.5 of capacity the learner then took 89 steps in 300 requests, mostly in idle windows (which it does not
        limit), and the server decoded at 0.92-1.06x the learning-off one by quarter; at 0.1 (chunks of 128
        positions) 104 steps, at 0.76-1.10x (benchmarks/live/bench-live-code300-load05{-share003,}.json).
        mode all, lr 1e-4, train_layers 1: the evidence replays' recipe (docs/learning.md: every output position, lr
        1e-4, about one optimizer step per request); training the last layer only reached held-out acceptance 0.466
        against 0.472 for both of the cheap draft's layers (control 0.288) on 100 code requests, in 90 s against 184 s
        (benchmarks/learning/layers-code100-tl{1,2}.json).
        batch_size 2, 8 steps every 8 requests: the same number of steps as batches of 8 every 4 requests, for a
        third of the learner time: 0.441 in 33 s against 0.457 in 92 s on those 100 requests
        (benchmarks/learning/recipe-code100-b{2,8}.json), so a learner held to a share of a busy server keeps up with
        its traffic (the 8-item recipe took ~0.65 s of learner time per request, more than a 0.5-load server leaves).
        16 steps every 16 requests (not 8 every 8): an update's fixed work (the guards' held-out evaluations, the
        restore point, building the serving copy, the checkpoint) was ~45% of a live learner's seconds
        (benchmarks/live/profiles/), and every publish makes the scheduler probe the new version; on code test
        requests 0-299, 288 steps took 48 s of learner time against 62 s for 296 steps 8 every 8, held-out 0.521
        against 0.529 (benchmarks/learning/precision-code300-bf16.json, recipe-code300-e16.json).
        back_off 8: a draft that stopped improving stops costing (learn/triggers.py Pace): on a code stream at 0.5 of
        capacity the updates kept paying and the pace stayed at 8 requests (benchmarks/live/
        bench-live-code300-load05-nolookup.json), where the learner's ~0.1 of the CPU about cancelled what its draft
        gained (0.98-1.04x by quarter).
        checkpoint_every_seconds 60: a checkpoint (the trained layer, its Adam moments and the average: ~240 MB for
        the cheap draft, fsynced) after every 4-step update wrote that much every few requests beside serving.
        chunk_positions 256 (not 64): a step's two items (~64 positions each) in one chunk, a held-out evaluation in a
        quarter of the chunks. Live on the Intel Xeon (code, 0.5 of capacity, interleaved), at the same learner CPU
        (0.09-0.16 of the wall time against 0.10-0.16) the learner took 203 optimizer steps in 300 requests against 165,
        published first after 25 requests against 50, and the server decoded at 1.002x the learning-off one over the
        run [0.96, 1.05] against 0.976x [0.95, 1.00] (within noise; benchmarks/live/
        bench-live-code300-load05-il25{-chunk256,}-intel.json). A chunk under load then holds the cores ~0.25 s there
        (a step), still within busy_share of the busy time.
        vocab_swap 64: the shipped draft's map lacks 10% of the bundled target's tokens on code (14% on chat); swapping
        up to 64 an update toward the target's own tokens raised held-out agreement after 300 requests from 0.520 to
        0.539 on code (z 3.8) and 0.264 to 0.275 on chat (z 2.8), at the same 288 steps and the same cost a proposal
        (benchmarks/learning/pair-vocab-swap-{code,chat}300-intel.json)."""
        return cls(**{"schedule": "background", "busy_share": 0.03, "checkpoint_dir": "runs/draft-checkpoint",
                      "checkpoint_every_seconds": 60.0, "mode": "all", "lr": 1e-4, "train_layers": 1,
                      "batch_size": 2, "every_requests": 16, "steps_per_update": 16, "back_off": 8,
                      "chunk_positions": 256, "vocab_swap": 64, **overrides})

    def __post_init__(self):
        if self.mode not in MODES:
            raise InvalidArgument(f"learn mode must be one of {MODES}, got {self.mode!r}")
        if self.loss not in LOSSES:
            raise InvalidArgument(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if not 0.0 <= self.beta <= 1.0:
            raise InvalidArgument(f"beta must be in [0, 1], got {self.beta}")
        if self.guard_z < 0 or self.guard_tolerance < 0 or self.drift_z < 0:
            raise InvalidArgument("guard_z, guard_tolerance and drift_z must be >= 0")
        if self.micro_batch < 0 or self.chunk_positions <= 0:
            raise InvalidArgument(f"micro_batch must be >= 0 (0 = automatic) and chunk_positions > 0, got "
                                  f"{self.micro_batch}, {self.chunk_positions}")
        if min(self.lr, self.batch_size, self.steps_per_update, self.capacity, self.top_k, self.guard_capacity) <= 0:
            raise InvalidArgument("lr, batch_size, steps_per_update, capacity, top_k and guard_capacity must be > 0")
        if not 0.0 <= self.rehearsal <= 1.0 or self.rehearsal_capacity <= 0:
            raise InvalidArgument(f"rehearsal must be in [0, 1] and rehearsal_capacity > 0, got {self.rehearsal}, "
                                  f"{self.rehearsal_capacity}")
        if not 0.0 <= self.average < 1.0:
            raise InvalidArgument(f"average must be in [0, 1) (0 = off), got {self.average}")
        if not 0.0 <= self.guard_holdout < 1.0:
            raise InvalidArgument(f"guard_holdout must be in [0, 1), got {self.guard_holdout}")
        if not 0.0 < self.busy_share <= 1.0:
            raise InvalidArgument(f"busy_share must be in (0, 1], got {self.busy_share}")
        if self.back_off < 1:
            raise InvalidArgument(f"back_off must be >= 1 (1 = a fixed pace), got {self.back_off}")
        if self.vocab_swap < 0 or self.vocab_swap_min_count <= 0:
            raise InvalidArgument(f"vocab_swap must be >= 0 and vocab_swap_min_count > 0, got {self.vocab_swap}, "
                                  f"{self.vocab_swap_min_count}")
        if self.keep_unused_seconds < 0:
            raise InvalidArgument(f"keep_unused_seconds must be >= 0, got {self.keep_unused_seconds}")
        training_dtype(self.precision)  # a clear error for an unknown precision
        if self.schedule not in ("sync", "background"):
            raise InvalidArgument(f"schedule must be sync or background, got {self.schedule!r}")


def observed_at(request_id: str, factor: int) -> bool:
    """1 request in `factor`, chosen by a hash of its id (stable across processes, unlike hash()): a request observed
    at a factor is observed at every factor that divides it, so the sample only grows as the pace comes back."""
    return factor <= 1 or zlib.crc32(str(request_id).encode()) % factor == 0


class OnlineLearner:
    def __init__(self, master, publish, config: LearnConfig | None = None, engine_busy=lambda: False,
                 clock=time.monotonic, sleep=time.sleep):
        self.config = config or LearnConfig()
        self.master, self.publish, self.engine_busy, self.clock = master, publish, engine_busy, clock
        # older traffic the buffer evicts, sampled uniformly and mixed into batches (None: rehearsal off)
        self.reservoir = Reservoir(self.config.rehearsal_capacity, self.config.seed) if self.config.rehearsal else None
        self.keep_unused = self.config.keep_unused_seconds if self.config.schedule == "background" else 0.0
        self.buffer = ReplayBuffer(self.config.capacity, clock,  # the training signal (mismatches, or all)
                                   self.reservoir.offer if self.reservoir is not None else None, self.keep_unused)
        # The guard judges acceptance, so it needs every position (accepted ones too), not only
        # the mismatches: on those alone agreement is ~0 before any update and can only look better after.
        self.guard_buffer = ReplayBuffer(self.config.guard_capacity, clock)
        self.trigger = UpdateTrigger(self.config.every_requests, self.config.min_positions, self.config.max_age_seconds)
        self.pace = Pace(self.config.back_off)  # every_requests' factor while updates stop paying
        # the last updates' work seconds, and the serving version's held-out agreement after each and what the update
        # changed of it: what learning_pays weighs (learn/triggers.py)
        self._work = deque(maxlen=self.pace.window)
        self._first_update: float | None = None  # when the first update started: the learner's lifetime
        self.live = False  # attached to a serving engine: only then is work weighed against serving time saved
        self.step_stats = None  # the serving scheduler's StepStats once attached: the pace reads its seconds
        self.params = configure_trainable(master, self.config.trainable, self.config.train_layers, self.config.lora_rank)
        self.split = split_index(master, self.config.train_layers)
        self.dtype = training_dtype(self.config.precision)  # of the step's matrix products (learn/precision.py)
        # fused: one kernel over all the parameters (15 ms a step against 49 ms for the per-tensor loop, Zen 4:
        # benchmarks/learning/bench-train-step-code-b2.json)
        self.optimizer = torch.optim.AdamW(self.params, lr=self.config.lr, weight_decay=0.0, fused=True)
        # averaging: the master holds the average of the steps' weights (what serves), the optimizer steps its own
        # trajectory (learn/average.py); None: the master's weights are the last step's
        self.average = WeightAverage(self.params, self.config.average) if self.config.average else None
        reserve_optimizer_state(self.optimizer)  # the moments now, not at the first step (learn/memory.py)
        # the drift guard's base / best versions and the requests ever trained on (None: no drift guard)
        self.versions = VersionStore(self.params) if self.config.guard and self.config.drift_guard else None
        # vocab_swap: the target's tokens at the observed positions, toward which the draft's map is swapped
        # (a derived draft with its own map, and a row to start a new token from: its base's LM head or tied embedding)
        self._new_rows = base_head_rows(master) if self.config.vocab_swap and vocab_ids_of(master) is not None else None
        self.token_counts = TokenCounts(int(master.config.vocab_size)) if self._new_rows is not None else None
        if self.config.vocab_swap and self.token_counts is None:
            log.info("vocab_swap off: the draft has no map of its own or no row to start a new token from (learn/vocab.py)")
        self._keep_ids = special_ids_of(master.config)  # never swapped out of the map
        self._head_before = None  # during an update: the head a swap replaced (a rejection or an error undoes it)
        self.rng = random.Random(self.config.seed)
        self.sweeps = (Sweeps(self.rng), Sweeps(self.rng)) if self.config.sweep else None  # recent, older
        self.version = 0
        self.counters = {"requests": 0, "requests_since_update": 0, "updates_published": 0, "updates_rejected": 0,
                         "update_errors": 0,  # exceptions inside updates (not guard rejections)
                         "steps_skipped_nonfinite": 0, "optimizer_steps": 0, "train_seconds": 0.0,
                         "rollbacks": 0, "resets": 0,  # drift guard: back to the best version / to the base
                         "parked_seconds": 0.0,  # updates parked by pause() (train_seconds, their wall time, includes it)
                         # an update's work by phase, seconds (its wall time less its waits for a turn: _phase)
                         **{f"work_seconds_{p}": 0.0 for p in UPDATE_PHASES},
                         "checkpoints_deferred": 0,  # updates not checkpointed: the last checkpoint was too recent
                         "steps_not_observed": 0,  # observe_with_pace: steps of requests left out while backed off
                         "vocab_swapped": 0}  # vocab_swap: tokens swapped into the map by published updates
        self._saved_at: float | None = None  # when the last checkpoint was written (clock)
        self._checkpoint_due: float | None = None  # background: since when a checkpoint waits for an idle engine
        self.last_update: dict = {}
        self.heldout: dict = {}  # the drift guard's latest same-positions comparison: serving draft vs the base
        self.history: list[dict] = []  # one summary per update (bounded)
        self._lock = threading.RLock()  # one update (or checkpoint) at a time
        self._restore_point: RestorePoint | None = None  # during an update: what a failure or a rejection returns to
        self._serving_memo: tuple[int, dict] = (-1, {})  # (version, {(request, positions): (correct, accepted)})
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # background: before each chunk of work, wait for an idle engine (engine_busy, set by attach) or for credit
        # earned by the serving steps (learn/budget.py)
        self.idle = LearnBudget(self.config.busy_share, lambda: self.engine_busy(), clock,
                                None if sleep is time.sleep else sleep, stop=self._stop)
        self.training = False
        self.paused = False  # an operator's switch (pause / unpause): no update starts, one in flight parks
        self._unpaused, self._parked = threading.Event(), threading.Event()

    # --- seam 1: observing the engine ---------------------------------------------------------
    def observe(self, record) -> None:
        cfg = self.config  # (the top-k is computed once per step: ~0.4-1.1 ms a sequence-step in the serving thread)
        if not self.observes(record.request_id):
            self.counters["steps_not_observed"] += 1
            return
        self.observe_item(*items_of_step(record, cfg.mode, cfg.top_k, cfg.max_context, cfg.guard, self.clock()))

    def observes(self, request_id: str) -> bool:
        """Whether this request's steps are observed now: every request at the pace's factor 1 (or without
        observe_with_pace), 1 in `factor` of them while updates are spaced out (`observed_at`)."""
        return not self.config.observe_with_pace or observed_at(request_id, self.pace.factor)

    def observe_item(self, item, every_position_item=None) -> None:
        """Items built elsewhere too (the greedy fast-path replay builds them from cached target outputs).

        item: the training signal (None: nothing to learn here); every_position_item: the same step's
        every proposed position, for the guard.
        """
        if self.token_counts is not None and (every_position_item or item) is not None:
            self.token_counts.add((every_position_item or item).target.ids[:, 0])
        if item is not None:
            self.buffer.add(item)
        if every_position_item is not None and self.config.guard:
            self.guard_buffer.add(every_position_item)

    def after_request(self, result=None) -> None:
        self.counters["requests"] += 1
        self.counters["requests_since_update"] += 1
        if self.config.schedule == "sync":
            self.maybe_update()
        else:
            self._wake.set()

    def attach(self, engine) -> "OnlineLearner":
        engine.observers.append(self.observe)
        engine.request_observers.append(self.after_request)
        self.engine_busy = engine.busy
        self.live = True
        self.idle.turns = getattr(engine, "turns", None)  # chunks between steps, never beside one
        self.idle.pressure = getattr(engine, "pressure", lambda: False)  # none while a request waits to start
        self.step_stats = getattr(getattr(engine, "scheduler", None), "stats", None)  # what the pace reads of serving
        return self

    # --- updating -------------------------------------------------------------------------------
    @property
    def update_every_requests(self) -> int:
        """Requests between updates at the pace now (the trigger's interval times the pace's factor)."""
        return self.config.every_requests * self.pace.factor

    def maybe_update(self) -> dict | None:
        if self.paused:
            return None
        reason = self.trigger.due(self.counters["requests_since_update"], len(self.buffer), self.buffer.oldest_age(),
                                  self.pace.factor)
        return self.update(reason) if reason else None

    def update(self, reason: str = "manual") -> dict:
        """Distill on the buffer; publish if the guard agrees. Never leaves a broken draft serving.

        An exception midway (after some optimizer steps changed the master, before it is published) restores the
        master's trainable weights and the optimizer's state as they were, counts it in update_errors and re-raises;
        the published draft keeps serving and the next update starts from the restored master."""
        with self._lock:
            self.training = True
            start, counted = self.clock(), self.counters["requests_since_update"]
            self._restore_point = RestorePoint(self.weights(), self.optimizer)
            self.idle.begin()
            try:
                report = self._update(reason)
            except Exception as e:
                self._restore_point.restore()
                undo(self.master, self._head_before)
                self.master.eval()
                self.counters["update_errors"] += 1
                self.last_update = {"reason": reason, "error": repr(e), "published": False}
                raise
            finally:
                self.idle.release()
                self.training = False
                self._restore_point = None
                self._head_before = None
            self.counters["train_seconds"] += self.clock() - start
            # the requests that finished while it trained count toward the next one (background: an update under load
            # spans ~10-20 requests; reset to 0, an update "every 8 requests" came every ~25 and a code stream at 0.5
            # of capacity got 88 steps in 300 requests where the recipe means one a request)
            self.counters["requests_since_update"] = max(0, self.counters["requests_since_update"] - counted)
            if "restored_version" in report.get("vs_base", {}):
                self.pace.reset()  # the drift guard acted: the traffic moved, learn at full pace again
            elif "train_items" in report:  # (not "nothing to train on": that says nothing of the pace)
                self._work.append({**update_outcome(report), **self._decoding_seconds()})
                self._first_update = start if self._first_update is None else self._first_update
                report["learning_value"] = value = self._learning_value()
                report["learning_pays"] = None if value is None else value["pays"]
                self.pace.after_update(report["published"], report.get("heldout_flips"), report["learning_pays"])
            self.last_update = report
            for phase, seconds in report.get("work_seconds", {}).items():
                self.counters[f"work_seconds_{phase}"] += seconds
            if report.get("work_seconds"):
                log.info("draft update (%s): %s, %d optimizer steps%s; work %.2f s (%s); learning pays: %s, next after %d "
                         "requests", reason, f"published v{report['version']}" if report["published"] else
                         f"rejected ({report.get('rejected_because')})", len(report.get("losses") or []),
                         f", {report['vocab_swapped']} tokens swapped into the map" if report.get("vocab_swapped") else "",
                         sum(report["work_seconds"].values()),
                         ", ".join(f"{k} {v:.2f}" for k, v in report["work_seconds"].items()),
                         describe_value(report.get("learning_value")),
                         self.update_every_requests)
            losses = report.get("losses") or []
            self.history = (self.history + [{**{k: v for k, v in report.items() if k != "losses"},
                                             "mean_loss": sum(losses) / len(losses) if losses else None,
                                             "seconds": self.clock() - start, "at_request": self.counters["requests"]}])[-1000:]
            return report

    def _update(self, reason: str) -> dict:
        cfg = self.config
        held = self._holdout_requests()
        train = [it for it in self.buffer.snapshot() if it.request_id not in held]
        older = [] if self.reservoir is None else [it for it in self.reservoir.snapshot() if it.request_id not in held]
        holdout = [it for it in self.guard_buffer.snapshot() if it.request_id in held]
        if not train:
            return {"reason": reason, "items": 0, "published": False, "rejected_because": "nothing to train on",
                    "losses": []}
        phases: dict[str, float] = {}
        with self._phase(phases, "evaluate_serving"):
            before = self._serving_acceptance(holdout) if holdout else None
        self._head_before, swapped = self._swap_vocab()
        self.master.train()
        losses = []
        with self._phase(phases, "train"), self.average.training() if self.average is not None else nullcontext():
            share = cfg.rehearsal if not cfg.rehearsal_uniform or self.reservoir is None else \
                history_share(self.reservoir.offered, len(train), cfg.rehearsal)
            for _ in range(cfg.steps_per_update):
                batch = self._batch(train, older, share)
                loss = self._accumulate_gradients(batch)
                for item in batch:
                    item.used += 1
                # a non-finite gradient makes the norm non-finite: that step is skipped, its gradients cleared
                if loss is None or not math.isfinite(torch.nn.utils.clip_grad_norm_(self.params, 1.0).item()):
                    self.optimizer.zero_grad(set_to_none=True)
                    self.counters["steps_skipped_nonfinite"] += 1
                    continue
                self.optimizer.step()
                if self.average is not None:
                    self.average.step()
                self.counters["optimizer_steps"] += 1
                losses.append(loss)
        self.master.eval()
        if self.versions is not None:  # a request some step has seen is never held out again
            self.versions.mark_trained({it.request_id for it in train + older},
                                       {it.request_id for it in self.buffer.snapshot() + self.guard_buffer.snapshot() + older})
        with self._phase(phases, "evaluate_candidate"):
            after = self._acceptance(holdout) if holdout else None
        finite = all(torch.isfinite(p).all() for p in self.params)
        before_correct = before.pop("correct") if before is not None else None
        after_correct = after.pop("correct") if after is not None else None
        after_lists = (holdout, after_correct, after.pop("accepted")) if after is not None else None
        if before is not None:
            before.pop("accepted")
        worse = before is not None and is_worse(before_correct, after_correct, cfg.guard_z, cfg.guard_tolerance)
        report = {"reason": reason, "items": len(train) + len(holdout), "train_items": len(train), "losses": losses,
                  "holdout_before": before, "holdout_after": after, "published": False,
                  # (gained, lost) against the serving draft on the same held-out positions (learn/triggers.py Pace)
                  "heldout_flips": paired_flips(before_correct, after_correct)[::-1] if before is not None else None,
                  "work_seconds": phases}
        if not losses or not finite or worse:
            self._restore_point.restore()  # moments too: a rejected update leaves no trace
            undo(self.master, self._head_before)  # and the map as it served
            self._head_before = None
            if swapped:
                report["vocab_swap_undone"] = swapped
            self.counters["updates_rejected"] += 1
            report["rejected_because"] = "no finite step" if not losses else "non-finite weights" if not finite else "guard"
            with self._phase(phases, "drift_guard"):
                restored = self._stop_drift(holdout, before_correct, report)
            if restored:
                self._checkpoint(force=True)
            return report
        with self._phase(phases, "publish"):
            self._publish()
        self.counters["vocab_swapped"] += swapped
        if swapped:
            report["vocab_swapped"] = swapped
        if after_lists is not None:
            self._remember_serving(*after_lists)
        self.counters["updates_published"] += 1
        report.update(published=True, version=self.version)
        with self._phase(phases, "drift_guard"):
            restored = self._stop_drift(holdout, after_correct, report)
        self._checkpoint(force=restored)
        return report

    @contextmanager
    def _phase(self, phases: dict, name: str):
        """Adds the seconds of work in the block to phases[name]: its wall time less the waits for a turn between
        serving steps in it (learn/budget.py) and the time it was parked by pause(), i.e. what the learner spent, in
        chunks and between them."""
        start, waited, parked = self.clock(), self.idle.waited_total, self.counters["parked_seconds"]
        try:
            yield
        finally:
            idle = (self.idle.waited_total - waited) + (self.counters["parked_seconds"] - parked)
            phases[name] = phases.get(name, 0.0) + (self.clock() - start) - idle

    def _batch(self, train: list, older: list, share: float) -> list:
        """One step's items: mixed_batch's recent / older mix; keeping unused samples (background), the recent part
        takes the ones no step has used yet first (learn/buffer.py fresh_first)."""
        cfg = self.config
        if not self.keep_unused:
            return mixed_batch(self.rng, train, older, cfg.batch_size, share, stochastic=cfg.rehearsal_uniform,
                               sweeps=self.sweeps)
        n_old = min(len(older), round(cfg.batch_size * share))
        recent = fresh_first(self.rng, train, cfg.batch_size - n_old)
        return recent + self.rng.sample(older, min(len(older), cfg.batch_size - len(recent)))

    def _checkpoint(self, force: bool = False) -> None:
        """An update's checkpoint (where configured and, unless `force`, the last one is checkpoint_every_seconds
        old), written without the cores: serving goes on meanwhile. An unforced one of the learner's own background
        updates, with checkpoint_every_seconds > 0, waits for an idle engine (`_save_when_idle`): writing ~240 MB took
        ~1.5 s of a core, which decoding requests lost beside it on 2 cores. An update asked for from another thread
        (the cluster's update_now), or "after every update" (0), is written now, before the caller goes on."""
        cfg = self.config
        if not cfg.checkpoint_dir:
            return
        if not force and self._saved_at is not None and self.clock() - self._saved_at < cfg.checkpoint_every_seconds:
            self.counters["checkpoints_deferred"] += 1
            return
        self.idle.release()
        if not force and cfg.checkpoint_every_seconds > 0 and threading.current_thread() is self._thread:
            self._checkpoint_due = self._checkpoint_due if self._checkpoint_due is not None else self.clock()
            return
        self.save()

    def _save_when_idle(self) -> None:
        """Write the checkpoint an update left due once no request decodes, or once it has waited
        checkpoint_every_seconds (a server that is never idle still checkpoints)."""
        due = self._checkpoint_due
        if due is not None and (not self.engine_busy() or self.clock() - due >= self.config.checkpoint_every_seconds):
            self._checkpoint_due = None  # (a failed write is not retried before the next update's)
            self.save()

    def _stop_drift(self, holdout: list, serving: list[bool] | None, report: dict) -> bool:
        """The drift guard: the serving draft (`serving`: its correctness on `holdout`) against the never-trained
        base and the best version so far, on the same held-out positions. Keeps, or rolls back / resets and then
        publishes the restored weights as a new version, with fresh optimizer moments (returns True then)."""
        if self.versions is None or not holdout or serving is None:
            return False
        evaluate = lambda items: self._acceptance(items)["correct"]
        base = self.versions.correct_of("base", holdout, evaluate)
        best = None if self.versions.best is None else (
            serving if self.versions.best["version"] == self.version else self.versions.correct_of("best", holdout, evaluate))
        action = drift_action(base, serving, best, self.config.drift_z)
        self.heldout = {"heldout_agreement_base": sum(base) / len(base),  # same positions: what learning gained
                        "heldout_agreement_serving": sum(serving) / len(serving), "heldout_positions": len(base)}
        lost, gained = paired_flips(base, serving)
        report["vs_base"] = {"gained": gained, "lost": lost, "z": paired_z(base, serving), "action": action,
                             "z_vs_best": paired_z(best, serving) if best is not None else None}
        if action == "keep":
            if sum(serving) > sum(best if best is not None else base):
                self.versions.remember_best(self.version)
            return False
        report["vs_base"]["restored_version"] = self.versions.best["version"] if action == "rollback" else 0
        self.versions.restore(action)
        if self.average is not None:
            self.average.reset()  # the trajectory restarts from the restored weights
        self.optimizer.state.clear()  # the abandoned trajectory's Adam moments go with it
        reserve_optimizer_state(self.optimizer)
        self.counters["rollbacks" if action == "rollback" else "resets"] += 1
        self._publish()
        report["vs_base"]["published_version"] = self.version
        return True

    def _learning_value(self) -> dict | None:
        """learn/triggers.py `learning_value` (what `learning_pays` weighs) on the last `pace.window` updates: the
        serving version's held-out agreement now and before them (now less what each published one gained), their
        work, over pace_horizon or the learner's lifetime if longer. None before that many updates, without a
        held-out measure, or not attached to a serving engine (a fast replay: its seconds are not a server's, and a
        resumed replay repeats an uncut one)."""
        if not self.live or len(self._work) < self._work.maxlen:
            return None
        now = self._work[-1]["agreement"]
        before = None if now is None else now - sum(w["gained"] for w in self._work)
        horizon = max(self.config.pace_horizon, self.clock() - self._first_update)
        return learning_value(before, now, sum(w["work"] for w in self._work), horizon, self._speculable())

    def _decoding_seconds(self) -> dict:
        """The serving scheduler's decoding seconds so far, and those in passes where a sequence may propose."""
        stats = self.step_stats
        return {} if stats is None else {"decode_seconds": stats.decode_seconds,
                                         "speculable_seconds": stats.speculable_seconds}

    def _speculable(self) -> float:
        """The share of the decoding seconds since the first of the judged updates spent in passes where a sequence
        may propose (schedule/scheduler.py: none beside prompt rows): the share a better draft speeds up. 1.0 when
        unknown (no scheduler, or under a second of decoding)."""
        then, now = self._work[0], self._decoding_seconds()
        if "decode_seconds" not in then:
            return 1.0
        decoding = now["decode_seconds"] - then["decode_seconds"]
        if decoding < 1.0:
            return 1.0
        return min(1.0, (now["speculable_seconds"] - then["speculable_seconds"]) / decoding)

    def _swap_vocab(self):
        """vocab_swap, before training: the map swapped toward the counted traffic (learn/vocab.py) -> (what undo
        needs or None, tokens swapped in). The counts age by one update either way."""
        if self.token_counts is None:
            return None, 0
        cfg = self.config
        add, drop = choose_swap(self.token_counts.counts, vocab_ids_of(self.master), self._keep_ids, cfg.vocab_swap,
                                cfg.vocab_swap_min_count)
        self.token_counts.age()
        return swap_head(self.master, add, drop, self._new_rows), len(add)

    def _publish(self) -> None:
        """Publish the master; it now matches what serves, so a later failure in this update returns to it."""
        snapshot = self.publish(self.master)
        self.version = snapshot.version
        self._restore_point = None  # (never two restore points in memory at once)
        self._restore_point = RestorePoint(self.weights(), self.optimizer)

    def weights(self) -> list[torch.Tensor]:
        """What an update changes besides the optimizer: the master's trainable weights (and, when averaging, the
        trajectory kept beside them). Moved together with a leader by learn/residual.py (under `lock()`)."""
        return self.params + (self.average.trajectory if self.average is not None else [])

    def move_with(self, after: list[torch.Tensor], before: list[torch.Tensor]) -> None:
        """A residual follower (learn/residual.py): add a leader's weight change (`weights()` lists, same layout)
        to this learner's weights, and to the drift guard's base and best versions. Hold `lock()`."""
        add_difference(self.weights(), after, before)
        self._serving_memo = (-1, {})  # the master moved: what the serving version measured is not its any more
        if self.versions is not None:
            n = len(self.params)
            self.versions.shift(after[:n], before[:n])

    def lock(self) -> threading.RLock:
        """Held by an update (and a checkpoint): hold it to change `weights()` from outside."""
        return self._lock

    def _accumulate_gradients(self, batch: list) -> float | None:
        """Gradients of the batch's mean loss over positions, one micro-batch at a time (the idle wait before
        each), the forward pass's matrix products in `self.dtype`; returns the loss, or None (gradients cleared) when
        the loss is not finite (a non-finite gradient: `_update` skips the step on the gradients' norm)."""
        cfg = self.config
        total = sum(len(it.positions) for it in batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for micro in self._chunks(batch):
            self._wait_idle()
            share = sum(len(it.positions) for it in micro) / total  # mean over the micro-batch -> over the batch
            with compute_in(self.dtype):
                loss = items_loss(self.master, micro, cfg.loss, cfg.beta, split=self.split) * share
            if not math.isfinite(loss.item()):
                self.optimizer.zero_grad(set_to_none=True)
                return None
            loss.backward()
            loss_sum += loss.item()
        return loss_sum

    def _chunks(self, items: list) -> list[list]:
        """The micro-batches of one step (or evaluation): micro_batch items each where set; else the whole list in
        the sync schedule, and in background items up to chunk_positions supervised positions (position_chunks)."""
        cfg = self.config
        if cfg.micro_batch:
            return [items[i : i + cfg.micro_batch] for i in range(0, len(items), cfg.micro_batch)]
        return position_chunks(items, cfg.chunk_positions) if cfg.schedule == "background" else [items]

    def _acceptance(self, items: list) -> dict:
        """The master's acceptance on held-out items; in background mode in chunks of work (`_chunks`: a chunk of 8
        items took 1.7-2.5 s of the draft here, every request's step held up meanwhile: schedule/turns.py). In the
        training step's precision: every version the guards compare is measured alike (evaluations were 22% of a
        live learner's seconds in fp32, benchmarks/live/profiles/)."""
        with compute_in(self.dtype):
            return acceptance_on(self.master, items, split=self.split, pause=self._wait_idle,
                                 chunks=self._chunks if self.config.schedule == "background" else None)

    def _serving_acceptance(self, items: list) -> dict:
        """The serving version's acceptance on held-out items: what the last published update measured on the same
        items (same request, same positions) is reused, only the rest is evaluated (the master holds the serving
        weights when an update starts). Saves one of an update's three held-out evaluations."""
        version, known = self._serving_memo
        key = lambda it: (it.request_id, len(it.positions))  # noqa: E731
        known = known if version == self.version else {}
        missing = [it for it in items if key(it) not in known]
        if missing:
            fresh = self._acceptance(missing)
            self._remember_serving(missing, fresh["correct"], fresh["accepted"], keep=known)
            known = self._serving_memo[1]
        return acceptance_summary([c for it in items for c in known[key(it)][0]],
                                  [a for it in items for a in known[key(it)][1]])

    def _remember_serving(self, items: list, correct: list, accepted: list, keep: dict | None = None) -> None:
        """Per-item (correctness, acceptance) of the version serving now (self.version), from flat per-position lists
        in the items' order; `keep`: what is already known of this version."""
        known, offset = dict(keep or {}), 0
        for it in items:
            n = len(it.positions)
            known[(it.request_id, n)] = (correct[offset : offset + n], accepted[offset : offset + n])
            offset += n
        self._serving_memo = (self.version, known)

    def _holdout_requests(self) -> set[str]:
        """The newest `guard_holdout` share of the requests in the guard buffer (none with fewer than 2), among those
        no optimizer step has seen (with the drift guard; without it, a request trained on may be held out later)."""
        if not self.config.guard:
            return set()
        ids = list(dict.fromkeys(it.request_id for it in self.guard_buffer.snapshot()))  # oldest first
        n_hold = int(len(ids) * self.config.guard_holdout) if len(ids) >= 2 else 0
        fresh = [i for i in ids if self.versions is None or i not in self.versions.trained_ids]
        return set(fresh[-n_hold:]) if n_hold else set()

    def _wait_idle(self) -> None:
        """In background mode, before a chunk of work: park while paused, then wait for an idle engine or the credit
        for a chunk under load (busy_share of the serving steps' seconds, learn/budget.py)."""
        if self.config.schedule == "background":
            self.idle.release()  # (never parked holding the cores)
            self._park_while_paused()
            self.idle.wait()

    # --- pausing -------------------------------------------------------------------------------
    def pause(self, timeout: float = 120.0) -> bool:
        """No update starts until unpause(), and one in flight parks at its next chunk of work (before its next
        micro-batch or evaluation chunk, background schedule: the one that pauses beside serving) and finishes after
        unpause(). Returns True once the learner takes no time from serving (parked or idle), False if that did not
        happen within timeout seconds. Traffic is still observed (the buffers keep filling): nothing is lost."""
        self.paused = True
        self._unpaused.clear()
        deadline = time.monotonic() + timeout
        while self.training and not self._parked.is_set():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def unpause(self) -> None:
        self.paused = False
        self._unpaused.set()
        self._wake.set()

    def _park_while_paused(self) -> None:
        start = time.monotonic()
        while self.paused and not self._stop.is_set():
            self._parked.set()
            self._unpaused.wait(timeout=0.5)
        if self._parked.is_set():
            self._parked.clear()
            self.counters["parked_seconds"] += time.monotonic() - start

    # --- background thread --------------------------------------------------------------------
    def start(self) -> None:
        if self.config.schedule != "background" or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="osd-learner", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(timeout=1.0 if self._checkpoint_due is None else 0.1)
            self._wake.clear()
            if self._stop.is_set():
                break
            errors = self.counters["update_errors"]
            try:
                self.maybe_update()
                self._save_when_idle()
            except Exception as e:  # a failed update never takes serving down, nor passes for a guard rejection
                if self.counters["update_errors"] == errors:  # (update() counts its own, having restored the master)
                    self.counters["update_errors"] += 1
                    self.last_update = {"error": repr(e)}
                log.exception("background draft update failed (%d so far); serving goes on with draft version %d",
                              self.counters["update_errors"], self.version)
            finally:  # publishing and checkpointing ran torch here too: no OpenMP team idles beside serving
                end_thread_team()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._unpaused.set()  # a parked update finishes
        if self._thread is not None:
            self._thread.join(timeout=120)
            self._thread = None
        if self.config.checkpoint_dir:
            self.save()

    # --- checkpoints ----------------------------------------------------------------------------
    def save(self) -> None:
        """draft.safetensors holds the master's weights: what serves (the average, when averaging: what
        `--learned-draft` and `osd eval` load); the trajectory goes beside them (learner_trajectory.pt)."""
        with self._lock:
            state = {"version": self.version, "counters": self.counters, "config": asdict(self.config)}
            extra = {TRAJECTORY: self.average.state_dict()} if self.average is not None else None
            head = head_name(self.master) if self.counters["vocab_swapped"] else None  # the swapped map's head
            save_checkpoint(self.config.checkpoint_dir, self.master, self.optimizer, state, extra,
                            (head,) if head else ())
            self._saved_at, self._checkpoint_due = self.clock(), None

    def resume(self) -> bool:
        """Load the last checkpoint (if any) and publish it at its saved version."""
        state = load_checkpoint(self.config.checkpoint_dir, self.master, self.optimizer) if self.config.checkpoint_dir else None
        if state is None:
            return False
        self.counters.update(state["counters"])
        snapshot = self.publish(self.master, version=state["version"])
        self.version = snapshot.version
        if self.average is not None:  # the trajectory as saved, or (a checkpoint without one) from the average
            saved = load_extra(self.config.checkpoint_dir, TRAJECTORY)
            self.average.load_state_dict(saved or {"trajectory": self.params, "steps": 0})
        return True

    def memory(self) -> dict:
        """Bytes the learner holds: fixed at start (optimizer state, the drift guard's weight copies) and filling
        with traffic up to the buffers' capacities (items' distributions and cached features)."""
        older = self.reservoir.snapshot() if self.reservoir is not None else []
        return {"memory_optimizer_bytes": optimizer_state_bytes(self.optimizer),
                "memory_versions_bytes": self.versions.bytes() if self.versions is not None else 0,
                "memory_average_bytes": tensor_bytes(self.average.other) if self.average is not None else 0,
                "memory_trainable_bytes": tensor_bytes(self.params),
                "memory_buffers_bytes": items_bytes(self.buffer.snapshot() + self.guard_buffer.snapshot() + older)}

    def stats(self) -> dict:
        return {**self.memory(), "version": self.version, "buffer_positions": len(self.buffer),
                "buffer_added": self.buffer.added, "buffer_evicted": self.buffer.evicted,
                "buffer_evicted_unused": self.buffer.evicted_unused, "buffer_unused_positions": self.buffer.unused(),
                "rehearsal_items": len(self.reservoir) if self.reservoir is not None else 0,
                "training": int(self.training), "paused": int(self.paused),
                "parked": int(self._parked.is_set()), **self.counters,
                "update_every_requests": self.update_every_requests,
                **self.heldout, **self.idle.stats()}  # background: the learner's seconds under load and idle, serving's (budget.py)
