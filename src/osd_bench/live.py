"""`osd bench live`: does a serving osd get faster on the traffic it serves, and what does learning cost meanwhile?

Two `osd serve` processes started the same way except learning (on / off) are fed the same timestamped request
stream, one after the other on the same machine, each alone (arms: `--order`). Arrivals are Poisson at
`load` x capacity requests/s (seeded: `arrival_schedule`), capacity measured first by a short closed-loop run on a
learning-off server (`--capacity-requests` requests from past the stream's end, `max_batch` clients) or given by
`--capacity`. Every request is a streamed greedy chat completion; the client records its TTFT, its decode tokens/s
(tokens after the first / seconds after the first) and the server's own `osd` figures for it (acceptance, steps,
tokens per step, draft version); /metrics is scraped every `--scrape-every` seconds for the learner's optimizer
steps, versions and seconds (learn/budget.py: under load and idle) against serving's.

Per window of `--window` requests (in arrival order) and arm: mean per-request decode tokens/s, TTFT p50, aggregate
tokens/s (window's tokens over its first arrival -> last completion), acceptance, tokens per step, mean k, the newest
draft version served, the learner's optimizer steps and CPU share in the window's span. The headline is the ratio
learning-on / learning-off of the mean decode tokens/s per window (the same requests in both arms), its first and
last quarter, and whether every greedy answer is identical between the arms; a PNG plots both curves and the ratio.
The stream is a dataset name (shared/datasets, `--split`) or a JSONL file of {"prompt": ...} records (`--stream
FILE`); records that all carry "arrival_s" are replayed at those times instead of Poisson arrivals.
`--interleave N` (noise): both servers up at once and the stream fed in blocks of N requests, each block to one arm
and then to the other (the arm that goes first alternates: off-on, on-off, ...), the learning arm's learner paused
(POST /v1/osd/learner) while the other serves; each arm's clock (its rows' and scrapes' times) runs during its own
blocks only. A slow spell of this shared VM then falls on both arms within minutes of each other instead of on one
whole arm: run one after the other, two servers that differed in nothing that matters differed by up to 17% per
window (docs/learning.md). What it changes: a block's requests drain before the next block starts (at 0.5 of
capacity ~2-3 requests are in flight at a block's boundary), and while paused the learner does not learn but its
samples keep ageing (learn/buffer.py counts their age in wall seconds).
Limitations: the capacity is a closed-loop rate at `max_batch` clients on the first arm's configuration (learning
off): an open-loop stream at load 1.0 would queue without bound. Windows overlap in time when requests do.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import asdict, dataclass, field

from osd_bench.serve_load import _client, _request_body, _set_learning, one_request, percentile

WARM_UP_PROMPT = "Write a haiku about the sea."  # not from any stream
LEARNER_SERIES = {  # /metrics sample -> short name (learn/online.py stats, learn/budget.py counters)
    "osd_learner_optimizer_steps_total": "optimizer_steps", "osd_learner_updates_published_total": "published",
    "osd_learner_updates_rejected_total": "rejected", "osd_learner_version": "version",
    "osd_learner_learner_busy_seconds_total": "learner_busy_seconds",
    "osd_learner_learner_idle_seconds_total": "learner_idle_seconds",
    "osd_learner_serving_seconds_total": "serving_seconds",
    "osd_learner_buffer_evicted_unused_total": "evicted_unused", "osd_schedule_step_seconds_total": "step_seconds",
    # the drift guard's latest same-positions comparison on held-out requests: what learning gained, as it went
    "osd_learner_heldout_agreement_base": "heldout_agreement_base",
    "osd_learner_heldout_agreement_serving": "heldout_agreement_serving",
    "osd_learner_update_every_requests": "update_every_requests",  # the pace: longer while updates stop paying
    "osd_learner_chunks_under_load_total": "chunks_under_load", "osd_learner_chunks_idle_total": "chunks_idle",
    # where a step's seconds go, for both arms (a learning server's passes, rows and drafting against the other's)
    "osd_schedule_steps_total": "passes", "osd_schedule_rows_total": "rows",
    "osd_schedule_prefill_rows_total": "prompt_rows",
    "osd_schedule_decode_seconds_total": "decode_seconds", "osd_schedule_speculable_seconds_total": "speculable_seconds",
    "osd_spec_draft_seconds_total": "draft_seconds"}
# an update's work by phase (learn/online.py UPDATE_PHASES), matched by name: the bench's client never loads torch
WORK_PREFIX, WORK_SUFFIX = "osd_learner_work_seconds_", "_total"
SUMMED = {"draft_seconds"}  # labelled per draft version: summed over the labels


@dataclass
class LiveConfig:
    models: str = "bundled"  # tiny | bundled (osd_bench/soak_server.py model_pair)
    stream: str = "code"  # dataset name or JSONL path
    split: str = "test"
    requests: int = 300
    offset: int = 0
    loads: tuple[float, ...] = (0.5,)  # arrival rate as a fraction of the capacity
    capacity: float = 0.0  # requests/s; 0 = measure
    capacity_requests: int = 16
    window: int = 25
    max_tokens: int = 128
    seed: int = 0
    osd_args: tuple[str, ...] = ()  # `osd serve` flags for both arms
    learn_args: tuple[str, ...] = ()  # ... for the learning arm only (e.g. --busy-share 0.1)
    order: str = "off-on"  # off-on | on-off: which arm runs first at each load
    scrape_every: float = 5.0
    max_batch: int = 8  # the servers' --max-batch (osd serve's default): the capacity run's clients
    arms_run: tuple[str, ...] = field(default=("off", "on"))
    interleave: int = 0  # requests per block, both servers up, arms alternating by block (0: one, then the other)
    same_calibration: bool = False  # interleaved: both servers decide k from the first one's measured costs


def arrival_schedule(n: int, rate: float, seed: int) -> list[float]:
    """n Poisson arrival times (seconds from the start) at `rate` requests/s: the same seed, the same schedule."""
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def load_stream(stream: str, split: str, n: int, offset: int = 0) -> list[dict]:
    """n records {"prompt", optional "arrival_s"} from a dataset name or a JSONL file (osd/data.py load_records)."""
    from osd.data import load_records
    from osd.errors import InvalidArgument

    from pathlib import Path

    records = load_records(stream, None if Path(stream).is_file() else split, n, offset)  # a file: every record
    if len(records) < n:
        raise InvalidArgument(f"stream {stream!r} has {len(records)} prompts past offset {offset}, {n} asked")
    return records


def decode_tps(sample) -> float | None:
    """A request's decode speed: tokens after the first over the seconds after the first."""
    if not sample.ok or sample.ttft is None or sample.completion_tokens < 2 or sample.seconds <= sample.ttft:
        return None
    return (sample.completion_tokens - 1) / (sample.seconds - sample.ttft)


