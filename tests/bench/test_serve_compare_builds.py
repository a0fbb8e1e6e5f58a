"""serve-vs against two llama-server builds: the wheel's portable flags and llama.cpp's native default, each cached
where it cannot be taken for the other, each arm on its own build, ratios to each in the report."""
from pathlib import Path

import pytest

import osd_bench.llama_server as llama_server
import osd_bench.serve_compare as serve_compare
from osd_bench.serve_report import build_lines, prefill_lines, vs_rows, vs_table


class FakeRunning:
    """A server that is healthy at once (pid 1); measure_server is faked beside it."""
    def __init__(self, command, url, log_path, env):
        pass

    def __enter__(self):
        return type("FakeProcess", (), {"pid": 1})()

    def __exit__(self, *exc):
        return False


def test_a_native_build_is_cached_per_cpu_feature_set_and_the_portable_one_where_it_always_was(monkeypatch):
    monkeypatch.setattr(llama_server, "llama_cpp_version", lambda: "0.3.36")
    monkeypatch.setattr("osd.records.all_cpu_flags", lambda: "avx2 avx512f fma")
    amd = llama_server.server_binary(Path("/c"), build="native")
    monkeypatch.setattr("osd.records.all_cpu_flags", lambda: "amx_int8 avx2 avx512f fma")
    intel = llama_server.server_binary(Path("/c"), build="native")
    assert llama_server.server_binary(Path("/c")) == Path("/c/llama-server/0.3.36/llama-server")
    assert amd != intel and amd.parent.name.startswith("0.3.36-native-") and amd.name == "llama-server"
    assert llama_server.server_binary(Path("/c"), build="native") == intel  # the same CPU finds its build again
    with pytest.raises(ValueError, match="unknown llama-server build"):
        llama_server.server_binary(Path("/c"), build="avx9")


def test_the_builds_differ_in_their_cpu_flags_only():
    assert "-DGGML_AVX512=OFF" in llama_server.BUILDS["portable"] and "-DGGML_NATIVE=OFF" in llama_server.BUILDS["portable"]
    assert llama_server.BUILDS["native"] == ["-DGGML_NATIVE=ON"]
    # the portable anchor is llama.cpp built as the llama-cpp-python wheel osd's llama.cpp arms run is built
    setup = (Path(__file__).parents[2] / "scripts" / "setup.sh").read_text()
    cmake_args = setup.split('CMAKE_ARGS="', 1)[1].split('"', 1)[0].split()
    assert cmake_args == llama_server.BUILDS["portable"]


def test_build_features_are_what_the_builds_ggml_says_it_was_compiled_for(tmp_path):
    """A stand-in ggml (two tiny shared libraries, as a shared llama.cpp build puts beside its binary) answers."""
    import subprocess

    answers = {"avx2": 1, "avx512": 1, "avx512_vnni": 0}
    body = "".join(f"int ggml_cpu_has_{name}(void) {{ return {answers.get(name, 0)}; }}\n"
                   for name in llama_server.FEATURES)
    (tmp_path / "cpu.c").write_text(body)
    (tmp_path / "base.c").write_text("int ggml_base_marker(void) { return 1; }\n")
    for src, lib in (("base.c", "libggml-base.so"), ("cpu.c", "libggml-cpu.so")):
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / lib), str(tmp_path / src)], check=True)
    line = llama_server.build_features(tmp_path / "llama-server")
    assert line.startswith("AVX2 = 1 | FMA = 0 | F16C = 0 | AVX512 = 1 | ") and "AVX512_VNNI = 0" in line
    assert line.count(" = ") == len(llama_server.FEATURES)
    assert llama_server.build_features(tmp_path / "missing" / "llama-server") is None


def test_each_llama_arm_runs_its_own_build_and_records_it(monkeypatch, tmp_path):
    asked = []

    def fake_ensure(log=print, build="portable"):
        asked.append(build)
        return tmp_path / build / "llama-server"

    async def fake_measure(server, learning, url, pid, config):
        return [{"concurrency": 1, "aggregate_tokens_per_s": 10.0}], {1: ["a"]}, None

    monkeypatch.setattr(serve_compare, "ensure_llama_server", fake_ensure)
    monkeypatch.setattr(serve_compare, "running", FakeRunning)
    monkeypatch.setattr(serve_compare, "measure_server", fake_measure)
    monkeypatch.setattr(serve_compare, "build_features", lambda binary: f"features of {binary.parent.name}")
    config = serve_compare.CompareConfig(Path("m.gguf"), ["w", "p"], levels=(1,), per_level=1,
                                         arms=("llama-server", "llama-server-native"), logs=tmp_path / "logs")
    result = serve_compare.run_compare(config)
    assert asked == ["portable", "native"]
    by_server = {r["server"]: r for r in result["records"]}
    assert by_server["llama-server"]["llama_build"] == "portable"
    assert by_server["llama-server-native"]["llama_build"] == "native"
    assert by_server["llama-server-native"]["llama_features"] == "features of native"
    assert by_server["llama-server"]["llama_features"] == "features of portable"
    assert result["identity"] == {}  # no osd arm: nothing to compare with the reference


