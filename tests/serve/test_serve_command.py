"""`python -m osd.cli serve` on tiny model directories, with the names users type (--model, --served-model-name,
--num-speculative-tokens, --learn-*, --chat-template, --log-level, --stats-interval): it answers, builds chat
prompts with the given template, logs in one format (uvicorn's lines too) and prints the periodic stats line."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from conftest import save_tiny_pair, tiny_tokenizer

SRC = str(Path(__file__).resolve().parents[2] / "src")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_osd_serve_answers_and_logs_its_stats_line(tmp_path):
    save_tiny_pair(tmp_path, draft_layers=1)
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %} and more words.")
    port = free_port()
    args = ["--model", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--draft-quantize", "none",
            "--no-prepack-target", "--threads", "1", "--num-speculative-tokens", "3", "--no-adaptive",
            "--served-model-name", "tiny", "--port", str(port), "--chat-template", str(template),
            "--log-level", "info", "--stats-interval", "0.3", "--learn-checkpoint-dir", str(tmp_path / "ckpt"),
            "--learn-mode", "all", "--learn-every-requests", "1", "--learn-trainable", "all",
            "--learn-train-layers", "0", "--no-learn-guard", "--learn-lr", "1e-2", "--learn-steps-per-update", "2",
            "--learn-batch-size", "2"]
    env = {**os.environ, "PYTHONPATH": SRC, "OSD_NO_KERNELS": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "osd.cli", "serve", *args], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            deadline = time.monotonic() + 300
            while True:
                assert proc.poll() is None, f"server exited: {log_path.read_text()[-3000:]}"
                assert time.monotonic() < deadline, "server did not start"
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                    "temperature": 0}
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["prompt_tokens"] == len(tiny_tokenizer()("hi and more words.")["input_ids"])
            deadline = time.monotonic() + 30
            while "osd.stats: running" not in log_path.read_text():
                assert time.monotonic() < deadline, f"no stats line: {log_path.read_text()[-3000:]}"
                time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    text = log_path.read_text()
    stats = next(line for line in text.splitlines() if "osd.stats: running" in line)
    assert " INFO osd.stats: running " in stats and "tok/s" in stats and "| draft v" in stats
    assert "| learner: " in stats
    assert " INFO uvicorn.error: Application startup complete" in text  # uvicorn's lines in osd's format
    assert "POST /v1/chat/completions" in text  # uvicorn's access log, at --log-level info