def series_of_phase(name: str) -> str | None:
    """osd_learner_work_seconds_<phase>_total -> work_<phase>; None for any other name."""
    if name.startswith(WORK_PREFIX) and name.endswith(WORK_SUFFIX) and len(name) > len(WORK_PREFIX + WORK_SUFFIX):
        return "work_" + name[len(WORK_PREFIX):-len(WORK_SUFFIX)]
    return None


async def scrape(client) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = await client.get("/metrics")
        r.raise_for_status()
    except Exception:  # a failed scrape is a gap, not a failed run
        return {}
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            key = LEARNER_SERIES.get(s.name) or series_of_phase(s.name)
            if key is not None:
                out[key] = out.get(key, 0.0) + s.value if key in SUMMED else s.value
    return out


async def replay_async(url: str, api_key: str | None, prompts: list[str], arrivals: list[float], max_tokens: int,
                       scrape_every: float, warm_up: bool = True) -> dict:
    """Send prompt i at arrivals[i] (seconds after the start), all streamed and greedy -> per-request rows and the
    /metrics scrapes (t: seconds after the start)."""
    async with _client(url, api_key, 3600.0, 256) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        if warm_up:
            await one_request(client, *_request_body(model, WARM_UP_PROMPT, 8, True))  # not counted
        rows: list[dict | None] = [None] * len(prompts)
        scrapes: list[dict] = []
        start = time.perf_counter()

        async def send(i: int) -> None:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            sent = time.perf_counter() - start
            s = await one_request(client, *_request_body(model, prompts[i], max_tokens, True))
            o = s.osd or {}
            rows[i] = {"index": i, "arrival": arrivals[i], "sent": sent, "done": time.perf_counter() - start,
                       "ok": s.ok, "error": s.error, "ttft": s.ttft, "seconds": s.seconds,
                       "completion_tokens": s.completion_tokens, "decode_tps": decode_tps(s), "text": s.text,
                       **{k: o.get(k) for k in ("accepted", "proposed", "steps", "tokens_per_step", "draft_version")}}

        async def scraper(done: asyncio.Event) -> None:
            while not done.is_set():
                scrapes.append({"t": time.perf_counter() - start, **await scrape(client)})
                try:
                    await asyncio.wait_for(done.wait(), scrape_every)
                except asyncio.TimeoutError:
                    pass
            scrapes.append({"t": time.perf_counter() - start, **await scrape(client)})

        done = asyncio.Event()
        scraping = asyncio.create_task(scraper(done))
        await asyncio.gather(*(send(i) for i in range(len(prompts))))
        done.set()
        await scraping
    return {"rows": rows, "scrapes": scrapes, "wall_seconds": time.perf_counter() - start}