def test_an_arm_whose_server_does_not_start_is_recorded_and_the_others_still_run(monkeypatch, tmp_path):
    """The native build died of SIGILL in its AMX code on an Intel Xeon: the run records why and goes on with the
    other arms instead of losing them all."""
    import os

    from osd_bench.serve_report import failed_lines

    crashing = tmp_path / "native" / "llama-server"
    crashing.parent.mkdir()
    crashing.write_text("#!/bin/sh\necho 'llama threadpool init, n_threads = 2'\nkill -ILL $$\n")
    os.chmod(crashing, 0o755)

    def either(command, url, log_path, env):  # the real start-up for the crashing binary, a healthy stand-in else
        return llama_server.running(command, url, log_path, env) if command[0] == str(crashing) else \
            FakeRunning(command, url, log_path, env)

    async def fake_measure(server, learning, url, pid, config):
        return [{"concurrency": 1, "aggregate_tokens_per_s": 10.0}], {1: ["a"]}, None

    monkeypatch.setattr(serve_compare, "ensure_llama_server", lambda log=print, build="portable":
                        crashing if build == "native" else tmp_path / build / "llama-server")
    monkeypatch.setattr(serve_compare, "running", either)
    monkeypatch.setattr(serve_compare, "measure_server", fake_measure)
    monkeypatch.setattr(serve_compare, "build_features", lambda binary: "features")
    config = serve_compare.CompareConfig(Path("m.gguf"), ["w", "p"], levels=(1,), per_level=1, port=18799,
                                         arms=("llama-server-native", "llama-server"), logs=tmp_path / "logs")
    result = serve_compare.run_compare(config)
    assert [r["server"] for r in result["records"]] == ["llama-server"]
    (failed,) = result["failed_arms"]
    assert failed["server"] == "llama-server-native" and "SIGILL" in failed["error"]
    assert failed["log_tail"] == ["llama threadpool init, n_threads = 2"]
    (line,) = failed_lines(result)
    assert line.startswith("- `llama-server-native` did not run: the server exited (SIGILL") and "threadpool" in line


def test_exit_reasons_name_the_signal():
    assert llama_server.exit_reason(1) == "code 1"
    assert llama_server.exit_reason(-9) == "SIGKILL"
    assert llama_server.exit_reason(-4).startswith("SIGILL (illegal instruction")


def record(server, c, tps, **extra):
    return dict(server=server, concurrency=c, aggregate_tokens_per_s=tps, peak_rss_bytes=None, **extra)


def test_ratios_to_each_build_and_no_native_column_without_its_arm():
    records = [record("llama-server", 4, 20.0), record("llama-server-native", 4, 25.0), record("osd", 4, 50.0)]
    osd = next(r for r in vs_rows(records) if r["server"] == "osd")
    assert osd["vs_llama"] == 2.5 and osd["vs_llama_native"] == 2.0
    assert "x llama-server native" in vs_table({"records": records})
    portable_only = [record("llama-server", 4, 20.0), record("osd", 4, 50.0)]
    assert next(r for r in vs_rows(portable_only) if r["server"] == "osd")["vs_llama_native"] is None
    assert "native" not in vs_table({"records": portable_only})


def test_prefill_and_build_lines_name_each_build():
    result = {"prefill": [{"server": "llama-server", "prompt_tokens": 1000, "prompt_tokens_per_s": 50.0, "ttft_s": 20.0},
                          {"server": "llama-server-native", "prompt_tokens": 1000, "prompt_tokens_per_s": 100.0,
                           "ttft_s": 10.0},
                          {"server": "osd", "prompt_tokens": 1000, "prompt_tokens_per_s": 120.0, "ttft_s": 8.3}],
              "records": [record("llama-server-native", 1, 9.0, llama_build="native", llama_features="AVX512 = 1"),
                          record("osd", 1, 12.0)]}
    osd_line = next(line for line in prefill_lines(result) if "`osd`" in line)
    assert "2.40x llama-server," in osd_line + "," and "1.20x llama-server-native" in osd_line
    assert "2.00x llama-server" in next(line for line in prefill_lines(result) if "native`" in line)
    assert build_lines(result) == ["- `llama-server-native` (native build): AVX512 = 1"]


def test_the_avx2_arms_run_osd_with_its_kernel_forced_onto_avx2_and_say_so(monkeypatch, tmp_path):
    """What an AVX2-only CPU runs, measured on a machine with AVX-512: the same `osd serve` flags as their plain arms,
    OSD_Q4_ISA=avx2 in their environment only, recorded beside the numbers; greedy answers checked against the
    reference arm like any osd arm's."""
    started = []

    class Recording(FakeRunning):
        def __init__(self, command, url, log_path, env):
            started.append((command, env))

    async def fake_measure(server, learning, url, pid, config):
        return [{"concurrency": 1, "aggregate_tokens_per_s": 10.0}], {1: ["same"]}, None

    monkeypatch.setattr(serve_compare, "running", Recording)
    monkeypatch.setattr(serve_compare, "measure_server", fake_measure)
    config = serve_compare.CompareConfig(Path("m.gguf"), ["w", "p"], levels=(1,), per_level=1,
                                         arms=("osd-target-only", "osd-target-only-avx2", "osd-avx2"),
                                         logs=tmp_path / "logs")
    result = serve_compare.run_compare(config)
    (plain_cmd, plain_env), (avx2_cmd, avx2_env), (spec_cmd, spec_env) = started
    assert plain_env is None and avx2_env["OSD_Q4_ISA"] == "avx2" and spec_env["OSD_Q4_ISA"] == "avx2"
    assert [a for a in avx2_cmd if a != avx2_cmd[avx2_cmd.index("--checkpoint-dir") + 1]] == \
        [a for a in plain_cmd if a != plain_cmd[plain_cmd.index("--checkpoint-dir") + 1]]
    assert "--k" not in spec_cmd
    by_server = {r["server"]: r for r in result["records"]}
    assert by_server["osd-target-only-avx2"]["osd_env"] == {"OSD_Q4_ISA": "avx2"}
    assert "osd_env" not in by_server["osd-target-only"]
    assert result["identity"]["osd-target-only-avx2"]["1"]["same"] == 1
