"""Checkpoints and background updates fail loudly and never leave the last good checkpoint unloadable.

- a write is atomic: paused at each point between its steps (the PAUSE_ENV hook), the directory still loads the
  previous checkpoint; every file is fsynced before the swap (the kill -9 version: tests/serve/test_real_learner.py);
- an optimizer state that cannot be read or does not fit raises OptimizerStateError naming the file and why;
- an exception in a background update is counted as update_errors (not a guard rejection), logged, and the learner
  and the engine go on.
"""
import copy
import logging
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import EOS, tiny_qwen2
from helpers import make_engine, plain_greedy

import osd.learn.checkpoint as checkpoint
from osd.config import SamplingConfig
from osd.errors import OptimizerStateError
from osd.learn.checkpoint import PAUSE_ENV, load_checkpoint, save_checkpoint
from osd.learn.online import LearnConfig, OnlineLearner

STREAM = [[5 + i % 7, 9 + i % 5, 20 + i % 3] for i in range(8)]


def optimizer_for(model):
    return torch.optim.AdamW(model.requires_grad_(True).parameters(), lr=1e-2)


def trained_step(model, optimizer):
    """One AdamW step on a toy loss (gives the optimizer moments to save)."""
    loss = model(torch.tensor([[5, 6, 7]])).logits.square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def wait_for(condition, seconds: float = 60.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


@pytest.mark.parametrize("stage", ["files", "renames"])
def test_a_write_paused_midway_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch, stage):
    ckpt, flag = tmp_path / "ckpt", tmp_path / "pause"
    model = tiny_qwen2(seed=1, layers=1)
    optimizer = optimizer_for(model)
    save_checkpoint(str(ckpt), model, optimizer, {"version": 1})
    monkeypatch.setenv(PAUSE_ENV, str(flag))
    flag.write_text(stage)
    trained_step(model, optimizer)
    writer = threading.Thread(target=save_checkpoint, args=(str(ckpt), model, optimizer, {"version": 2}))
    writer.start()
    wait_for(Path(str(flag) + ".entered").exists)  # the write is paused at `stage`
    assert ckpt.with_name("ckpt.partial").exists()
    if stage == "renames":  # the worst moment: the previous checkpoint moved aside, the new one not in place
        assert not ckpt.exists() and (ckpt.with_name("ckpt.old") / "state.json").exists()
    before = tiny_qwen2(seed=1, layers=1)
    assert load_checkpoint(str(ckpt), before, optimizer_for(before))["version"] == 1
    flag.unlink()
    writer.join(60)
    after = tiny_qwen2(seed=1, layers=1)
    assert load_checkpoint(str(ckpt), after, optimizer_for(after))["version"] == 2
    assert all(torch.equal(a, b) for a, b in zip(after.parameters(), model.parameters()))
    assert not ckpt.with_name("ckpt.old").exists() and not ckpt.with_name("ckpt.partial").exists()


def test_every_file_is_fsynced_before_the_checkpoint_is_swapped_in(tmp_path, monkeypatch):
    events = []
    fsync, rename = checkpoint._fsync, Path.rename
    monkeypatch.setattr(checkpoint, "_fsync", lambda p: (events.append(("fsync", Path(p).name)), fsync(p)))
    monkeypatch.setattr(Path, "rename", lambda self, to: (events.append(("rename", self.name)), rename(self, to))[1])
    model = tiny_qwen2(seed=1, layers=1)
    for version in (1, 2):  # the second write also moves the first aside
        events.clear()
        final = save_checkpoint(str(tmp_path / "ckpt"), model, optimizer_for(model), {"version": version})
        swap = events.index(("rename", "ckpt.partial"))
        synced = {name for kind, name in events[:swap] if kind == "fsync"}
        assert synced >= {f.name for f in final.iterdir()} | {"ckpt.partial"}
        assert ("fsync", tmp_path.name) in events[swap:]  # the renames themselves are made durable


