"""GET /metrics through prometheus_client, one CollectorRegistry per app (not the process-global one, so
several apps in one process, as in the tests, never collide).

Series, following Prometheus naming (counters end in _total, durations are seconds); rates are the
scraper's to derive:
  osd_http_requests_total{endpoint,status}          every HTTP response, errors included (middleware.py)
  osd_prompt_tokens_total, osd_completion_tokens_total   tokens of completed requests
  osd_request_duration_seconds                      histogram: arrival -> last token (completed requests)
  osd_time_to_first_token_seconds                   histogram: arrival -> first text
  osd_time_per_output_token_seconds                 histogram: generation seconds / output tokens
  osd_queue_depth                                   gauge: requests waiting for the model
  osd_spec_{requests,steps,proposed,accepted,emitted}_total{draft,draft_version}
  osd_spec_beta_sum_total, osd_spec_beta_n_total    alpha = beta_sum / beta_n
  osd_spec_{proposed,accepted}_at_total{draft,draft_version,position}   per-position acceptance
  osd_spec_{draft,target}_seconds_total
  osd_spec_{rows,tree_steps,tree_tokens}_total{draft,draft_version}   rows verified; token-tree steps and their extra tokens
  osd_learning_{acceptance,tokens_per_step}{draft,draft_version}   gauges, derived at scrape from the counters above:
                                                    each served version's acceptance rate and tokens per step
  osd_learning_{acceptance,tokens_per_step}_vs_first{draft}   the newest version with enough steps against the
                                                    draft's first version (learning_effect: what the stats line shows)
  osd_learner_<stat>                                the learner's stats: LEARNER_GAUGES are gauges, every other
                                                    numeric stat is a counter, osd_learner_<stat>_total
  osd_kernel_info{path,fallback,avx512_vnni,error}  osd.models.kernels.status(): path is "compiled" (osd's
                                                    rows_linear kernels), "torch_fallback" (unavailable, torch's
                                                    kernels allowed and in use), "unavailable" (nothing fell back)
                                                    or "not_loaded" (no model asked for them yet)
  osd_kernel_fallback{use}                          gauge, 1 per use that runs on torch's kernels instead of ours
  osd_sequences_running, osd_sequence_capacity      gauges: sequences in the scheduler now, and its room
  osd_schedule_{steps,rows,prefill_rows,reused_rows,sequence_steps,proposed,accepted,emitted}_total, and
  osd_schedule_step_seconds_total                   (reused_rows: prompt tokens a slot's cache held already)
  osd_schedule_{decode,speculable}_seconds_total    seconds of passes with decoding rows, and of those where a
                                                    sequence may propose (what the learner's pace weighs)
                                                    the scheduler's steps (schedule/scheduler.py StepStats): rows per
                                                    step = rows / steps, mean k = proposed / sequence_steps, goodput =
                                                    accepted / step_seconds, tokens/s = emitted / step_seconds
  osd_schedule_last_rows, osd_schedule_last_step_seconds   gauges: the latest step
  osd_draft_{acceptance,tokens}_by_confidence{source,bin}   gauges: acceptance of verified draft tokens by the
                                                    draft's probability of them, and the tokens it rests on (what
                                                    decides how far a drafted proposal is verified: --confidence)
  osd_engine_info{target_backend,slots,draft_runner,k_limit,k_asked,max_batch,greedy_identity}   what serves: the target runner
                                                    (Q4Runner, LlamaCppRunner: a fallback where the Q4 kernel cannot
                                                    run), its slots (Q4Slots: one pass for all sequences), the draft
                                                    runner (GlueDraftRunner; CachedModel: the transformers fallback),
                                                    the k cap the backend allows against the k asked

The speculative counters (osd.metrics.SpecMetrics), the learner's stats and the kernels' status are read at
scrape time by a custom collector, so they are never copied into a second set of counters that could drift.
Limitations: a learner stat that is a level rather than a running count must be listed in LEARNER_GAUGES,
or it is exposed as a counter (the learner's stats are counters first, so that is the default); the kernel
series describe the rows_linear kernels (kernels.status()), not the Q4 target's own kernels.
"""
from __future__ import annotations

import logging
import math

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from osd.metrics import MIN_STEPS, learning_effect  # noqa: F401 - re-exported (the app, the tests)
from osd.models import kernels

log = logging.getLogger("osd.serve")

REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
CONTENT_TYPE = CONTENT_TYPE_LATEST