async def capacity_async(url: str, api_key: str | None, prompts: list[str], max_tokens: int, clients: int) -> dict:
    """Closed loop: `clients` clients, each sending its next prompt when its last one ends -> requests/s."""
    async with _client(url, api_key, 3600.0, clients + 2) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await one_request(client, *_request_body(model, WARM_UP_PROMPT, 8, True))
        todo = list(prompts)
        samples = []

        async def loop():
            while todo:
                samples.append(await one_request(client, *_request_body(model, todo.pop(0), max_tokens, True)))

        start = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(clients)))
        wall = time.perf_counter() - start
    ok = [s for s in samples if s.ok]
    return {"requests_per_s": len(ok) / wall, "requests": len(samples), "errors": len(samples) - len(ok),
            "wall_seconds": wall, "tokens_per_s": sum(s.completion_tokens for s in ok) / wall, "clients": clients}


def _at(scrapes: list[dict], t: float, key: str) -> float | None:
    """A counter's value at time t, linearly between the scrapes around it (None without data)."""
    points = [(s["t"], s[key]) for s in scrapes if key in s]
    if not points:
        return None
    if t <= points[0][0]:
        return points[0][1]
    for (t0, v0), (t1, v1) in zip(points, points[1:]):
        if t <= t1:
            return v0 + (v1 - v0) * ((t - t0) / (t1 - t0) if t1 > t0 else 1.0)
    return points[-1][1]


def _delta(scrapes, t0, t1, key) -> float | None:
    a, b = _at(scrapes, t0, key), _at(scrapes, t1, key)
    return None if a is None or b is None else b - a