def _saved_checkpoint(tmp_path, trainable="all"):
    draft = tiny_qwen2(seed=1, layers=1)
    learner = OnlineLearner(draft, lambda master, version=None: None,
                            LearnConfig(trainable=trainable, checkpoint_dir=str(tmp_path / "ckpt")))
    trained_step(draft, learner.optimizer)
    learner.save()
    return tmp_path / "ckpt"


def _resuming_learner(ckpt, **cfg):
    publish = lambda master, version=None: SimpleNamespace(version=version or 0)
    return OnlineLearner(tiny_qwen2(seed=1, layers=1), publish, LearnConfig(checkpoint_dir=str(ckpt), **cfg))


def test_optimizer_state_of_other_trainable_parameters_raises_naming_the_file(tmp_path):
    ckpt = _saved_checkpoint(tmp_path, trainable="all")
    assert _resuming_learner(ckpt, trainable="all").resume()  # the same settings resume
    with pytest.raises(OptimizerStateError, match=r"optimizer\.pt does not fit.*trainable=all"):
        _resuming_learner(ckpt, trainable="no_embeddings").resume()


def test_optimizer_moments_of_another_shape_raise(tmp_path):
    ckpt = _saved_checkpoint(tmp_path)
    saved = torch.load(ckpt / "optimizer.pt", weights_only=True)
    saved["state"][0]["exp_avg"] = torch.zeros(3, 3)  # the right parameter count, a wrong moment shape
    torch.save(saved, ckpt / "optimizer.pt")
    with pytest.raises(OptimizerStateError, match=r"exp_avg of parameter 0 has shape \(3, 3\)"):
        _resuming_learner(ckpt, trainable="all").resume()


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_unreadable_optimizer_state_raises_naming_the_file(tmp_path, damage):
    ckpt = _saved_checkpoint(tmp_path)
    path = ckpt / "optimizer.pt"
    if damage == "missing":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(OptimizerStateError, match=f"cannot read the optimizer state {path}"):
        _resuming_learner(ckpt, trainable="all").resume()
    weights_only = tiny_qwen2(seed=1, layers=1)  # evaluating the checkpointed draft needs no optimizer state
    assert load_checkpoint(str(ckpt), weights_only) is not None


def test_background_update_exceptions_are_counted_apart_and_serving_goes_on(target_model, tokenizer, caplog):
    draft = tiny_qwen2(seed=1, layers=1)
    engine, registry = make_engine(target_model, copy.deepcopy(draft), tokenizer, k=3)
    publish = lambda master, version=None: registry.publish("draft", copy.deepcopy(master).eval(), None, version)
    learner = OnlineLearner(draft, publish, LearnConfig(mode="all", every_requests=1, schedule="background",
                                                        trainable="all", guard=False, lr=1e-2)).attach(engine)
    real_update, failures, checked = learner._update, [], threading.Event()

    def failing_update(reason):
        if not failures:
            failures.append(reason)
            raise RuntimeError("simulated failure inside an update")
        checked.wait(60)  # the retry (due again a second later) waits until the failure's effects were checked
        return real_update(reason)

    learner._update = failing_update
    learner.start()
    try:
        with caplog.at_level(logging.ERROR, logger="osd.learn"):
            engine.generate(STREAM[0], SamplingConfig(max_new_tokens=12))
            logged = lambda: any("background draft update failed" in r.getMessage() and r.exc_info for r in caplog.records)
            wait_for(lambda: learner.counters["update_errors"] == 1 and logged())  # counted in update(), logged after
        stats = learner.stats()
        assert stats["update_errors"] == 1 and stats["updates_rejected"] == 0 and stats["updates_published"] == 0
        assert "simulated failure" in learner.last_update["error"]
        checked.set()
        for prompt in STREAM[1:4]:  # the engine serves on, and the learner's next update publishes
            result = engine.generate(prompt, SamplingConfig(max_new_tokens=12))
            assert result.token_ids == plain_greedy(target_model, prompt, 12, eos=EOS)
        wait_for(lambda: learner.counters["updates_published"] >= 1)
        assert registry.get("draft").version >= 1 and learner.counters["update_errors"] == 1
    finally:
        checked.set()
        learner.stop()


