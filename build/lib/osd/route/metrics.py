"""/metrics series of the router and the drafts (a prometheus_client collector over Routing, read at scrape time).

  osd_draft_version{draft}                          gauge: the draft's published version
  osd_route_decisions_total{draft,reason}           requests served per draft and reason (pinned/explore/routed/cold)
  osd_route_owned_total{draft}                      requests each draft learnt from (the owner of their mode)
  osd_route_explored_total, osd_route_routed_total  exploration share = explored / routed (bounded by --explore)
  osd_route_seconds_total                           featurising + deciding
  osd_route_scored_requests_total                   requests on which every draft was scored
  osd_route_served_best_total                       ... of which the serving draft scored best (router accuracy)
  osd_route_regret_sum_total                        sum over scored requests of best - served acceptance
  osd_route_score_seconds_total, osd_route_scores_dropped_total
  osd_drafts_bytes{part}                            master / serving / total / one_draft tensor bytes
  osd_draft_scored_acceptance_sum_total{draft}, osd_draft_scored_requests_total{draft}   mean = sum / requests
  osd_draft_learner_<stat>{draft}                   each draft's learner counters (version, buffer, updates, ...)
Live acceptance per draft and version is osd_spec_*{draft,draft_version} (serve/prom.py): the served draft's
name is the engine's draft label.
"""
from __future__ import annotations

import math

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from osd.serve.prom import LEARNER_GAUGES


class RouteCollector:
    def __init__(self, routing):
        self.routing = routing

    def collect(self):
        r = self.routing
        version = GaugeMetricFamily("osd_draft_version", "Published version of each draft.", labels=["draft"])
        for name, v in sorted(r.versions().items()):
            version.add_metric([name], v)
        yield version
        router = r.router.stats()
        decisions = CounterMetricFamily("osd_route_decisions", "Requests served per draft and routing reason.",
                                        labels=["draft", "reason"])
        for reason, by_draft in router["decisions"].items():
            for name, n in sorted(by_draft.items()):
                decisions.add_metric([name, reason], n)
        yield decisions
        owned = CounterMetricFamily("osd_route_owned", "Requests each draft learnt from (their mode's owner).",
                                    labels=["draft"])
        for name, n in sorted(router["owned"].items()):
            owned.add_metric([name], n)
        yield owned
        yield CounterMetricFamily("osd_route_explored", "Requests routed off the router's choice.", value=router["explored"])
        yield CounterMetricFamily("osd_route_routed", "Requests routed (not pinned).", value=router["routed"])
        yield CounterMetricFamily("osd_route_seconds", "Seconds featurising and deciding.", value=router["route_seconds"])
        feedback = r.feedback.stats()
        for key, name, text in (("scored", "scored_requests", "Requests on which every draft was scored."),
                                ("served_best", "served_best", "Scored requests whose serving draft scored best."),
                                ("regret_sum", "regret_sum", "Sum of best minus served acceptance on scored requests."),
                                ("score_seconds", "score_seconds", "Seconds scoring drafts."),
                                ("dropped", "scores_dropped", "Scoring jobs dropped (queue full or failed).")):
            yield CounterMetricFamily(f"osd_route_{name}", text, value=feedback[key])
        sums = CounterMetricFamily("osd_draft_scored_acceptance_sum", "Sum of scored acceptances.", labels=["draft"])
        counts = CounterMetricFamily("osd_draft_scored_requests", "Requests each draft was scored on.", labels=["draft"])
        for name, (total, n) in sorted(feedback["scored_alpha_sums"].items()):
            sums.add_metric([name], total)
            counts.add_metric([name], n)
        yield sums
        yield counts
        sizes = GaugeMetricFamily("osd_drafts_bytes", "Tensor bytes of the drafts: master (base + adapters), serving "
                                  "copies, total, and one_draft (one draft without adapters, for the ratio).", labels=["part"])
        for part, value in sorted(r.drafts.tensor_bytes().items()):
            if isinstance(value, (int, float)):
                sizes.add_metric([part], value)
        yield sizes
        if r.learners is not None:
            yield from learner_families_by_draft(r.learners.stats()["by_draft"])


def learner_families_by_draft(by_draft: dict[str, dict]) -> list:
    """Each draft's numeric learner stats, labelled by draft (gauges for LEARNER_GAUGES, counters otherwise)."""
    keys = sorted({k for stats in by_draft.values() for k, v in stats.items() if _number(v) is not None})
    families = []
    for key in keys:
        name = "osd_draft_learner_" + "".join(ch if ch.isalnum() else "_" for ch in key)
        kind = GaugeMetricFamily if key in LEARNER_GAUGES else CounterMetricFamily
        family = kind(name, f"Learner stat {key} per draft.", labels=["draft"])
        for draft, stats in sorted(by_draft.items()):
            value = _number(stats.get(key))
            if value is not None:
                family.add_metric([draft], value)
        families.append(family)
    return families


def _number(value):
    if isinstance(value, bool):
        return int(value)
    return value if isinstance(value, (int, float)) and math.isfinite(value) else None