def summarise_rows(rows: list[dict], scrapes: list[dict]) -> dict:
    """One window's (or a quarter's) figures from its requests' rows and the scrapes over its span."""
    ok = [r for r in rows if r and r["ok"]]
    tps = [r["decode_tps"] for r in ok if r["decode_tps"] is not None]
    proposed, accepted = sum(r["proposed"] or 0 for r in ok), sum(r["accepted"] or 0 for r in ok)
    steps, tokens = sum(r["steps"] or 0 for r in ok), sum(r["completion_tokens"] for r in ok)
    t0, t1 = min((r["arrival"] for r in rows if r), default=0.0), max((r["done"] for r in ok), default=0.0)
    span = t1 - t0
    learner = [_delta(scrapes, t0, t1, k) for k in ("learner_busy_seconds", "learner_idle_seconds")]
    serving = _delta(scrapes, t0, t1, "serving_seconds")
    learner_seconds = sum(x for x in learner if x is not None) if any(x is not None for x in learner) else None
    passes, pass_seconds = _delta(scrapes, t0, t1, "passes"), _delta(scrapes, t0, t1, "step_seconds")
    rows_fed, draft_seconds = _delta(scrapes, t0, t1, "rows"), _delta(scrapes, t0, t1, "draft_seconds")
    prompt_rows = _delta(scrapes, t0, t1, "prompt_rows")
    decoding, speculable = _delta(scrapes, t0, t1, "decode_seconds"), _delta(scrapes, t0, t1, "speculable_seconds")
    return {"requests": len(rows), "errors": len(rows) - len(ok),
            "decode_tps_mean": sum(tps) / len(tps) if tps else None, "decode_tps_p50": percentile(tps, 50),
            "ttft_p50": percentile([r["ttft"] for r in ok if r["ttft"] is not None], 50),
            "aggregate_tps": tokens / span if span > 0 else None,
            "acceptance": accepted / proposed if proposed else None, "tokens_per_step": tokens / steps if steps else None,
            "mean_k": proposed / steps if steps else None,
            "draft_version": max((r["draft_version"] or 0 for r in ok), default=None),
            "optimizer_steps": _delta(scrapes, t0, t1, "optimizer_steps"),
            "learner_cpu_share": learner_seconds / span if learner_seconds is not None and span > 0 else None,
            "learner_busy_share": (learner[0] / (learner[0] + serving) if learner[0] is not None and serving
                                   else None), "span_seconds": span,
            # the target's passes: rows each (decode, proposals and prompt chunks), prompt rows each (whether a
            # server's dearer passes carried its proposals or its prompts), milliseconds each; drafting's seconds as
            # a share of the span
            "rows_per_pass": rows_fed / passes if passes and rows_fed is not None else None,
            "prompt_rows_per_pass": prompt_rows / passes if passes and prompt_rows is not None else None,
            "pass_ms": 1e3 * pass_seconds / passes if passes and pass_seconds is not None else None,
            # of the passes' decoding seconds, the share where a sequence may propose (none beside prompt rows)
            "speculable_share": speculable / decoding if decoding and speculable is not None else None,
            "draft_share": draft_seconds / span if draft_seconds is not None and span > 0 else None}


def windows(rows: list[dict], scrapes: list[dict], size: int) -> list[dict]:
    return [{"first": i, **summarise_rows(rows[i:i + size], scrapes)} for i in range(0, len(rows), size)]


def first_publish(rows: list[dict], scrapes: list[dict]) -> dict:
    """When the learner first published: the scrape time, the requests arrived by then, and the first request served
    by a version > 0."""
    t = next((s["t"] for s in scrapes if (s.get("published") or 0) >= 1), None)
    served = next((r["index"] for r in rows if r and (r["draft_version"] or 0) > 0), None)
    return {"seconds": t, "requests_arrived": None if t is None else sum(r["arrival"] <= t for r in rows if r),
            "first_request_served_by_a_new_version": served}


def paired_interval(on: list[float | None], off: list[float | None], statistic, block: int = 1, seed: int = 0,
                    draws: int = 2000, level: float = 0.95) -> list[float] | None:
    """A paired block-bootstrap interval of statistic(on values, off values): blocks of `block` consecutive
    requests are resampled with replacement, the same requests for both arms (a hard prompt is slow on both), `draws`
    times -> [low, high] at `level` (None with fewer than 2 blocks). Blocks, not requests: the machine's slow
    spells last many requests, and two identical servers interleaved by 25 (code200-load05-il25-a-a) gave a last
    quarter of 0.91x whose request-resampled interval, 0.89-0.94, left out 1; resampling the blocks of 25 over the
    whole run gives 0.92-1.03 for its paired ratio."""
    pairs = [(a, b) for a, b in zip(on, off) if a is not None and b is not None and b > 0]
    blocks = [pairs[i : i + block] for i in range(0, len(pairs), max(1, block))]
    if len(blocks) < 2:
        return None
    rng, values = random.Random(seed), []
    for _ in range(draws):
        sample = [pair for _ in blocks for pair in blocks[rng.randrange(len(blocks))]]
        values.append(statistic([a for a, _ in sample], [b for _, b in sample]))
    tail = (1 - level) / 2 * 100
    return [percentile(values, tail), percentile(values, 100 - tail)]