def test_a_serving_learner_checkpoints_at_most_once_a_minute_and_always_when_it_stops(tmp_path):
    """A 4-step update every few requests wrote ~240 MB (the trained layer, its moments, the average) beside serving
    each time; with checkpoint_every_seconds an update within the minute is counted as deferred, not written, and
    stop() writes the last state, so a restart resumes the newest version."""
    import json

    from test_buffer_burst import PUBLISH, _items

    now = [0.0]
    ckpt = tmp_path / "ckpt"
    config = LearnConfig(guard=False, every_requests=0, batch_size=2, steps_per_update=1, lr=1e-2, train_layers=0,
                         rehearsal=0.0, checkpoint_dir=str(ckpt), checkpoint_every_seconds=60.0)
    versions = iter(range(1, 100))
    learner = OnlineLearner(tiny_qwen2(seed=1, layers=1), lambda m, version=None: SimpleNamespace(version=next(versions)),
                            config, clock=lambda: now[0])
    saved_version = lambda: json.loads((ckpt / "state.json").read_text())["version"]
    for item in _items(6):
        learner.observe_item(item)
    learner.update()
    assert saved_version() == 1  # the first update is written
    now[0] = 30.0
    learner.update()
    assert learner.version == 2 and saved_version() == 1 and learner.counters["checkpoints_deferred"] == 1
    now[0] = 61.0
    learner.update()
    assert saved_version() == 3
    now[0] = 62.0
    learner.update()
    assert saved_version() == 3
    learner.stop()
    assert saved_version() == 4
    every_update = LearnConfig(guard=False, checkpoint_dir=str(tmp_path / "b"))
    assert every_update.checkpoint_every_seconds == 0.0 and LearnConfig.serving().checkpoint_every_seconds == 60.0


def test_a_background_learner_writes_its_checkpoint_when_no_request_decodes(tmp_path):
    """Writing a checkpoint took ~1.5 s of a core beside serving, which decoding requests lost on 2 cores: in the
    background schedule an update's checkpoint waits for an idle engine, or checkpoint_every_seconds at most."""
    import json

    from test_buffer_burst import _items

    now, busy = [0.0], [False]
    ckpt = tmp_path / "ckpt"
    config = LearnConfig(guard=False, every_requests=0, batch_size=2, steps_per_update=1, lr=1e-2, train_layers=0,
                         rehearsal=0.0, checkpoint_dir=str(ckpt), checkpoint_every_seconds=60.0, schedule="background")
    versions = iter(range(1, 100))
    learner = OnlineLearner(tiny_qwen2(seed=1, layers=1), lambda m, version=None: SimpleNamespace(version=next(versions)),
                            config, engine_busy=lambda: busy[0], clock=lambda: now[0])
    saved_version = lambda: json.loads((ckpt / "state.json").read_text())["version"] if ckpt.exists() else None
    for item in _items(6):
        learner.observe_item(item)

    real_update = learner.update

    def update_on_its_thread():  # the learner's own updates defer; one asked for from elsewhere is written at once
        learner._thread = threading.Thread(target=real_update)
        learner._thread.start()
        learner._thread.join()
        learner._thread = None

    learner.update = update_on_its_thread
    learner.update()
    assert saved_version() is None  # due, not written inside the update
    learner._save_when_idle()
    assert saved_version() == 1  # idle: written
    now[0] = 61.0
    learner.update()
    busy[0] = True
    learner._save_when_idle()
    now[0] = 120.0
    learner._save_when_idle()
    assert learner.version == 2 and saved_version() == 1  # requests decode: it waits ...
    now[0] = 121.0
    learner._save_when_idle()
    assert saved_version() == 2  # ... checkpoint_every_seconds at most
    now[0] = 200.0
    busy[0] = False
    learner.update()
    learner._save_when_idle()
    assert saved_version() == 3