SPEC_COUNTERS = {  # SpecCounters field -> help
    "requests": "Requests served.", "steps": "Verification steps.", "proposed": "Draft tokens proposed.",
    "accepted": "Draft tokens accepted.", "emitted": "Tokens emitted (accepted + recovered + bonus).",
    "beta_sum": "Sum of exact per-position acceptance probabilities (alpha = beta_sum / beta_n).",
    "beta_n": "Positions summed in beta_sum.", "draft_seconds": "Seconds in draft proposals.",
    "target_seconds": "Seconds in target verification.",
    "rows": "Target rows verified (pending tokens, proposals, tree nodes).",
    "tree_steps": "Steps that verified a token tree (--tree).",
    "tree_tokens": "Tokens accepted on a tree's recycled or runner-up branches, beyond the chain's accepted prefix.",
}
LEARNER_GAUGES = {"version", "training", "paused", "parked", "buffer_positions", "requests_since_update", "rehearsal_items",
                  "memory_optimizer_bytes", "memory_versions_bytes", "memory_average_bytes", "memory_trainable_bytes",
                  "memory_buffers_bytes", "buffer_unused_positions", "busy_share_measured", "chunk_seconds_max",
                  "heldout_agreement_base", "heldout_agreement_serving", "heldout_positions",
                  "update_every_requests",
                  "train_starts", "holdout_starts", "head_accepted_heldout", "requests_waiting"}
# (levels, not running counts; the last four: the feature head's learner, learn/head.py)