def ratio_of_means(on: list[float], off: list[float]) -> float:
    return (sum(on) / len(on)) / (sum(off) / len(off))


def median_ratio(on: list[float], off: list[float]) -> float:
    return percentile([a / b for a, b in zip(on, off)], 50)


def compare(on: dict, off: dict, window: int, block: int = 0) -> dict:
    """Learning on / off: the headline ratios per window and quarter, and greedy identity request by request
    (block: the requests the noise is resampled by, the interleave's; 0: the window's)."""
    block = block or window
    n = len(on["rows"])
    ratio = lambda a, b: a / b if a is not None and b else None
    per_window = [{"first": w_on["first"], "decode_tps_ratio": ratio(w_on["decode_tps_mean"], w_off["decode_tps_mean"]),
                   "aggregate_tps_ratio": ratio(w_on["aggregate_tps"], w_off["aggregate_tps"])}
                  for w_on, w_off in zip(on["windows"], off["windows"])]
    q = max(1, n // 4)
    quarter = lambda arm, lo, hi: summarise_rows(arm["rows"][lo:hi], arm["scrapes"])["decode_tps_mean"]
    first_q, last_q = ratio(quarter(on, 0, q), quarter(off, 0, q)), ratio(quarter(on, n - q, n), quarter(off, n - q, n))
    paired = [a["decode_tps"] / b["decode_tps"] for a, b in zip(on["rows"], off["rows"])
              if a and b and a["decode_tps"] and b["decode_tps"]]
    same = sum(a is not None and b is not None and a["ok"] and b["ok"] and a["text"] == b["text"]
               for a, b in zip(on["rows"], off["rows"]))
    later = [w["decode_tps_ratio"] for w in per_window[1:] if w["decode_tps_ratio"] is not None]
    on_tps, off_tps = ([r["decode_tps"] if r and r["ok"] else None for r in arm["rows"]] for arm in (on, off))
    return {"windows": per_window, "first_quarter_ratio": first_q, "last_quarter_ratio": last_q,
            "min_ratio_after_first_window": min(later) if later else None,
            "paired_ratio_p50": percentile(paired, 50), "greedy_identical": {"same": same, "of": n},
            # over the whole run, 95% paired block-bootstrap intervals (blocks of the interleave, else of the window;
            # a quarter holds too few blocks for one): is the ratio within the machine's noise?
            "mean_ratio": ratio(quarter(on, 0, n), quarter(off, 0, n)),
            "mean_ratio_interval": paired_interval(on_tps, off_tps, ratio_of_means, block),
            "paired_ratio_p50_interval": paired_interval(on_tps, off_tps, median_ratio, block)}


def arm_args(config: LiveConfig, learning: bool) -> list[str]:
    return [*config.osd_args, *(config.learn_args if learning else ["--no-learn"])]


def finish_arm(result: dict, config: LiveConfig, learning: bool) -> dict:
    """An arm's rows and scrapes -> with its windows and (learning) its first publish."""
    result["windows"] = windows(result["rows"], result["scrapes"], config.window)
    result["first_publish"] = first_publish(result["rows"], result["scrapes"]) if learning else None
    return result


def run_arm(target: str, draft: str, config: LiveConfig, learning: bool, prompts: list[str], arrivals: list[float],
            log_path: str) -> dict:
    from osd_bench.soak_server import ServerProcess

    with ServerProcess(target, draft, 10_000_000, arm_args(config, learning), log_path) as server:
        started = time.perf_counter()
        result = asyncio.run(replay_async(server.url, server.api_key, prompts, arrivals, config.max_tokens,
                                          config.scrape_every))
        command = " ".join(server.command()[2:])
    result["server_command"] = command
    result["arm_seconds"] = time.perf_counter() - started
    result["calibration"] = calibration_of(log_path)
    return finish_arm(result, config, learning)


def calibration_of(log_path: str) -> str | None:
    """The server's startup calibration line (engine.describe_calibration) from its log: two servers alike can measure
    their passes differently, and their k choices follow what they measured."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            return next((line[line.index("calibrated:"):].strip() for line in f if "calibrated:" in line), None)
    except OSError:
        return None


def block_arrivals(arrivals: list[float], lo: int, hi: int) -> list[float]:
    """Block [lo, hi)'s arrivals from the block's start: its first request after its own gap from the one before."""
    start = arrivals[lo - 1] if lo else 0.0
    return [t - start for t in arrivals[lo:hi]]


def block_order(block: int) -> tuple[str, str]:
    return ("off", "on") if block % 2 == 0 else ("on", "off")


def append_block(arm: dict, block: dict, lo: int) -> None:
    """One block's rows and scrapes onto an arm's, on the arm's own clock (its earlier blocks' seconds first)."""
    shift = arm["wall_seconds"]
    for i, row in enumerate(block["rows"]):
        arm["rows"].append({**row, "index": lo + i, "sent": row["sent"] + shift, "done": row["done"] + shift,
                            "arrival": row["arrival"] + shift})
    arm["scrapes"] += [{**s, "t": s["t"] + shift} for s in block["scrapes"]]
    arm["wall_seconds"] += block["wall_seconds"]


def block_line(on_rows: list[dict], off_rows: list[dict]) -> str:
    """One block's progress line: each arm's mean decode tokens/s (summarise_rows, as the windows have it), their
    ratio, the learning arm's draft version."""
    on, off = summarise_rows(on_rows, []), summarise_rows(off_rows, [])
    if not on["decode_tps_mean"] or not off["decode_tps_mean"]:
        return "no decode speed measured in this block"
    return (f"decode {on['decode_tps_mean']:.2f} tokens/s learning on (draft v{on['draft_version']}), "
            f"{off['decode_tps_mean']:.2f} off: {on['decode_tps_mean'] / off['decode_tps_mean']:.2f}x")


