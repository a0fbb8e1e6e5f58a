"""/metrics of the whole cluster at the front: each replica's and the learner's own Prometheus text, parsed with
prometheus_client and re-exposed with a `replica` label ("0", "1", ..., "learner"), one family per name."""
from __future__ import annotations

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


def relabelled(texts: dict[str, str]) -> list[Metric]:
    """{replica label: exposition text} -> merged metric families, every sample labelled with its replica."""
    merged: dict[str, Metric] = {}
    for label, text in texts.items():
        for family in text_string_to_metric_families(text):
            out = merged.get(family.name)
            if out is None:
                out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                out.add_sample(s.name, {**s.labels, "replica": label}, s.value, s.timestamp, s.exemplar)
    return list(merged.values())


class ClusterCollector:
    """Collector over the texts the pool last fetched (fetching is the pool's, off the request path)."""

    def __init__(self, texts):
        self.texts = texts  # () -> {label: text}

    def collect(self):
        yield from relabelled(self.texts())
