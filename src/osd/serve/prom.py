"""GET /metrics: Prometheus text exposition, no extra dependency.

Counters first; rates are the scraper's to derive:
  osd_http_requests_total{endpoint,status}           answered requests
  osd_prompt_tokens_total, osd_completion_tokens_total
  osd_spec_{requests,steps,proposed,accepted,emitted}_total{draft,draft_version}
  osd_spec_beta_sum_total, osd_spec_beta_n_total      alpha = beta_sum / beta_n
  osd_spec_{proposed,accepted}_at_total{draft,draft_version,position}   per-position acceptance
  osd_spec_{draft,target}_seconds_total
  osd_request_seconds, osd_time_to_first_token_seconds, osd_time_per_output_token_seconds  histograms
  osd_queue_depth, osd_learner_<stat>                  gauges
"""
from __future__ import annotations

import bisect
import math
import logging
import threading
from collections import Counter

log = logging.getLogger("osd.serve")

REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_text, tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # last slot: above the largest bucket
        self.sum, self.n = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.n += 1

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            out.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        out += [f'{self.name}_bucket{{le="+Inf"}} {self.n}', f"{self.name}_sum {self.sum}", f"{self.name}_count {self.n}"]
        return out


class ServeMetrics:
    """HTTP-level counters and latency histograms (the engine keeps the speculative counters)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: Counter[tuple[str, int]] = Counter()
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.request_seconds = Histogram("osd_request_seconds", "Request latency, arrival to last token.", REQUEST_BUCKETS)
        self.ttft = Histogram("osd_time_to_first_token_seconds", "Arrival to first streamed text.", REQUEST_BUCKETS)
        self.tpot = Histogram("osd_time_per_output_token_seconds", "Generation seconds per output token.", TOKEN_BUCKETS)

    def count(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, status)] += 1

    def observe(self, seconds: float, ttft: float | None, n_prompt: int, n_new: int, generation_seconds: float) -> None:
        with self._lock:
            self.prompt_tokens += n_prompt
            self.completion_tokens += n_new
            self.request_seconds.observe(seconds)
            if ttft is not None:
                self.ttft.observe(ttft)
            if n_new:
                self.tpot.observe(generation_seconds / n_new)

    def render(self, spec_metrics, learner=None, queue_depth: int = 0) -> str:
        with self._lock:
            lines = _family("osd_http_requests_total", "counter", "Answered HTTP requests.",
                            [({"endpoint": e, "status": s}, n) for (e, s), n in sorted(self.requests.items())])
            lines += _family("osd_prompt_tokens_total", "counter", "Prompt tokens of completed requests.", [({}, self.prompt_tokens)])
            lines += _family("osd_completion_tokens_total", "counter", "Generated tokens.", [({}, self.completion_tokens)])
            for h in (self.request_seconds, self.ttft, self.tpot):
                lines += h.lines()
        lines += _family("osd_queue_depth", "gauge", "Requests waiting for the model.", [({}, queue_depth)])
        lines += spec_lines(spec_metrics)
        if learner is not None:
            try:
                lines += learner_lines(learner.stats())
            except Exception:  # a learner fault must not take /metrics down
                log.exception("learner.stats() failed")
        return "\n".join(lines) + "\n"


SPEC_COUNTERS = {  # SpecCounters field -> help
    "requests": "Requests served.", "steps": "Verification steps.", "proposed": "Draft tokens proposed.",
    "accepted": "Draft tokens accepted.", "emitted": "Tokens emitted (accepted + recovered + bonus).",
    "beta_sum": "Sum of exact per-position acceptance probabilities (alpha = beta_sum / beta_n).",
    "beta_n": "Positions summed in beta_sum.", "draft_seconds": "Seconds in draft proposals.",
    "target_seconds": "Seconds in target verification.",
}


def spec_lines(spec_metrics) -> list[str]:
    items = sorted(spec_metrics.counters().items())  # (draft name, version) -> SpecCounters
    labels = lambda key: {"draft": key[0], "draft_version": key[1]}
    lines = []
    for name, help_text in SPEC_COUNTERS.items():
        lines += _family(f"osd_spec_{name}_total", "counter", help_text, [(labels(k), getattr(c, name)) for k, c in items])
    for name in ("proposed_at", "accepted_at"):
        samples = [(labels(k) | {"position": i}, n) for k, c in items for i, n in enumerate(list(getattr(c, name)))]
        lines += _family(f"osd_spec_{name}_total", "counter", f"Draft tokens {name.split('_')[0]} at proposal position.", samples)
    return lines


def learner_lines(stats: dict) -> list[str]:
    lines = []
    for key, value in sorted(stats.items()):
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, (int, float)) and math.isfinite(value):
            name = "osd_learner_" + "".join(ch if ch.isalnum() else "_" for ch in key)
            lines += _family(name, "gauge", f"Learner stat {key}.", [({}, value)])
    return lines


def _family(name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]) -> list[str]:
    out = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
        out.append(f"{name}{{{label_text}}} {value}" if label_text else f"{name} {value}")
    return out


def _escape(value) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