def set_learner_paused(server, paused: bool) -> None:
    async def pause() -> None:
        async with _client(server.url, server.api_key, 60.0, 1) as client:
            await _set_learning(client, not paused)

    asyncio.run(pause())


def run_interleaved(target: str, draft: str, config: LiveConfig, prompts: list[str], arrivals: list[float],
                    log_dir: str, load: float, progress=print) -> dict:
    """Both arms, block by block (module docstring: --interleave) -> {"off": arm, "on": arm}."""
    from pathlib import Path

    from osd_bench.soak_server import ServerProcess

    shared = []
    if config.same_calibration:  # the off server measures and writes it, the on server (started after) reads it
        path = Path(log_dir) / f"calibration-load{load}.json"
        path.unlink(missing_ok=True)  # (never an earlier run's)
        shared = ["--calibration", str(path)]
    off_args, on_args = arm_args(config, False) + shared, arm_args(config, True) + shared
    with ServerProcess(target, draft, 10_000_000, off_args, f"{log_dir}/load{load}-off.log") as off, \
            ServerProcess(target, draft, 10_000_000, on_args, f"{log_dir}/load{load}-on.log") as on:
        servers = {"off": off, "on": on}
        pausable = "--no-learn" not in on_args  # (a ceiling run: both arms not learning, drafts differ)
        arms = {name: {"rows": [], "scrapes": [], "wall_seconds": 0.0} for name in servers}
        blocks = range(0, len(prompts), config.interleave)
        for b, lo in enumerate(blocks):
            hi = min(len(prompts), lo + config.interleave)
            progress(f"block {b + 1}/{len(blocks)}: requests {lo}-{hi - 1}, {' then '.join(block_order(b))}")
            for name in block_order(b):
                if pausable:
                    set_learner_paused(on, name != "on")
                server = servers[name]
                block = asyncio.run(replay_async(server.url, server.api_key, prompts[lo:hi],
                                                 block_arrivals(arrivals, lo, hi), config.max_tokens,
                                                 config.scrape_every, warm_up=b == 0))
                append_block(arms[name], block, lo)
            progress("  " + block_line(arms["on"]["rows"][lo:hi], arms["off"]["rows"][lo:hi]))
        if pausable:
            set_learner_paused(on, False)
        for name, server in servers.items():
            arms[name]["server_command"] = " ".join(server.command()[2:])
            arms[name]["calibration"] = calibration_of(f"{log_dir}/load{load}-{name}.log")
            arms[name]["arm_seconds"] = arms[name]["wall_seconds"]  # its own blocks' seconds, not the other arm's
    return {name: finish_arm(arm, config, name == "on") for name, arm in arms.items()}


