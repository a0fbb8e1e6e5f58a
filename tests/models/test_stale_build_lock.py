"""A build killed midway leaves torch's bare `lock` file; the next load must not wait on it forever."""
import os
import time

from osd.models.kernels import STALE_LOCK_SECONDS, clear_stale_lock


def test_old_lock_is_removed(tmp_path, capsys):
    lock = tmp_path / "lock"
    lock.write_bytes(b"")
    old = time.time() - STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path)
    assert not lock.exists()
    assert "stale build lock" in capsys.readouterr().err


def test_fresh_lock_is_kept(tmp_path):  # a build in progress elsewhere holds it
    lock = tmp_path / "lock"
    lock.write_bytes(b"")
    assert not clear_stale_lock(tmp_path)
    assert lock.exists()


def test_no_lock(tmp_path):
    assert not clear_stale_lock(tmp_path)
