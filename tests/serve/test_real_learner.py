"""The server with the real online learner (osd serve's default), on tiny model directories.

In process (build_system + attach_learner + create_app, what `osd serve` runs): updates are published while
requests are served (the versions responses report rise), every request proposes with one weight set (per-step
fingerprints, StepRecord.draft_weights) and reports that version, greedy answers equal the target's own, and a
restart on the same checkpoint directory resumes the version.
As a subprocess (`python -m osd.cli serve`): kill -9 while a checkpoint is being written, paused there by the
OSD_TEST_CHECKPOINT_PAUSE hook (learn/checkpoint.py), at both of its risky points (the write is the last step of
an update, so this is a kill inside an update): the last complete checkpoint stays loadable and a restart resumes
it; SIGTERM then shuts down cleanly and checkpoints.
"""
import math
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from conftest import save_tiny_pair
from serve_testing import live_server

from osd.build import attach_learner, build_system
from osd.config import ModelConfig, SamplingConfig, SpeculationConfig
from osd.engine import SpeculativeEngine
from osd.learn.checkpoint import PAUSE_ENV, load_checkpoint
from osd.learn.online import LearnConfig
from osd.serve.app import create_app

PROMPTS = ["add two numbers", "select all rows", "count the apples", "sort a list", "find the max", "join tables",
           "print hello", "read a file"]
NEW_TOKENS = 12
SRC = str(Path(__file__).resolve().parents[2] / "src")
# Learning that publishes on tiny models: every 2 requests, every position, the guard off (it is tested elsewhere).
LEARN = dict(mode="all", every_requests=2, trainable="all", train_layers=0, guard=False, lr=1e-2, steps_per_update=4,
             batch_size=4, schedule="background")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("real-learner")
    save_tiny_pair(root, draft_layers=1)
    return root


def models(root) -> ModelConfig:
    # no compiled kernels: serving copies stay fp32, the target plain (the kernels are tested elsewhere)
    return ModelConfig(target=str(root / "target"), draft=str(root / "draft"), draft_quantize="none",
                       prepack_target=False)


def fresh_draft_master(root):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(root / "draft")


def complete(http: httpx.Client, prompt: str) -> dict:
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": NEW_TOKENS,
                                            "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


# --- in process ---------------------------------------------------------------------------------------------

@contextmanager
def real_server(root, checkpoint_dir):
    system = build_system(models(root), SpeculationConfig(k=3, adaptive=False))
    steps, results = defaultdict(list), []
    system.engine.observers.append(lambda rec: steps[rec.request_id].append(rec.draft_weights) if rec.proposed else None)
    system.engine.request_observers.append(results.append)
    learner = attach_learner(system, LearnConfig(**LEARN, checkpoint_dir=str(checkpoint_dir)))
    app = create_app(system.engine, system.tokenizer, "tiny", learner=learner)
    with live_server(app) as url, httpx.Client(base_url=url, timeout=120) as http:
        yield http, system, learner, steps, results


def assert_one_weight_set_per_request(steps, results):
    for result in results:
        weights = set(steps[result.request_id])
        assert len(weights) <= 1, f"request {result.request_id} mixed draft weights: {weights}"
        if weights:
            name, version = result.draft
            assert weights.pop().startswith(f"{name}@v{version}:")


def test_updates_publish_while_serving_one_version_per_request_and_restart_resumes(model_dirs, tmp_path):
    ckpt = tmp_path / "ckpt"
    with real_server(model_dirs, ckpt) as (http, system, learner, steps, results):
        versions = []
        for i in range(40):  # sequential: the i-th response is the i-th result
            versions.append(complete(http, PROMPTS[i % len(PROMPTS)])["osd"]["draft_version"])
            if versions[-1] >= 2:
                break
        assert versions[-1] >= 2, (versions, learner.stats())  # updates published while serving
        assert versions == sorted(versions) and versions[0] == 0
        assert [r.draft[1] for r in results] == versions  # what each response reports is what its request ran
        with ThreadPoolExecutor(4) as pool:  # concurrent clients while the learner keeps training
            concurrent = list(pool.map(lambda p: complete(http, p)["osd"]["draft_version"], PROMPTS * 2))
        assert min(concurrent) >= versions[-1]
        assert_one_weight_set_per_request(steps, results)
        assert len({w for ws in steps.values() for w in ws}) >= 3  # several weight sets served over time
        stats = learner.stats()
        assert stats["updates_published"] >= 2 and stats["update_errors"] == 0
        assert "update_errors" in http.get("/metrics").text
        served = list(results)
    final_version = learner.version  # the server's shutdown stopped the learner, which checkpointed
    target_only = SpeculativeEngine(system.target_model, system.tokenizer, None)
    for result in served:  # learning never changed an answer
        assert result.token_ids == target_only.generate(result.prompt_ids, SamplingConfig(max_new_tokens=NEW_TOKENS)).token_ids
    with real_server(model_dirs, ckpt) as (http, system, learner, steps, results):
        assert learner.version == final_version == system.registry.get("default").version
        assert complete(http, PROMPTS[0])["osd"]["draft_version"] == final_version