def measure_capacity(target: str, draft: str, config: LiveConfig, log_path: str) -> dict:
    from osd_bench.soak_server import ServerProcess

    from osd.errors import InvalidArgument

    try:  # prompts from past the stream's end, so that neither arm's server saw them; else the stream's first ones
        extra = load_stream(config.stream, config.split, config.capacity_requests, config.offset + config.requests)
    except InvalidArgument:
        extra = load_stream(config.stream, config.split, config.capacity_requests, config.offset)
    with ServerProcess(target, draft, 10_000_000, [*config.osd_args, "--no-learn"], log_path) as server:
        return asyncio.run(capacity_async(server.url, server.api_key, [r["prompt"] for r in extra],
                                          config.max_tokens, config.max_batch))


def run_live(config: LiveConfig, log_dir: str = "runs/bench-live", progress=print) -> dict:
    from pathlib import Path

    from osd_bench.soak_server import model_pair

    target, draft = model_pair(config.models)
    records = load_stream(config.stream, config.split, config.requests, config.offset)
    prompts = [r["prompt"] for r in records]
    given = [r.get("arrival_s") for r in records]
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    capacity = {"requests_per_s": config.capacity, "given": True} if config.capacity else \
        measure_capacity(target, draft, config, f"{log_dir}/capacity.log")
    progress(f"capacity: {capacity['requests_per_s']:.3f} requests/s")
    loads = []
    for load in config.loads:
        rate = load * capacity["requests_per_s"]
        arrivals = [float(t) for t in given] if all(t is not None for t in given) else \
            arrival_schedule(len(prompts), rate, config.seed)
        if config.interleave:
            progress(f"load {load}: both arms in blocks of {config.interleave}, {len(prompts)} requests at "
                     f"{rate:.3f}/s ...")
            arms = run_interleaved(target, draft, config, prompts, arrivals, log_dir, load, progress)
        else:
            arms = {}
            for arm in ("off", "on") if config.order == "off-on" else ("on", "off"):
                if arm in config.arms_run:
                    progress(f"load {load}: learning {arm}, {len(prompts)} requests at {rate:.3f}/s ...")
                    arms[arm] = run_arm(target, draft, config, arm == "on", prompts, arrivals,
                                        f"{log_dir}/load{load}-{arm}.log")
        entry = {"load": load, "rate_per_s": rate, "arrivals": arrivals, "arms": arms}
        if "on" in arms and "off" in arms:
            entry["comparison"] = compare(arms["on"], arms["off"], config.window, config.interleave)
        loads.append(entry)
    return {"config": {**asdict(config), "target": target, "draft": draft}, "capacity": capacity, "loads": loads}


