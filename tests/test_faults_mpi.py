"""Faults as users meet them, under a real ``mpirun -n 3`` (tests/fault_worker.py): every job ends,
non-zero, in well under a minute, saying what happened; a checkpoint being written when a rank
died leaves the previous one loadable. docs/faults.md tabulates these cases and their times.
"""

import json
import re
import sys
import time

import numpy as np
import pytest
from mpi_helpers import run_mpi

import zerosim as zs
from zerosim.cli.main import main

pytestmark = pytest.mark.mpi

MPICH_KILLED = "KILLED BY SIGNAL: 9"  # hydra's report of a SIGKILLed rank
MPICH_KILLED_ALT = "EXIT CODE: 9"


def _run(fault, *args, timeout_s=5, limit=30.0, env=None, monkeypatch=None):
    monkeypatch.setenv("ZEROSIM_TIMEOUT", str(timeout_s))
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    t0 = time.monotonic()
    proc = run_mpi(3, ["tests/fault_worker.py", fault, *args], timeout=120)
    took = time.monotonic() - t0
    output = proc.stdout + proc.stderr
    sys.__stderr__.write(f"{fault}: exit code {proc.returncode} after {took:.1f} s\n")
    assert took < limit, output
    return proc, output


@pytest.mark.parametrize("phase", ["forward", "backward", "step"])
def test_a_rank_killed_during_a_phase_ends_the_job_in_seconds(phase, monkeypatch):
    proc, out = _run(f"kill_{phase}", monkeypatch=monkeypatch)
    assert proc.returncode != 0
    assert "rank 1: SIGKILL now" in out
    assert MPICH_KILLED in out or MPICH_KILLED_ALT in out, out
    assert "rank 0: finished" not in out


def test_a_rank_killed_while_saving_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    import fault_worker

    proc, out = _run("kill_save", str(tmp_path), monkeypatch=monkeypatch)
    assert proc.returncode != 0 and "rank 1: SIGKILL now" in out
    assert (tmp_path / "latest").read_text().strip() == "global_step2"
    # the interrupted save stays in its staging folder: never a tag folder, never named latest
    assert (tmp_path / ".global_step4.saving").is_dir()
    assert not (tmp_path / "global_step4").exists()
    expected = dict(np.load(tmp_path / "expected.npz"))

    def load(comm):
        engine = fault_worker.build(comm, stage=2)
        tag_dir, _ = engine.load_checkpoint(str(tmp_path))
        return tag_dir.name, engine.full_state_dict()

    for tag, state in zs.LocalWorld(2).run(load):  # another world size loads it too
        assert tag == "global_step2"
        assert state.keys() == expected.keys()
        for name, value in state.items():
            np.testing.assert_array_equal(value, expected[name])


@pytest.mark.slow
def test_a_rank_that_stops_calling_collectives_ends_the_job_naming_the_call_and_the_rank(
    tmp_path, monkeypatch, capsys
):
    env = {"ZEROSIM_FLIGHT_DIR": str(tmp_path)}
    proc, out = _run("sleep", timeout_s=10, limit=60.0, env=env, monkeypatch=monkeypatch)
    assert proc.returncode != 0
    assert "rank 1: sleeping" in out
    stalled = re.search(r"watchdog: (\w+) call #(\d+) \(phase '(\w+)', group 'world'", out)
    assert stalled is not None, out
    op, call, phase = stalled.groups()
    assert (op, phase) == ("all_reduce", "backward")  # stage 2's bucket, DeepSpeed's schedule
    assert f"rank(s) [1] have not reached call #{call} ({op})" in out
    assert "flight record: the last" in out and "not done" in out
    assert "aborting the job" in out
    capsys.readouterr()
    assert main(["flight", str(tmp_path)]) == 0
    report = capsys.readouterr().out
    assert "rank 1 is behind" in report
    assert f"wait for it in {op} call #{call}" in report


def test_a_rank_that_raises_ends_the_job_with_its_traceback_and_flight_record(
    tmp_path, monkeypatch
):
    env = {"ZEROSIM_FLIGHT_DIR": str(tmp_path)}
    proc, out = _run("raise", env=env, monkeypatch=monkeypatch)
    assert proc.returncode != 0
    assert "[zerosim rank 1] uncaught exception, aborting the job" in out
    assert "ValueError: deliberate failure on rank 1 in forward" in out
    assert "[zerosim rank 1] flight record: the last" in out
    report = json.loads((tmp_path / "rank1.json").read_text())
    assert report["reason"] == "exception: ValueError: deliberate failure on rank 1 in forward"
    assert report["records"][-1]["op"] == "all_gather"  # the last step's parameter gather


def test_initialize_finds_the_mpi_world_when_the_launcher_is_not_recognised(monkeypatch):
    proc, out = _run("hidden_launcher", monkeypatch=monkeypatch)
    assert proc.returncode == 0, out
    assert out.count("MPIComm of size 3") == 3


def test_ranks_with_different_configs_all_raise_naming_the_keys(monkeypatch):
    proc, out = _run("config_differs", monkeypatch=monkeypatch)
    assert proc.returncode == 0, out
    assert out.count("ConfigError: the config differs across ranks") == 3, out
    assert out.count("zero_optimization.stage: 2 on ranks [0, 1], 3 on ranks [2]") == 3, out


def test_a_rank_waiting_for_a_slow_one_leaves_the_cpu(monkeypatch):
    proc, out = _run("idle_wait", monkeypatch=monkeypatch)
    assert proc.returncode == 0, out
    waits = re.findall(r"waited ([\d.]+) s using ([\d.]+) s of CPU", out)
    assert len(waits) == 2, out
    for waited, cpu in waits:
        assert float(waited) > 1.2
        assert float(cpu) < 0.1 * float(waited), out  # MPI's own blocking call spins
