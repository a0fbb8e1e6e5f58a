"""`osd serve` as a user runs it: a subprocess (`python -m osd.cli serve ...`) on 127.0.0.1 and a free port, on model
directories on disk (conftest.save_tiny_pair), with what a user drives it with: the `openai` client, plain HTTP
(httpx) and curl. Reusable by any test that needs the real command (the README's examples, say):

    with osd_serve(["--target", str(root / "target"), ...], log=tmp_path / "serve.log") as server:
        server.client().chat.completions.create(...)
        server.curl("/v1/completions", {"prompt": "..."})
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from openai import OpenAI

SRC = str(Path(__file__).resolve().parents[2] / "src")
# a tiny pair on disk served the way the tests need: no learner, the plain fp32 paths (kernels are tested elsewhere)
TINY_ARGS = ["--draft-quantize", "none", "--no-prepack-target", "--threads", "1", "--no-learn"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_pair_args(root: Path, k: int = 3) -> list[str]:
    """`osd serve` flags for the tiny pair saved under root (conftest.save_tiny_pair)."""
    return ["--target", str(root / "target"), "--draft", str(root / "draft"), "--k", str(k), "--no-adaptive",
            *TINY_ARGS]


@dataclass
class OsdServer:
    url: str
    proc: subprocess.Popen
    log: Path
    api_key: str | None = None

    def client(self, **kw) -> OpenAI:
        return OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0, timeout=120, **kw)

    def http(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)

    def curl(self, path: str, body: dict | None = None, *extra: str) -> tuple[int, str]:
        """curl as a README shows it -> (HTTP status, body text). Needs curl on PATH (`has_curl`)."""
        cmd = ["curl", "-sS", "-o", "-", "-w", "\n%{http_code}", self.url + path]
        if body is not None:
            cmd += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
        if self.api_key:
            cmd += ["-H", f"Authorization: Bearer {self.api_key}"]
        out = subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=120, check=True).stdout
        text, _, status = out.rpartition("\n")
        return int(status), text

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


def has_curl() -> bool:
    return shutil.which("curl") is not None


@contextmanager
def osd_serve(args: list[str], log: Path, api_key: str | None = None, ready_timeout: float = 300.0, env=None):
    """Run `osd serve <args>` (a --port is added) until /health answers 200; yield an OsdServer; then SIGTERM (a
    clean shutdown, waited for) and SIGKILL only if it hangs."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": SRC, "OSD_NO_KERNELS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           **(env or {})}
    if api_key:
        env["OSD_API_KEY"] = api_key
    log = Path(log)
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "osd.cli", "serve", *args, "--port", str(port)], env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    server = OsdServer(f"http://127.0.0.1:{port}", proc, log, api_key)
    try:
        _wait_healthy(server, ready_timeout)
        yield server
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def _wait_healthy(server: OsdServer, ready_timeout: float) -> None:
    deadline = time.monotonic() + ready_timeout
    with httpx.Client(timeout=5) as http:
        while True:  # a readiness poll (start-up loads and calibrates the models), not a timing assumption
            if server.proc.poll() is not None:
                raise AssertionError(f"osd serve exited ({server.proc.returncode}): {server.tail()}")
            try:
                if http.get(server.url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"osd serve did not become healthy: {server.tail()}")
            time.sleep(0.2)
