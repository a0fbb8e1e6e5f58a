"""`osd bench scale --faults`: the cluster under load through each fault, the way an operator would meet it: a Ray
cluster started apart (`ray start --head`), `osd serve --replicas 2 --ray-address auto` as its own process, streaming
clients, and in turn: no fault, kill -9 of a replica, of the learner, of the HTTP front (then started again). Per
phase: requests answered, failed with an error (and which), hung (no answer within the client's timeout: must be 0),
and whether the killed part came back (the replica on the newest version, the learner at its checkpoint's version
or later, the front finding the same actors)."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from osd_bench.llama_server import wait_healthy
from osd_bench.serve_load import _client

FAULTS = ("none", "replica", "learner", "front")


def metric(url: str, name: str, labels: dict | None = None) -> float | None:
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                return s.value
    return None


def start_front(command: list[str], url: str, log: Path) -> subprocess.Popen:
    process = subprocess.Popen(command, stdout=open(log, "a"), stderr=subprocess.STDOUT)
    wait_healthy(url, process, seconds=900)
    return process


def wait_until(predicate, seconds: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.5)
    return None


def run_faults(osd_args: list[str], prompts: list[str], per_phase: int, concurrency: int, max_tokens: int,
               port: int = 8795, client_timeout: float = 600.0, log_dir: Path | None = None) -> dict:
    bin_dir = Path(sys.executable).parent
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="osd-faults-"))
    url = f"http://127.0.0.1:{port}"
    command = [str(bin_dir / "osd"), "serve", "--replicas", "2", "--threads", "1", "--ray-address", "auto",
               "--port", str(port), "--checkpoint-dir", str(log_dir / "ckpt"), *osd_args]
    subprocess.run([str(bin_dir / "ray"), "start", "--head", f"--num-cpus={os.cpu_count()}", "--disable-usage-stats",
                    "--include-dashboard=false"], check=True, capture_output=True)
    phases, front = [], None
    try:
        front = start_front(command, url, log_dir / "front.log")
        for i, fault in enumerate(FAULTS):
            batch = prompts[i * per_phase: (i + 1) * per_phase]
            result: dict = {}
            load = threading.Thread(target=lambda: result.update(_load(url, batch, concurrency, max_tokens,
                                                                        client_timeout)))
            version_before = metric(url, "osd_cluster_publishes_total", {"replica": "learner"})
            load.start()
            time.sleep(8.0)  # the load is streaming when the fault strikes
            recovered = None
            if fault == "replica":
                pid = metric(url, "osd_replica_pid", {"replica": "1"})
                os.kill(int(pid), signal.SIGKILL)
                recovered = wait_until(lambda: (metric(url, "osd_replica_pid", {"replica": "1"}) or pid) != pid, 900)
            elif fault == "learner":
                pid = metric(url, "osd_cluster_pid", {"replica": "learner"})
                os.kill(int(pid), signal.SIGKILL)
                recovered = wait_until(lambda: (metric(url, "osd_cluster_pid", {"replica": "learner"}) or pid) != pid, 900)
            elif fault == "front":
                front.send_signal(signal.SIGKILL)
                front.wait()
                start = time.monotonic()
                front = start_front(command, url, log_dir / "front.log")
                recovered = time.monotonic() - start
            load.join()
            versions = {r: metric(url, "osd_replica_draft_version", {"replica": r}) for r in ("0", "1")}
            phases.append({"fault": fault, **result, "recovered_seconds": recovered, "replica_versions": versions,
                           "learner_version": metric(url, "osd_learner_version", {"replica": "learner"}),
                           "publishes_before": version_before})
            print(f"  fault {fault:8s}: {result['ok']} answered, {result['errors']} errors, {result['hung']} hung, "
                  f"back in {recovered if recovered is not None else '-'} s, versions {versions}", flush=True)
    finally:
        if front is not None and front.poll() is None:
            front.send_signal(signal.SIGINT)
            try:
                front.wait(60)
            except subprocess.TimeoutExpired:
                front.kill()
        subprocess.run([str(bin_dir / "ray"), "stop", "--force"], capture_output=True)
    return {"phases": phases, "command": " ".join(command), "logs": str(log_dir)}


def _load(url: str, prompts: list[str], concurrency: int, max_tokens: int, timeout: float) -> dict:
    """Streaming clients; a client that cannot connect (the front is down) retries every second, as one behind a
    load balancer would, until its timeout; every other failure is the request's answer (an error)."""
    from osd_bench.serve_load import _request_body, one_request

    todo, samples = list(prompts), []

    async def client_loop(client, model):
        while todo:
            prompt, start = todo.pop(0), time.monotonic()
            while True:
                sample = await one_request(client, *_request_body(model, prompt, max_tokens, True))
                refused = (sample.error or "").startswith(("ConnectError", "RemoteProtocolError")) and not sample.text
                if not refused or time.monotonic() - start > timeout:
                    break
                await asyncio.sleep(1.0)
            samples.append(sample)

    async def go():
        async with _client(url, None, timeout, concurrency + 2) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            start = time.monotonic()
            await asyncio.gather(*(client_loop(client, model) for _ in range(concurrency)))
            return time.monotonic() - start

    wall = asyncio.run(go())
    errors = [s.error for s in samples if not s.ok]
    hung = sum("Timeout" in (e or "") for e in errors)
    return {"requests": len(samples), "ok": len(samples) - len(errors), "errors": len(errors) - hung, "hung": hung,
            "error_examples": sorted(set(e[:160] for e in errors if e))[:4], "wall_seconds": wall}
