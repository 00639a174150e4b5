"""The peer runner's own housekeeping (no DeepSpeed launch)."""

import os


def test_a_stale_extension_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch):
    """A lock left by a process killed while building DeepSpeed's CPU op would make every later
    DeepSpeed launch wait for ever; one younger than a build's time may be a build under way."""
    from runner import STALE_LOCK_S, clear_stale_extension_locks

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    old, fresh = tmp_path / "py311_cpu" / "fused_adam", tmp_path / "py311_cpu" / "shm_comm"
    for folder in (old, fresh):
        folder.mkdir(parents=True)
        (folder / "lock").touch()
    now = (fresh / "lock").stat().st_mtime
    os.utime(old / "lock", (now - STALE_LOCK_S - 1, now - STALE_LOCK_S - 1))
    assert clear_stale_extension_locks(now) == [old / "lock"]
    assert not (old / "lock").exists() and (fresh / "lock").exists()