def register(bench) -> None:
    p = bench.add_parser("live", help="learning on vs off: two `osd serve`s fed the same Poisson request stream at a "
                         "fraction of capacity, one after the other; per window decode tokens/s, TTFT, acceptance, "
                         "draft version, the learner's steps and CPU share; the on/off ratio and a plot")
    p.add_argument("--stream", default="code", help="dataset name (shared/datasets) or a JSONL file of {\"prompt\"} "
                   "records (all with \"arrival_s\": replayed at those times)")
    p.add_argument("--split", default="test")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--offset", type=int, default=0, help="skip this many prompts of the stream")
    p.add_argument("--load", type=float, nargs="+", default=[0.5], help="arrival rate(s) as a fraction of capacity")
    p.add_argument("--capacity", type=float, default=0.0, help="requests/s at saturation (0 = measure it first: "
                   "--capacity-requests prompts from past the stream's end, --max-batch clients, learning off)")
    p.add_argument("--capacity-requests", type=int, default=16)
    p.add_argument("--window", type=int, default=25, help="requests per window")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help="the arrival schedule's seed")
    p.add_argument("--models", default="bundled", choices=["bundled", "tiny"])
    p.add_argument("--osd-args", default="", help="`osd serve` flags for both arms (one string)")
    p.add_argument("--learn-args", default="", help="more flags for the learning arm only (one string)")
    p.add_argument("--order", default="off-on", choices=["off-on", "on-off"])
    p.add_argument("--interleave", type=int, default=0, help="both servers up, the stream fed in blocks of this many "
                   "requests to one arm then the other (alternating which first), the learner paused while the other "
                   "serves: a slow spell of the machine falls on both arms alike (0 = one arm, then the other)")
    p.add_argument("--same-calibration", action="store_true",
                   help="with --interleave: both servers decide k from one measurement of the costs (the learning-off "
                   "server's, `osd serve --calibration`), not each its own; only where both arms serve drafts of the "
                   "same cost")
    p.add_argument("--arms", nargs="+", default=["off", "on"], choices=["off", "on"])
    p.add_argument("--scrape-every", type=float, default=5.0)
    p.add_argument("--max-batch", type=int, default=8, help="the capacity run's clients (osd serve's --max-batch)")
    p.add_argument("--log-dir", default="runs/bench-live")
    p.add_argument("--out", default="benchmarks/live/bench-live.json")
    p.add_argument("--markdown", default="", help="also append the tables to this markdown file (default: none)")
    p.add_argument("--recompare", nargs="+", metavar="FILE", default=None, help="run nothing: recompute the on/off "
                   "comparison (ratios, bootstrap intervals) of these result files from their stored requests")
    p.set_defaults(func=_cmd)


def recompare(path: str) -> dict:
    """A live result file's comparisons made again from its stored rows by this revision's `compare` (marked in
    the file as `comparison_recomputed`); nothing is run."""
    import json
    from pathlib import Path

    from osd.records import read_result
    from osd.revision import git_revision

    result = read_result(path, needs=("config", "loads"))
    cfg = result["config"]
    for entry in result["loads"]:
        if "on" in entry["arms"] and "off" in entry["arms"]:
            entry["comparison"] = compare(entry["arms"]["on"], entry["arms"]["off"], cfg["window"],
                                          cfg.get("interleave") or 0)
    result["comparison_recomputed"] = {"git_revision": git_revision(),
                                       "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(path).write_text(json.dumps(result, indent=2, default=str))
    return result


def _cmd(args) -> None:
    import shlex

    from osd_bench.live_report import headline, report_live

    if args.recompare:
        for path in args.recompare:
            for entry in recompare(path)["loads"]:
                print(f"{path}: {headline(entry)}")
        return

    config = LiveConfig(args.models, args.stream, args.split, args.requests, args.offset, tuple(args.load),
                        args.capacity, args.capacity_requests, args.window, args.max_tokens, args.seed,
                        tuple(shlex.split(args.osd_args)), tuple(shlex.split(args.learn_args)), args.order,
                        args.scrape_every, args.max_batch, tuple(args.arms), args.interleave, args.same_calibration)
    result = run_live(config, args.log_dir, progress=lambda line: print(line, flush=True))  # (seen in a log too)
    report_live(result, args.out, args.markdown)