class ServeMetrics:
    """HTTP-level counters and latency histograms in this app's own registry; the engine's speculative
    counters and the learner's stats join at scrape time (`attach`)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("osd_http_requests", "HTTP responses by endpoint and status.", ["endpoint", "status"],
                                registry=r)
        self.prompt_tokens = Counter("osd_prompt_tokens", "Prompt tokens of completed requests.", registry=r)
        self.completion_tokens = Counter("osd_completion_tokens", "Generated tokens of completed requests.", registry=r)
        self.request_seconds = Histogram("osd_request_duration_seconds", "Request latency, arrival to last token.",
                                         buckets=REQUEST_BUCKETS, registry=r)
        self.ttft = Histogram("osd_time_to_first_token_seconds", "Arrival to first text.", buckets=REQUEST_BUCKETS,
                              registry=r)
        self.tpot = Histogram("osd_time_per_output_token_seconds", "Generation seconds per output token.",
                              buckets=TOKEN_BUCKETS, registry=r)

    def attach(self, spec_metrics, learner=None, queue_depth=lambda: 0, kernel_status=kernels.status,
               engine=None) -> None:
        """Expose the engine's SpecMetrics, the learner's stats, the queue depth, the kernels' status
        (kernels.status() or a stand-in) and, given the engine, its scheduler and what serves, read at each scrape."""
        Gauge("osd_queue_depth", "Requests waiting for the model.", registry=self.registry).set_function(queue_depth)
        self.registry.register(_LiveCollector(spec_metrics, learner, kernel_status))
        if engine is not None:
            self.registry.register(_EngineCollector(engine))

    def attach_cluster(self, pool) -> None:
        """A front over replicas (cluster/pool.py): their own metrics and the learner's, labelled `replica`, as the
        pool last fetched them, and the front's own view of them."""
        from osd.cluster.metrics import ClusterCollector

        Gauge("osd_queue_depth", "Requests waiting for a replica's scheduler (all replicas).",
              registry=self.registry).set_function(lambda: pool.depth)
        self.registry.register(ClusterCollector(lambda: dict(pool.texts)))
        self.registry.register(_PoolCollector(pool))

    def count(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def observe(self, seconds: float, ttft: float | None, n_prompt: int, n_new: int, generation_seconds: float) -> None:
        self.prompt_tokens.inc(n_prompt)
        self.completion_tokens.inc(n_new)
        self.request_seconds.observe(seconds)
        if ttft is not None:
            self.ttft.observe(ttft)
        if n_new:
            self.tpot.observe(generation_seconds / n_new)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LiveCollector:
    """A prometheus_client custom collector over state that lives elsewhere (engine, learner)."""

    def __init__(self, spec_metrics, learner=None, kernel_status=kernels.status):
        self.spec_metrics, self.learner, self.kernel_status = spec_metrics, learner, kernel_status

    def collect(self):
        counters = self.spec_metrics.counters()
        yield from spec_families(counters)
        yield from learning_families(learning_effect(counters))
        yield from kernel_families(self.kernel_status())
        if self.learner is not None:
            try:
                stats = self.learner.stats()
            except Exception:  # a learner fault must not take /metrics down
                log.exception("learner.stats() failed")
                return
            yield from learner_families(stats)


class _EngineCollector:
    """The scheduler's step counters and the engine's serving choices, read at scrape time."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        e, sched = self.engine, self.engine.scheduler
        yield GaugeMetricFamily("osd_sequences_running", "Sequences in the scheduler.", value=len(sched.running))
        yield GaugeMetricFamily("osd_sequence_capacity", "Sequences the scheduler runs at once.", value=sched.capacity)
        yield from schedule_families(sched.stats)
        yield from confidence_families(e)
        yield InfoMetricFamily("osd_engine", "What serves: target runner, its slots, the k limits.",
                               value=engine_info(e))


class _PoolCollector:
    """The front's view of its replicas: requests in flight to each, which are up, retries and failures."""

    def __init__(self, pool):
        self.pool = pool

    def collect(self):
        p = self.pool
        inflight = GaugeMetricFamily("osd_cluster_inflight", "Requests in flight from this front.", labels=["replica"])
        up = GaugeMetricFamily("osd_cluster_replica_up", "1 while the replica answers.", labels=["replica"])
        for i, n in enumerate(p.inflight):
            inflight.add_metric([str(i)], n)
            up.add_metric([str(i)], 0 if i in p.down else p.states.get(str(i), {}).get("up", 1))
        yield inflight
        yield up
        for key, value in p.counters.items():
            yield CounterMetricFamily(f"osd_cluster_{key}", f"Front: {key.replace('_', ' ')}.", value=value)


def confidence_families(engine) -> list:
    """Each proposal source's acceptance by the draft's confidence in its token (schedule/confidence.py), per bin with
    evidence: what the scheduler reads to decide how far each drafted proposal is verified."""
    acceptance = GaugeMetricFamily("osd_draft_acceptance_by_confidence", "Acceptance of verified draft tokens by the "
                                   "draft's probability of them (recent tokens).", labels=["source", "bin"])
    seen = GaugeMetricFamily("osd_draft_tokens_by_confidence", "Verified draft tokens the bin's acceptance rests on "
                             "(forgetting applied).", labels=["source", "bin"])
    for source, policy in zip(engine.sources, engine.policies):
        for row in policy.confidence.table():
            acceptance.add_metric([source.name, row["bin"]], row["acceptance"])
            seen.add_metric([source.name, row["bin"]], row["seen"])
    return [acceptance, seen]


def engine_info(engine) -> dict:
    """What serves, as labels: the target runner and its slots, the draft runner (glue or transformers: the latter
    a fallback), the k the backend allows against the k asked, and the scheduler's capacity."""
    runners = {type(getattr(s, "runner", None)).__name__ for s in engine.sources if getattr(s, "runner", None)}
    return {"target_backend": type(engine.target).__name__, "slots": type(engine.slots).__name__,
            "draft_runner": ",".join(sorted(runners)) or "none", "k_limit": str(engine.k_max),
            "k_asked": str(engine.spec.k), "max_batch": str(engine.scheduler.capacity),
            "greedy_identity": getattr(engine.target, "greedy_identity", "exact"),
            "tree_nodes": str(getattr(engine, "tree_nodes", 0))}


def schedule_families(stats) -> list:
    families = []
    for name in ("steps", "rows", "prefill_rows", "reused_rows", "sequence_steps", "proposed", "accepted", "emitted"):
        families.append(CounterMetricFamily(f"osd_schedule_{name}", f"Scheduler {name.replace('_', ' ')}.",
                                            value=getattr(stats, name)))
    families.append(CounterMetricFamily("osd_schedule_step_seconds", "Seconds in the scheduler's target passes.",
                                        value=stats.seconds))
    families.append(CounterMetricFamily("osd_schedule_decode_seconds", "Seconds of the target passes with decoding "
                                        "rows.", value=stats.decode_seconds))
    families.append(CounterMetricFamily("osd_schedule_speculable_seconds", "Seconds of the target passes with "
                                        "decoding rows where a sequence may propose (no prompt rows beside them).",
                                        value=stats.speculable_seconds))
    families.append(GaugeMetricFamily("osd_schedule_last_rows", "Rows of the latest step.", value=stats.last_rows))
    families.append(GaugeMetricFamily("osd_schedule_last_step_seconds", "Seconds of the latest step's target pass.",
                                      value=stats.last_seconds))
    return families


def spec_families(counters: dict) -> list:
    """{(draft name, version): SpecCounters} -> counter families labelled by draft and draft_version."""
    items = sorted(counters.items())
    families = []
    for name, help_text in SPEC_COUNTERS.items():
        family = CounterMetricFamily(f"osd_spec_{name}", help_text, labels=["draft", "draft_version"])
        for (draft, version), c in items:
            family.add_metric([draft, str(version)], getattr(c, name))
        families.append(family)
    for name in ("proposed_at", "accepted_at"):
        family = CounterMetricFamily(f"osd_spec_{name}", f"Draft tokens {name.split('_')[0]} at proposal position.",
                                     labels=["draft", "draft_version", "position"])
        for (draft, version), c in items:
            for i, n in enumerate(list(getattr(c, name))):
                family.add_metric([draft, str(version), str(i)], n)
        families.append(family)
    return families


def learning_families(effect: dict) -> list:
    """learning_effect() -> gauges per (draft, version), and each draft's latest-vs-first ratios."""
    acceptance = GaugeMetricFamily("osd_learning_acceptance", "Acceptance rate of each served draft version.",
                                   labels=["draft", "draft_version"])
    per_step = GaugeMetricFamily("osd_learning_tokens_per_step", "Tokens per verification step of each draft version.",
                                 labels=["draft", "draft_version"])
    vs_acc = GaugeMetricFamily("osd_learning_acceptance_vs_first", "Latest version's acceptance / the first's.",
                               labels=["draft"])
    vs_tps = GaugeMetricFamily("osd_learning_tokens_per_step_vs_first", "Latest version's tokens per step / the first's.",
                               labels=["draft"])
    for draft, e in effect.items():
        for version, v in e["versions"].items():
            if v["acceptance"] is not None:
                acceptance.add_metric([draft, str(version)], v["acceptance"])
            if v["tokens_per_step"] is not None:
                per_step.add_metric([draft, str(version)], v["tokens_per_step"])
        if e["acceptance_vs_first"] is not None:
            vs_acc.add_metric([draft], e["acceptance_vs_first"])
        if e["tokens_per_step_vs_first"] is not None:
            vs_tps.add_metric([draft], e["tokens_per_step_vs_first"])
    return [acceptance, per_step, vs_acc, vs_tps]


def learning_summary(effect: dict) -> str:
    """One short phrase for the periodic stats line, e.g. "draft v3 acc 0.61 (1.18x v0) tok/step 2.41 (1.12x)"."""
    parts = []
    for draft, e in effect.items():
        latest, first = e["versions"][e["latest"]], e["first"]
        text = f"{draft} v{e['latest']}"
        if latest["acceptance"] is not None:
            text += f" acc {latest['acceptance']:.2f}"
            if e["acceptance_vs_first"] is not None and e["latest"] != first:
                text += f" ({e['acceptance_vs_first']:.2f}x v{first})"
        if latest["tokens_per_step"] is not None:
            text += f" tok/step {latest['tokens_per_step']:.2f}"
            if e["tokens_per_step_vs_first"] is not None and e["latest"] != first:
                text += f" ({e['tokens_per_step_vs_first']:.2f}x)"
        parts.append(text)
    return "; ".join(parts)


def learner_families(stats: dict) -> list:
    """The learner's numeric stats (booleans as 0/1; non-numbers and non-finite values skipped)."""
    families = []
    for key, value in sorted(stats.items()):
        if isinstance(value, bool):
            value = int(value)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        name = "osd_learner_" + "".join(ch if ch.isalnum() else "_" for ch in key)
        kind = GaugeMetricFamily if key in LEARNER_GAUGES else CounterMetricFamily
        families.append(kind(name, f"Learner stat {key}.", value=value))
    return families


def kernel_path(status: dict) -> str:
    """Which linears run, from kernels.status(): compiled | torch_fallback | unavailable | not_loaded."""
    if status["compiled"] is None:
        return "not_loaded"
    if status["compiled"]:
        return "compiled"
    return "torch_fallback" if status["fallback"] else "unavailable"


def kernel_families(status: dict) -> list:
    """kernels.status() -> osd_kernel_info (one sample, the status as labels) and osd_kernel_fallback{use}."""
    error = (status.get("error") or "").splitlines()
    info = InfoMetricFamily("osd_kernel", "osd's compiled CPU kernels: the path in use and the fallbacks taken.",
                            value={"path": kernel_path(status), "fallback": ",".join(status["fallback"]),
                                   "avx512_vnni": str(bool(status.get("avx512_vnni"))).lower(),
                                   "error": error[0][:200] if error else ""})
    fallback = GaugeMetricFamily("osd_kernel_fallback", "1 for each use running on torch's kernels instead of osd's.",
                                 labels=["use"])
    for use in status["fallback"]:
        fallback.add_metric([use], 1)
    return [info, fallback]
