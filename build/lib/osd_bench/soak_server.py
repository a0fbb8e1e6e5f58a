"""The soak's two ends besides the clients: a real `osd serve` process to drive, and osd's target-only
answers to compare greedy responses with.

The server is started exactly as a user would (`python -m osd.cli serve`, learning on by default) on a
free loopback port, with a fresh API key (passed by environment, not argv) and a fresh checkpoint
directory, so a soak never resumes another run's draft. The reference is an in-process engine over
the same target spec with no proposer (k = 0 at every step), run once per distinct greedy request.
Limitations: the reference is built with ModelConfig defaults apart from the target spec, so a server
started with other target settings (--n-ctx, --dtype, --target-backend) needs the same on the reference
side; run_soak_command passes none and neither does the soak's own server.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from osd.config import SamplingConfig
from osd.data import prompt_ids
from osd.errors import InvalidArgument, OsdError


class ServerFailed(OsdError):
    """The `osd serve` process the soak started exited or never became healthy."""


def target_only_references(engine, tokenizer, cases) -> dict:
    """{GreedyKey: text} from a target-only engine (no proposer), once per distinct greedy request."""
    if engine.proposer is not None:
        raise InvalidArgument("the reference engine must be target-only (proposer=None)")
    keys = list(dict.fromkeys(c.greedy for c in cases if c.greedy is not None))
    out = {}
    for key in keys:
        sampling = SamplingConfig(temperature=0.0, max_new_tokens=key.max_tokens, stop=list(key.stop))
        out[key] = engine.generate(prompt_ids(tokenizer, key.prompt, chat=key.chat), sampling).text
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`osd serve --target T --draft D` in a subprocess; a context manager that waits for /health and, on exit,
    stops it with SIGTERM (as a supervisor would) and records how it went in `shutdown`."""

    def __init__(self, target: str, draft: str, max_body_bytes: int, extra_args: list[str] = (),
                 log_path: str | Path = "soak-server.log", start_timeout: float = 900.0):
        self.target, self.draft, self.max_body_bytes = target, draft, max_body_bytes
        self.extra_args, self.log_path, self.start_timeout = list(extra_args), Path(log_path), start_timeout
        self.api_key, self.port, self.proc, self.shutdown = secrets.token_hex(12), free_port(), None, {}
        self.checkpoint_dir = str(Path(tempfile.gettempdir()) / f"osd-soak-checkpoint-{self.port}-{os.getpid()}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "osd.cli", "serve", "--target", self.target, "--draft", self.draft,
                "--port", str(self.port), "--max-body-bytes", str(self.max_body_bytes),
                "--checkpoint-dir", self.checkpoint_dir, *self.extra_args]

    def __enter__(self) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.checkpoint_dir, ignore_errors=True)  # a fresh draft: never another run's checkpoint
        self._log = open(self.log_path, "w")
        env = os.environ | {"OSD_API_KEY": self.api_key}
        self.proc = subprocess.Popen(self.command(), env=env, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait_healthy()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"osd serve exited with {self.proc.returncode}; see {self.log_path}:\n{self._tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise ServerFailed(f"osd serve not healthy after {self.start_timeout:.0f} s; see {self.log_path}")

    def _tail(self, n: int = 20) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def __exit__(self, *exc) -> None:
        start = time.monotonic()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=180)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        if self.proc is not None:  # uvicorn re-raises the signal after a graceful shutdown: exit code -15
            graceful = "Application shutdown complete" in self.log_path.read_text(errors="replace")
            self.shutdown = {"signal": "SIGTERM", "returncode": self.proc.returncode, "graceful": graceful,
                             "seconds": time.monotonic() - start}
        shutil.rmtree(self.checkpoint_dir, ignore_errors=True)


def model_pair(models: str) -> tuple[str, str]:
    """'tiny' (written once, osd/bench/tiny_pair.py) or 'bundled' (osd's default pair) -> (target, draft) specs."""
    from osd.config import ModelConfig

    if models == "tiny":
        from osd_bench.tiny_pair import write_tiny_pair

        return write_tiny_pair()
    if models == "bundled":
        return ModelConfig.target, ModelConfig.draft
    raise InvalidArgument(f"models must be tiny or bundled, got {models!r}")


def served_model(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def run_soak_command(models: str, prompts: list[str], max_tokens: int, config, url: str | None = None,
                     api_key: str | None = None, pid: int | None = None, max_body_bytes: int = 1_000_000,
                     serve_args: list[str] = (), log_path: str = "soak-server.log") -> dict:
    """Start (or connect to, with url) a server on the `models` pair, compute the target-only references,
    drive the soak, stop the server. -> the soak's result."""
    from contextlib import nullcontext

    from osd_bench.soak import build_cases, run_soak
    from osd.build import build_system
    from osd.config import ModelConfig, SpeculationConfig

    target, draft = model_pair(models)
    server = ServerProcess(target, draft, max_body_bytes, serve_args, log_path) if url is None else nullcontext()
    with server:
        url, api_key = (server.url, server.api_key) if url is None else (url, api_key)
        pid = server.proc.pid if isinstance(server, ServerProcess) else pid
        reference = build_system(ModelConfig(target=target, draft=""), SpeculationConfig(k=0), with_draft=False)
        cases = build_cases(served_model(url, api_key), prompts, max_tokens, reference.engine.context_window,
                            max_body_bytes, api_key)
        references = target_only_references(reference.engine, reference.tokenizer, cases)
        del reference  # free the reference's model before the load starts
        result = run_soak(url, cases, config, references, api_key=api_key, pid=pid)
    result["config"].update(models=models, target=target, draft=draft, max_tokens=max_tokens, prompts=len(prompts),
                            started_server=isinstance(server, ServerProcess), serve_args=list(serve_args))
    if isinstance(server, ServerProcess):
        result["shutdown"] = server.shutdown
        result["server_log"] = str(server.log_path)
    return result
