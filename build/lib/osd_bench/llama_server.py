"""llama.cpp's own `llama-server`, the serving anchor of `osd bench serve-vs`: built once per machine from the
llama.cpp source that the installed llama-cpp-python vendors (its PyPI sdist), cached under
~/.cache/osd/llama-server/, and started as a subprocess on loopback. Two builds:
  portable  the flags of llama-cpp-python's wheel as scripts/setup.sh builds it (AVX2, FMA, F16C; no AVX-512)
  native    llama.cpp's own default, `-DGGML_NATIVE=ON` (-march=native: AVX-512 and VNNI where the CPU has them),
            what a user who builds llama.cpp for this machine runs; cached per CPU feature set, since the cache
            may outlive the machine kind it was built on
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from osd.errors import BackendUnavailable

COMMON_FLAGS = ["-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DCMAKE_BUILD_TYPE=Release"]
BUILDS = {  # build -> its CPU flags; portable: those llama-cpp-python's wheel is built with (scripts/setup.sh)
    "portable": ["-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_AVX512=OFF"],
    "native": ["-DGGML_NATIVE=ON"],
}


def llama_cpp_version() -> str:
    from importlib.metadata import version

    return version("llama_cpp_python")


def build_folder(build: str) -> str:
    """The cache folder's name: the version, and for a native build the CPU's feature set (a short hash of
    /proc/cpuinfo's flags), so a binary built for one CPU never runs on another."""
    if build not in BUILDS:
        raise ValueError(f"unknown llama-server build {build!r}; one of {sorted(BUILDS)}")
    if build == "portable":
        return llama_cpp_version()
    from osd.records import all_cpu_flags

    return f"{llama_cpp_version()}-native-{hashlib.sha256(all_cpu_flags().encode()).hexdigest()[:10]}"


def server_binary(cache: Path | None = None, build: str = "portable") -> Path:
    from osd.models.bundled import cache_root

    return (cache or cache_root()) / "llama-server" / build_folder(build) / "llama-server"


def ensure_llama_server(log=print, build: str = "portable") -> Path:
    """The cached llama-server binary of `build`, built first where missing (~5-10 min on 2 cores; needs cmake and
    g++)."""
    binary = server_binary(build=build)
    if binary.exists():
        return binary
    if shutil.which("cmake") is None:
        raise BackendUnavailable("building llama-server needs cmake (apt-get install cmake g++)")
    version = llama_cpp_version()
    log(f"[osd] building llama-server ({build}) from llama-cpp-python {version}'s vendored llama.cpp (once per "
        "machine) ...")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d", tmp,
                        f"llama-cpp-python=={version}"], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        source = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"))
        build_dir = Path(tmp) / "build"
        subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), *BUILDS[build], *COMMON_FLAGS], check=True,
                       stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(os.cpu_count() or 2)],
                       check=True, stdout=subprocess.DEVNULL)
        built = next(build_dir.rglob("bin/llama-server"))
        binary.parent.mkdir(parents=True, exist_ok=True)
        partial = binary.with_name(f"llama-server.{os.getpid()}.partial")
        shutil.copy2(built, partial)
        for lib in build_dir.rglob("bin/*.so*"):  # a shared build's libraries beside the binary
            shutil.copy2(lib, binary.parent / lib.name)
        partial.replace(binary)
    return binary


FEATURES = ("avx2", "fma", "f16c", "avx512", "avx512_vbmi", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8")
_ASK_GGML = """import ctypes, json, sys
ctypes.CDLL(sys.argv[1] + "/libggml-base.so", mode=ctypes.RTLD_GLOBAL)
cpu = ctypes.CDLL(sys.argv[1] + "/libggml-cpu.so")
print(json.dumps({name: getattr(cpu, "ggml_cpu_has_" + name)() for name in sys.argv[2:]}))"""


def build_features(binary: Path) -> str | None:
    """Which of the CPU features the build's ggml was compiled for (its `ggml_cpu_has_*`, asked in a subprocess of
    its own), e.g. "AVX2 = 1 | AVX512 = 0 | ...": what its kernels use, kept in the benchmark's JSON; None where the
    build has no such libraries beside the binary."""
    try:
        out = subprocess.run([sys.executable, "-c", _ASK_GGML, str(binary.parent), *FEATURES], capture_output=True,
                             text=True, timeout=60, check=True).stdout
        return features_line(json.loads(out))
    except (subprocess.SubprocessError, OSError, ValueError):
        return None


def features_line(has: dict) -> str:
    return " | ".join(f"{name.upper()} = {int(value)}" for name, value in has.items())


class ServerStartError(RuntimeError):
    """A server that exited, or never answered /health, before it served anything."""


def exit_reason(code: int) -> str:
    """'code 1', or the signal a negative Popen code names."""
    if code >= 0:
        return f"code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"
    hint = " (illegal instruction: a build for another CPU, a CPU feature the OS does not enable, or a bad code path " \
        "of the build; run it under gdb to see which)" if name == "SIGILL" else ""
    return f"{name}{hint}"


def wait_healthy(url: str, process: subprocess.Popen, seconds: float = 600.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerStartError(f"the server exited ({exit_reason(process.returncode)}) before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise ServerStartError(f"{url} not healthy after {seconds:.0f} s")


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