def test_a_paused_learner_publishes_nothing_while_serving_goes_on_and_resumes_from_what_it_saw(model_dirs, tmp_path):
    with real_server(model_dirs, tmp_path / "ckpt") as (http, system, learner, steps, results):
        for i in range(40):
            if complete(http, PROMPTS[i % len(PROMPTS)])["osd"]["draft_version"] >= 1:
                break
        r = http.post("/v1/osd/learner", json={"paused": True})
        assert r.status_code == 200, r.text
        paused = r.json()
        assert paused["paused"] is True and (paused["training"] is False or paused["parked"] is True)
        seen = learner.buffer.added
        versions = {complete(http, p)["osd"]["draft_version"] for p in PROMPTS * 2}
        time.sleep(1.5)  # the background thread wakes (at least once a second) and must still not update
        after = http.get("/v1/osd/learner").json()
        assert versions == {paused["version"]} and after["version"] == paused["version"]
        assert after["optimizer_steps"] == paused["optimizer_steps"]
        assert learner.buffer.added > seen  # traffic still observed while paused: nothing lost
        assert "osd_learner_paused 1.0" in http.get("/metrics").text
        assert http.post("/v1/osd/learner", json={"paused": False}).json()["paused"] is False
        for i in range(40):
            if complete(http, PROMPTS[i % len(PROMPTS)])["osd"]["draft_version"] > paused["version"]:
                break
        assert learner.version > paused["version"]
        bad = http.post("/v1/osd/learner", json={"paused": "yes"})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"


def test_paired_learning_bench_alternates_a_running_and_a_paused_learner_on_one_server(model_dirs, tmp_path):
    from osd_bench.serve_load import run_paired_learning

    with real_server(model_dirs, tmp_path / "ckpt") as (http, system, learner, steps, results):
        url = str(http.base_url).rstrip("/")
        result = run_paired_learning(url, PROMPTS[:4], rounds=3, max_tokens=NEW_TOKENS, chat=False, model="tiny")
        assert http.get("/v1/osd/learner").json()["paused"] is False  # left learning, as it started
    rounds = result["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2] and all(r[a]["requests"] == 4 and r[a]["errors"] == 0
                                                              for r in rounds for a in ("learning", "paused"))
    assert [r["learning"]["learner_before"]["paused"] for r in rounds] == [False] * 3
    assert [r["paused"]["learner_before"]["paused"] for r in rounds] == [True] * 3
    assert result["optimizer_steps_paused"] == 0 < result["optimizer_steps_learning"]
    assert result["tpot_p50_ratio"]["rounds"] == 3
    per_round = [r["learning"]["tokens_per_second"] / r["paused"]["tokens_per_second"] for r in rounds]
    assert result["tokens_per_second_ratio"]["ratio"] == pytest.approx(math.prod(per_round) ** (1 / 3))


def test_paired_ratio_is_the_geometric_mean_of_the_round_ratios_with_a_t_interval():
    from osd_bench.serve_load import paired_ratio

    same = paired_ratio([1.1, 2.2, 0.55], [1.0, 2.0, 0.5])  # every round 10% slower: no spread
    assert same["ratio"] == pytest.approx(1.1) and same["ci95"] == pytest.approx([1.1, 1.1])
    assert same["on_slower_rounds"] == 3
    mixed = paired_ratio([1.2, 1.0], [1.0, 1.2])  # +20% then -17%: the geometric mean is 1, the interval wide
    assert mixed["ratio"] == pytest.approx(1.0) and mixed["ci95"][0] < 0.5 and mixed["ci95"][1] > 2
    assert paired_ratio([], [])["ratio"] is None


