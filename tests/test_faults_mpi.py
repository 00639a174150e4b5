"""Faults as users meet them, under a real ``mpirun -n 3`` (tests/helpers/fault_worker.py): every
job ends,
non-zero, in well under a minute, saying what happened; a checkpoint being written when a rank
died leaves the previous one loadable. docs/faults.md tabulates these cases and their times.
"""

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from fault_worker import STOP_TIMEOUT_S, VICTIM
from mpi_helpers import ROOT, mpirun_path, run_mpi

import zerosim as zs
from zerosim.cli.main import main

pytestmark = pytest.mark.mpi

MPICH_KILLED = "KILLED BY SIGNAL: 9"  # hydra's report of a SIGKILLed rank
MPICH_KILLED_ALT = "EXIT CODE: 9"


def _run(fault, *args, timeout_s=5, limit=30.0, env=None, monkeypatch=None, n=3):
    """``mpirun -n n`` the fault; ``timeout_s=None``: the default timeout (600 s)."""
    if timeout_s is None:
        monkeypatch.delenv("ZEROSIM_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("ZEROSIM_TIMEOUT", str(timeout_s))
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    t0 = time.monotonic()
    proc = run_mpi(n, ["tests/helpers/fault_worker.py", fault, *args], timeout=120)
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
    assert f"rank(s) [1] never arrived at call #{call} ({op})" in out
    assert "rank 1: began" in out and "is not in a collective" in out
    assert "no sign of life" not in out  # asleep, but its process runs
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


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("how", ["exit", "return"])
def test_a_rank_that_leaves_the_program_ends_the_job_in_seconds_naming_it_and_its_last_call(
    how, n, tmp_path, monkeypatch, capsys
):
    """Rank 1 leaves the program at its third micro-step, by ``sys.exit("…")`` (exit code 1) or
    by a return from the main program (exit code 0), while the others train on; neither passes
    through the exception hook. Under the default timeout (600 s) the job must end in seconds,
    non-zero, the waiting ranks saying that rank 1 exited and the last call it began, not that
    it shows no sign of life; ``zerosim flight`` must say the same from their files."""
    env = {"ZEROSIM_FLIGHT_DIR": str(tmp_path)}
    proc, out = _run(how, timeout_s=None, limit=30.0, env=env, monkeypatch=monkeypatch, n=n)
    assert proc.returncode != 0, out
    assert f"rank 1: leaving ({how})" in out
    if how == "exit":
        assert "rank 1: deliberate sys.exit at micro-step 3" in out
    else:
        assert "rank 1: finished" in out  # its program ended as a program does
    assert not any(f"rank {q}: finished" in out for q in range(n) if q != 1), out
    stalled = re.search(
        r"watchdog: (\w+) call #(\d+) \(phase '(\w+)'.* can never complete: rank\(s\) \[1\] "
        r"left the program without beginning it",
        out,
    )
    assert stalled is not None, out
    op, call, phase = stalled.group(1), int(stalled.group(2)), stalled.group(3)
    assert (op, phase) == ("all_reduce", "backward")  # the third step's first gradient bucket
    assert f"  rank 1: began {call - 1} calls, is not in a collective; exited" in out
    last = re.search(
        r"rank 1 exited [\d.]+ s ago \(its program ended: sys.exit, .*\); the last "
        r"call it began was (\w+) call #(\d+) \(phase '(\w+)'",
        out,
    )
    assert last is not None, out
    assert last.groups() == ("all_gather", str(call - 1), "step")  # the second step's last call
    assert f"so it never reaches call #{call} ({op})" in out
    assert "no sign of life" not in out and "has not completed after" not in out
    assert "aborting the job" in out
    capsys.readouterr()
    assert main(["flight", str(tmp_path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["exited"] == [1] and summary["silent"] == [] and summary["behind"] == []
    assert main(["flight", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert f"the last call it began was #{call - 1} all_gather (phase 'step'" in text, text


def test_ranks_that_end_at_different_times_end_the_job_normally(monkeypatch):
    """Rank 1 ends first; ranks 0 and 2 go on in a group of their own, rank 2 waiting there
    2.5 s for rank 0, long after rank 1 left with fewer calls begun: a normal end, exit code 0,
    and no watchdog report."""
    proc, out = _run("end_apart", timeout_s=None, monkeypatch=monkeypatch)
    assert proc.returncode == 0, out
    assert all(f"rank {q}: finished" in out for q in range(3)), out
    assert "watchdog" not in out


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


def test_a_job_whose_watchdog_said_it_aborts_fails_although_the_program_finished(
    tmp_path, monkeypatch
):
    """A waiting rank's watchdog decides to abort, and rank 1 arrives right then (it waits for the
    flight file the watchdog writes just before "aborting the job"): the program completes on
    every rank while the watchdog gives the launcher time to forward its words. The job exited
    0 in every run before the abort was made final; it must fail in every run."""
    whole_program_ran = 0
    for attempt in range(3):
        env = {"ZEROSIM_FLIGHT_DIR": str(tmp_path / str(attempt))}
        proc, out = _run("late_in_the_abort", env=env, monkeypatch=monkeypatch)
        assert "all_reduce call #4 (phase 'none'" in out, out  # the last all-reduce, not set-up
        assert "watchdog: aborting the job" in out, out
        assert proc.returncode != 0, out
        whole_program_ran += all(f"rank {q}: finished" in out for q in range(3))
    assert whole_program_ran  # the race was run: at least once every rank got to the end


def _start_mpi(n: int, args: list[str], stderr: object) -> subprocess.Popen:
    """``mpirun -n n python ARGS`` as run_mpi starts it, but left running (stdout piped)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("PYTHONUNBUFFERED", None)
    env.pop("ZEROSIM_TIMEOUT", None)  # the worker sets its own once the ranks are in step
    cmd = [mpirun_path(), "-n", str(n), sys.executable, *args]
    pipe = subprocess.PIPE
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=pipe, stderr=stderr, text=True)


_RANK_LINE = re.compile(r"^  rank (\d+)(?: \(this rank\))?: began (\d+) calls, (.*)$", re.M)
_WAITS = re.compile(r"waits in call #(\d+) \((\w+), (.+?)\) for")


def _first_report(err: str) -> dict[int, tuple[int, str]]:
    """{rank: (calls begun, where)} from the first watchdog report in ``err``."""
    head = re.search(r"watchdog: .* has not completed after .*\n", err)
    assert head is not None, err
    block = re.match(r"(?:  rank .*\n)+", err[head.end() :])
    assert block is not None, err
    return {int(q): (int(c), where) for q, c, where in _RANK_LINE.findall(block.group(0))}


@pytest.mark.parametrize("n", [3, 4])
def test_a_stopped_rank_is_named_with_its_count_and_no_rank_inside_a_call_is_blamed(
    n, tmp_path, monkeypatch, capsys
):
    """SIGSTOP one rank of a stage 3 job (all-gathers and reduce-scatters completed in wait())
    at whatever point of its training it is: the watchdog of a waiting rank must say that the
    stopped rank shows no sign of life, give its count of calls as it is (it stopped after that
    many), and show every other rank inside a call, none of them as having stopped calling
    collectives; ``zerosim flight`` must blame the stopped rank alone."""
    folder = tmp_path / "flight"
    monkeypatch.setenv("ZEROSIM_FLIGHT_DIR", str(folder))
    errors = open(tmp_path / "stderr.txt", "w+")  # noqa: SIM115  (read back below)
    proc = _start_mpi(n, ["tests/helpers/fault_worker.py", "train_until_stopped"], errors)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    pids, training, out = {}, 0, []
    try:
        deadline = time.monotonic() + 120
        while training < n:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            out.append(line)
            if m := re.match(r"rank (\d+): pid (\d+)", line):
                pids[int(m.group(1))] = int(m.group(2))
            training += line.endswith(": training\n")
        time.sleep(0.3)  # somewhere in a step, wherever that is
        os.kill(pids[VICTIM], signal.SIGSTOP)
        stopped = time.monotonic()
        proc.wait(timeout=60)
        took = time.monotonic() - stopped
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in pids.values():  # a stopped process the launcher left behind
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=60)
    errors.seek(0)
    err = errors.read()
    sys.__stderr__.write(f"SIGSTOP: exit code {proc.returncode}, {took:.1f} s after the stop\n")
    assert proc.returncode != 0
    assert took < STOP_TIMEOUT_S + 10, err

    ranks = _first_report(err)
    assert sorted(ranks) == list(range(n)), err
    victim, where = ranks.pop(VICTIM)
    assert "no sign of life" in where, err
    assert f"rank(s) [{VICTIM}] show no sign of life" in err
    assert "never arrived" not in err and "no sign of life" not in "".join(
        w for _, w in ranks.values()
    ), err
    # Bounds on the stopped rank's count from where the running ranks are now. A rank begins
    # call #c + 1 only after the argument check of call #c, which needs every rank to have begun
    # #c; a rank past the check of #k (in its data exchange or wait()) saw every rank begin #k.
    lowest, highest = 0, min(calls for calls, _ in ranks.values()) + 1
    for calls, where in ranks.values():
        lowest = max(lowest, calls - 1)
        waits = _WAITS.search(where)
        assert waits is not None or "is inside call #" in where, err  # inside a call, all
        if waits is not None and waits.group(3) != "cross-rank argument check":
            lowest = max(lowest, int(waits.group(1)))
    assert lowest <= victim <= highest, err

    capsys.readouterr()
    assert main(["flight", str(folder), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["silent"] == [VICTIM] and summary["behind"] == [], summary
    assert main(["flight", str(folder)]) == 0
    text = capsys.readouterr().out
    assert f"rank {VICTIM} shows no sign of life" in text and "is behind" not in text, text
