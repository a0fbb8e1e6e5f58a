"""llama.cpp's own `llama-server`, the serving anchor of `osd bench serve-vs`: built once per machine from the
llama.cpp source that the installed llama-cpp-python vendors (its PyPI sdist), with the portable flags of
scripts/setup.sh, cached under ~/.cache/osd/llama-server/<version>/; started as a subprocess on loopback.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from osd.errors import BackendUnavailable

CMAKE_FLAGS = ["-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX512=OFF",
               "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DCMAKE_BUILD_TYPE=Release"]  # the flags llama-cpp-python's wheel is built with (scripts/setup.sh)


def llama_cpp_version() -> str:
    from importlib.metadata import version

    return version("llama_cpp_python")


def server_binary(cache: Path | None = None) -> Path:
    from osd.models.bundled import cache_root

    return (cache or cache_root()) / "llama-server" / llama_cpp_version() / "llama-server"


def ensure_llama_server(log=print) -> Path:
    """The cached llama-server binary, built first where missing (~5-10 min on 2 cores; needs cmake and g++)."""
    binary = server_binary()
    if binary.exists():
        return binary
    if shutil.which("cmake") is None:
        raise BackendUnavailable("building llama-server needs cmake (apt-get install cmake g++)")
    version = llama_cpp_version()
    log(f"[osd] building llama-server from llama-cpp-python {version}'s vendored llama.cpp (once per machine) ...")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", tmp,
                        f"llama-cpp-python=={version}"], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        source = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
        build = Path(tmp) / "build"
        subprocess.run(["cmake", "-S", str(source), "-B", str(build), *CMAKE_FLAGS], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)],
                       check=True, stdout=subprocess.DEVNULL)
        built = next(build.rglob("bin/llama-server"))
        binary.parent.mkdir(parents=True, exist_ok=True)
        partial = binary.with_name(f"llama-server.{os.getpid()}.partial")
        shutil.copy2(built, partial)
        for lib in build.rglob("bin/*.so*"):  # a shared build's libraries beside the binary
            shutil.copy2(lib, binary.parent / lib.name)
        partial.replace(binary)
    return binary


def wait_healthy(url: str, process: subprocess.Popen, seconds: float = 600.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {seconds:.0f} s")


@contextmanager
def running(command: list[str], url: str, log_path: Path, env: dict | None = None):
    """Start a server subprocess, wait for /health, yield its Popen; stop it (SIGINT, then kill) at the end."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(url, process)
            yield process
        finally:
            if process.poll() is None:
                process.send_signal(2)
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def llama_server_command(binary: Path, gguf: Path, port: int, threads: int, parallel: int, n_ctx: int) -> list[str]:
    """llama-server with `parallel` slots and continuous batching; n_ctx is the context of ONE slot."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-np", str(parallel), "-c", str(n_ctx * parallel), "--cont-batching", "--jinja"]