def test_the_learner_endpoint_says_404_when_the_server_does_not_learn(model_dirs):
    system = build_system(models(model_dirs), SpeculationConfig(k=3, adaptive=False))
    app = create_app(system.engine, system.tokenizer, "tiny")
    with live_server(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        for r in (http.get("/v1/osd/learner"), http.post("/v1/osd/learner", json={"paused": True})):
            assert r.status_code == 404 and r.json()["error"]["code"] == "learner_not_running"
        assert complete(http, PROMPTS[0])["choices"][0]["text"] is not None  # serving unaffected


# --- as a subprocess, killed ----------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m osd.cli serve` on the tiny directories, learning on, with the checkpoint pause hook armed."""

    def __init__(self, root, ckpt, flag, log):
        self.port = free_port()
        args = ["--target", str(root / "target"), "--draft", str(root / "draft"), "--draft-quantize", "none",
                "--no-prepack-target", "--threads", "1", "--k", "3", "--no-adaptive", "--model-name", "tiny",
                "--port", str(self.port), "--checkpoint-dir", str(ckpt), "--mode", "all", "--every-requests", "2",
                "--trainable", "all", "--train-layers", "0", "--no-guard", "--lr", "1e-2", "--steps-per-update", "4",
                "--batch-size", "4", "--learn-checkpoint-every-seconds", "0"]  # a checkpoint after every update
        env = {**os.environ, "PYTHONPATH": SRC, PAUSE_ENV: str(flag), "OSD_NO_KERNELS": "1", "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1"}
        self.log = open(log, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "osd.cli", "serve", *args], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=120)
        deadline = time.monotonic() + 300
        try:
            while not self._healthy():
                assert self.proc.poll() is None, f"server exited: {Path(log).read_text()[-3000:]}"
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.2)
        except BaseException:
            self.proc.kill()
            self.close()
            raise

    def _healthy(self) -> bool:
        try:
            return self.http.get("/health").status_code == 200
        except httpx.TransportError:
            return False

    def serve_until(self, condition, limit: int = 60) -> list[int]:
        """Send requests one at a time until condition() holds; the draft versions the responses reported."""
        versions = []
        for i in range(limit):
            if condition():
                return versions
            versions.append(complete(self.http, PROMPTS[i % len(PROMPTS)])["osd"]["draft_version"])
            time.sleep(0.05)  # an idle window for the background learner
        deadline = time.monotonic() + 60
        while not condition():  # the last update may still be running
            assert time.monotonic() < deadline, "condition never held while serving"
            time.sleep(0.05)
        return versions

    def kill9(self):
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait(30) == -signal.SIGKILL
        self.close()

    def close(self):
        self.http.close()
        self.log.close()


def saved_version(ckpt: Path) -> int | None:
    try:
        return json.loads((ckpt / "state.json").read_text())["version"]
    except (OSError, ValueError):
        return None


def assert_loads(root, where: Path, version: int):
    """The checkpoint (directory, or its .old twin after a crash between renames) loads, optimizer included."""
    master = fresh_draft_master(root)
    optimizer = torch.optim.AdamW(master.parameters(), lr=1e-2)
    state = load_checkpoint(str(where), master, optimizer)
    assert state is not None and state["version"] == version
    assert optimizer.state_dict()["state"]  # Adam moments came back too


def test_kill9_while_writing_a_checkpoint_leaves_the_last_one_loadable(model_dirs, tmp_path):
    root, ckpt, flag = model_dirs, tmp_path / "ckpt", tmp_path / "pause"
    entered = Path(str(flag) + ".entered")
    server = ServerProcess(root, ckpt, flag, tmp_path / "server.log")
    try:
        server.serve_until(lambda: (saved_version(ckpt) or 0) >= 1)  # a complete checkpoint exists
        good = saved_version(ckpt)
        flag.write_text("files")  # the next checkpoint write stops with its files half done
        server.serve_until(entered.exists)
    except BaseException:
        server.proc.kill()
        raise
    server.kill9()
    assert ckpt.with_name("ckpt.partial").exists()  # killed mid-write ...
    assert saved_version(ckpt) == good  # ... and the last complete checkpoint is untouched
    assert_loads(root, ckpt, good)

    flag.unlink()
    entered.unlink()
    server = ServerProcess(root, ckpt, flag, tmp_path / "server.log")  # restart on the same directory
    try:
        assert complete(server.http, PROMPTS[0])["osd"]["draft_version"] == good  # resumed
        flag.write_text("renames")  # the next write stops between moving the old checkpoint aside and the new in
        server.serve_until(entered.exists)
    except BaseException:
        server.proc.kill()
        raise
    server.kill9()
    old = ckpt.with_name("ckpt.old")
    assert not ckpt.exists() and saved_version(old) is not None  # the worst moment: only <dir>.old is complete
    second = saved_version(old)
    assert second >= good
    assert_loads(root, ckpt, second)  # load_checkpoint finds the .old twin

    flag.unlink()
    requests_before = json.loads((old / "state.json").read_text())["counters"]["requests"]
    server = ServerProcess(root, ckpt, flag, tmp_path / "server.log")
    try:
        assert complete(server.http, PROMPTS[1])["osd"]["draft_version"] == second  # resumed from .old
        served = 1 + len(server.serve_until(lambda: (saved_version(ckpt) or 0) > second))  # learns, checkpoints again
        served += len([complete(server.http, p) for p in PROMPTS[:3]])
        server.proc.send_signal(signal.SIGTERM)  # graceful: uvicorn finishes, then re-raises the signal (exit -15)
        assert server.proc.wait(120) in (0, -signal.SIGTERM)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
        server.close()
    assert "Application shutdown complete" in (tmp_path / "server.log").read_text()
    state = json.loads((ckpt / "state.json").read_text())  # the shutdown checkpointed every request it served
    assert state["counters"]["requests"] == requests_before + served
    assert not old.exists()
    assert_loads(root, ckpt, state["version"])
