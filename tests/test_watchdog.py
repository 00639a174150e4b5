"""The watchdog's settings, the flight recorder and ``zerosim flight``, under LocalWorld and alone.

The same watchdog under a real mpirun (a stalled rank ends the job) is in test_faults_mpi.py.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from mpi_helpers import ROOT

import zerosim as zs
from zerosim.cli.main import main
from zerosim.comm.flight import DEFAULT_TIMEOUT, FlightRecorder
from zerosim.faults import diagnosis
from zerosim.faults.flight_files import format_summary, read_reports, summarize


def _stall_rank_1(comm, seconds=2.0):
    """Rank 1 sleeps where the others all-reduce in phase 'step'."""
    with comm.phase("forward"):
        comm.all_gather(np.empty(4 * comm.size), np.ones(4))
    with comm.phase("step"):
        if comm.rank == 1:
            time.sleep(seconds)
        comm.all_reduce(np.ones(5, dtype=np.float32))


def test_local_timeout_names_the_call_and_the_missing_rank_with_the_flight_record():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        zs.LocalWorld(3, timeout=0.5).run(_stall_rank_1)
    assert time.monotonic() - t0 < 5
    text = str(info.value)
    assert "all_reduce call #2 (phase 'step', group 'world', float32, 5 elements" in text
    assert "waiting for rank(s) [1]" in text
    notes = "\n".join(info.value.__notes__)
    assert "flight record: the last 2 of 2 collective calls" in notes
    assert "not done" in notes  # the stalled call, in the record


def test_local_timeout_is_raised_in_every_waiting_thread_naming_the_missing_rank():
    seen = {}

    def fn(comm):
        try:
            _stall_rank_1(comm)
        except (TimeoutError, zs.comm.WorldAborted) as err:
            seen[comm.rank] = str(err)
            raise

    with pytest.raises(TimeoutError):
        zs.LocalWorld(3, timeout=0.5).run(fn)
    assert sorted(seen) == [0, 1, 2]
    for rank in (0, 2):  # a timeout of its own, or the first one's, quoted
        assert "waiting for rank(s) [1]" in seen[rank]


def test_timeout_zero_waits_as_long_as_it_takes():
    world = zs.LocalWorld(2, timeout=0)
    assert world.timeout == 0.0
    world.run(_stall_rank_1, 1.2)  # no error


def test_timeout_comes_from_the_environment_unless_given(monkeypatch):
    monkeypatch.setenv("ZEROSIM_TIMEOUT", "7.5")
    assert zs.LocalWorld(2).timeout == 7.5
    assert zs.LocalWorld(2).comms()[1].timeout == 7.5
    assert zs.LocalWorld(2, timeout=3).timeout == 3.0
    monkeypatch.setenv("ZEROSIM_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="ZEROSIM_TIMEOUT must be a number of seconds >= 0"):
        zs.LocalWorld(2)
    monkeypatch.delenv("ZEROSIM_TIMEOUT")
    assert zs.LocalWorld(2).timeout == DEFAULT_TIMEOUT == 600


def test_set_watchdog_applies_the_config_and_the_environment_wins(monkeypatch, tmp_path):
    monkeypatch.delenv("ZEROSIM_TIMEOUT", raising=False)
    monkeypatch.delenv("ZEROSIM_FLIGHT_DIR", raising=False)
    comm = zs.LocalWorld(2).comms()[0]
    comm.set_watchdog(timeout=30, flight_records=5, flight_dir=str(tmp_path))
    assert (comm.timeout, comm.ledger.flight.size, comm.ledger.flight.directory) == (
        30.0,
        5,
        str(tmp_path),
    )
    monkeypatch.setenv("ZEROSIM_TIMEOUT", "4")
    monkeypatch.setenv("ZEROSIM_FLIGHT_DIR", str(tmp_path / "env"))
    comm.set_watchdog(timeout=30, flight_dir=str(tmp_path))
    assert comm.timeout == 4.0 and comm.ledger.flight.directory == str(tmp_path / "env")
    with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
        comm.timeout = -2


def test_sub_groups_inherit_the_timeout():
    def fn(comm):
        comm.timeout = 12
        return comm.split(comm.rank % 2).timeout

    assert zs.LocalWorld(4).run(fn) == [12.0] * 4


def test_flight_recorder_numbers_calls_and_keeps_the_last_k_after_a_ledger_reset():
    def fn(comm):
        comm.ledger.flight.resize(3)
        for _ in range(5):
            comm.all_reduce(np.ones(2))
        comm.ledger.reset()
        handle = comm.iall_reduce(np.ones(3))
        kept = [
            (seq, r.op, r.elements, r.wall_time is None) for seq, r in comm.ledger.flight.entries()
        ]
        handle.wait()
        return kept, comm.ledger.flight.calls, len(comm.ledger.records)

    kept, calls, records = zs.LocalWorld(2).run(fn)[0]
    assert calls == 6 and records == 1
    assert kept == [
        (4, "all_reduce", 2, False),
        (5, "all_reduce", 2, False),
        (6, "all_reduce", 3, True),  # started, not waited on yet
    ]


def test_flight_recorder_counts_in_the_cell_it_is_given():
    """The MPI watchdog hands the recorder a cell of the node's shared progress table: the count
    moves there and every call begun is written there at once."""
    recorder = FlightRecorder()
    for _ in range(2):
        recorder.begin(None)
    cell = memoryview(bytearray(8)).cast("q")
    recorder.count_in(cell)
    assert cell[0] == 2
    assert recorder.begin(None) == 3 and cell[0] == recorder.calls == 3


def test_flight_recorder_rejects_a_negative_size():
    with pytest.raises(ValueError, match="flight_records must be an int >= 0, got -1"):
        FlightRecorder(-1)


def test_local_timeout_writes_a_flight_file_that_zerosim_flight_reads(tmp_path, capsys):
    def fn(comm):
        comm.set_watchdog(timeout=0.5, flight_dir=str(tmp_path))
        _stall_rank_1(comm)

    with pytest.raises(TimeoutError):  # 2 ranks: with a third waiting beside rank 0, either
        zs.LocalWorld(2).run(fn)  # may time out first and the other is released unrecorded
    files = sorted(p.name for p in tmp_path.glob("rank*.json"))
    assert "rank0.json" in files and "rank1.json" not in files
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["calls"] == 2 and report["waiting"]["call"] == 2
    assert report["records"][-1]["op"] == "all_reduce"
    assert report["records"][-1]["wall_time_s"] is None
    assert main(["flight", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "rank 0: began 2 calls, waits in all_reduce call #2 (phase 'step'" in out
    assert "rank 1: no file" in out


def _report(rank, calls, waiting=None, node=None, reason="timeout after 10.0 s", size=3):
    records = [
        {
            "call": c,
            "op": "all_reduce",
            "phase": "step",
            "group": "world",
            "dtype": "float32",
            "elements": 8,
            "step": 1,
            "blocking": True,
            "start_s": 0.0,
            "wall_time_s": None if c == waiting else 0.001,
        }
        for c in range(max(1, calls - 2), calls + 1)
    ]
    what = None if waiting is None else f"all_reduce call #{waiting} (phase 'step')"
    return {
        "rank": rank,
        "size": size,
        "reason": reason,
        "calls": calls,
        "waiting": None if waiting is None else {"call": waiting, "what": what},
        "records": records,
        "node_ranks": node,
    }


def _seen(calls, waiting=None, stage=None, op="all_reduce", silent_s=0.1, left=None):
    """A rank as the progress table shows it (watchdog.Progress.read); ``left``: how it left the
    program ("exited", "vanished"), ``silent_s`` seconds ago."""
    state = {"calls": calls, "waiting": waiting, "op": None, "stage": None, "waited_s": None}
    if stage is not None:
        state.update(op=op, stage=stage, waited_s=10.0)
    return {**state, "silent_s": silent_s, "left": left, "left_s": silent_s if left else None}


def test_summary_names_the_rank_behind_from_a_neighbours_view():
    check = "cross-rank argument check"
    node = {"0": _seen(9, 9, check), "1": _seen(8), "2": _seen(9, 9, check)}
    reports = [_report(0, 9, waiting=9, node=node), _report(2, 9, waiting=9, node=node)]
    summary = summarize(reports)
    assert summary["behind"] == [1] and summary["waiting"] == [0, 2]
    assert summary["silent"] == []
    text = format_summary(summary)
    assert "rank 1 is behind: it began 8 collective calls, other ranks 9" in text
    assert "ranks [0, 2] wait for it in all_reduce call #9 (phase 'step')" in text
    assert "rank 1: began 8 calls, is not in a collective [wrote no file" in text


def test_summary_blames_a_stopped_rank_not_one_waiting_in_a_non_blocking_calls_wait():
    """Rank 1 began fewer calls than the others but waits in wait() of call #7 (a non-blocking
    all-gather): held up, not behind. Rank 3 shows no sign of life: the cause."""
    node = {
        "0": _seen(9, 9, "cross-rank argument check"),
        "1": _seen(8, 7, "wait() of the non-blocking call", op="all_gather"),
        "2": _seen(9, 9, "cross-rank argument check"),
        "3": _seen(9, 9, silent_s=10.2),  # stopped just as it entered call #9: op not seen
    }
    reports = [_report(q, 9, waiting=9, node=node, size=4) for q in (0, 2)]
    summary = summarize(reports)
    assert summary["silent"] == [3] and summary["behind"] == []
    assert summary["waiting"] == [0, 1, 2]
    text = format_summary(summary)
    assert "is behind" not in text
    assert (
        "rank 1: began 8 calls, waits in call #7 (all_gather, wait() of the non-blocking call) "
        "for 10.0 s [wrote no file" in text
    )
    assert "rank 1 began fewer calls (8) but is inside call #7: it arrived there" in text
    # the op of call #9, which rank 3's watchdog thread did not see, from rank 0's own record
    assert (
        "rank 3 shows no sign of life for 10.2 s: its process does not run (stopped: SIGSTOP, a "
        "debugger; or frozen); it began 9 calls and is inside call #9 (all_reduce)" in text
    )
    assert "ranks [0, 1, 2] wait for it in the calls above" in text  # not all in one call


def test_diagnose_sorts_ranks_by_what_holds_the_call_up():
    states = {
        0: _seen(5, 5, "data exchange"),  # inside the call
        1: _seen(4),  # running, in no collective, began fewer: never arrived
        2: _seen(3, 2, "wait() of the non-blocking call"),  # inside an earlier call
        3: _seen(5, silent_s=1.5),  # no sign of life, wherever it is
        4: _seen(5),  # began the call and is past it
    }
    assert diagnosis.diagnose(5, states) == {
        "exited": [],
        "silent": [3],
        "absent": [1],
        "inside": [0, 2],
    }
    assert diagnosis.rank_state(states[0]) == (
        "began 5 calls, waits in call #5 (all_reduce, data exchange) for 10.0 s"
    )
    assert diagnosis.rank_state(_seen(5, 5, "data exchange", silent_s=3.0)) == (
        "began 5 calls, is inside call #5 (all_reduce); no sign of life for 3.0 s "
        "(its process does not run)"  # what it waits for there is not now's
    )
    assert diagnosis.rank_state(_seen(5, 5)) == "began 5 calls, is inside call #5"
    assert not diagnosis.is_silent(_seen(5, silent_s=diagnosis.SILENT_S))


def test_a_rank_that_left_the_program_is_exited_not_silent_and_never_arrives_at_later_calls():
    states = {
        0: _seen(5, 5, "cross-rank argument check"),
        1: _seen(4, silent_s=3.0, left="exited"),  # its exit hook ran after call #4
        2: _seen(5, silent_s=2.0, left="vanished"),  # silent, and its process is gone
    }
    assert diagnosis.diagnose(5, states) == {
        "exited": [1, 2],
        "silent": [],
        "absent": [],
        "inside": [0],
    }
    assert diagnosis.rank_state(states[1]) == (
        "began 4 calls, is not in a collective; exited 3.0 s ago (it left the program)"
    )
    assert diagnosis.rank_state(states[2]) == (
        "began 5 calls, is not in a collective; its process is gone (no sign of life for 2.0 s)"
    )
    # it never begins call #5; it began call #5 itself, and a running rank may yet arrive
    assert diagnosis.never_arrives(5, states[1]) and not diagnosis.never_arrives(5, states[2])
    assert not diagnosis.never_arrives(5, _seen(4))
    # a set-up step after call #4 (a split, a barrier of MPIComm's own) that it never reached
    assert diagnosis.never_arrives(4, states[1], setup=True)
    assert not diagnosis.never_arrives(4, states[1])


def test_summary_names_a_rank_that_left_and_the_last_call_it_began():
    check = "cross-rank argument check"
    node = {
        "0": _seen(9, 9, check),
        "1": _seen(8, silent_s=1.4, left="exited"),
        "2": _seen(9, 9, check),
    }
    reports = [
        _report(q, 9, waiting=9, node=node, reason="rank(s) [1] left the program") for q in (0, 2)
    ]
    summary = summarize(reports)
    assert summary["exited"] == [1] and summary["silent"] == [] and summary["behind"] == []
    assert summary["waiting"] == [0, 2]
    text = format_summary(summary)
    assert (
        "rank 1 exited 1.4 s before the file was written (its program ended: sys.exit, a return "
        "from the main program, or an exception that did not reach zerosim's exception hook); "
        "the last call it began was #8 all_reduce (phase 'step', group 'world', float32, 8 "
        "elements), and every later call it takes part in waits for it" in text
    )
    assert "ranks [0, 2] wait for it in all_reduce call #9 (phase 'step')" in text
    assert "is behind" not in text and "no sign of life" not in text


def test_a_process_that_ended_is_gone_and_a_running_one_is_not():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 60
    while not diagnosis.process_gone(child.pid) and time.monotonic() < deadline:
        time.sleep(0.01)  # ended, not yet collected: a zombie, which counts as gone
    assert diagnosis.process_gone(child.pid)
    child.wait()  # collected: no such process
    assert diagnosis.process_gone(child.pid)
    assert not diagnosis.process_gone(os.getpid())


def test_summary_of_a_rank_that_raised_and_of_ranks_that_agree():
    raised = [_report(0, 5), _report(1, 5, reason="exception: ValueError: boom"), _report(2, 5)]
    text = format_summary(summarize(raised))
    assert "rank 1 raised: exception: ValueError: boom" in text
    assert "is behind" not in text
    same = format_summary(summarize([_report(q, 5, reason="exit") for q in range(3)]))
    assert "no rank is behind: every rank began 5 calls" in same


def test_zerosim_flight_without_records_exits_2_naming_the_folder(tmp_path, capsys):
    assert main(["flight", str(tmp_path)]) == 2
    assert "no flight records (rank*.json) in" in capsys.readouterr().err
    (tmp_path / "rank0.json").write_text("{")
    with pytest.raises(ValueError, match="not a zerosim flight record"):
        read_reports(tmp_path)


def test_zerosim_flight_json(tmp_path, capsys):
    for q in range(3):
        (tmp_path / f"rank{q}.json").write_text(json.dumps(_report(q, 4 if q else 3, None)))
    assert main(["flight", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["behind"] == [0] and data["most_calls"] == 4


# -- initialize(comm=None): which world ---------------------------------------------------------
_LAUNCHER = ("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPIR_", "MPI_LOCAL", "I_MPI_", "MV2_", "SLURM")


def _clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER)}
    env["PYTHONPATH"] = str(ROOT)
    return {**env, **extra}


def _default_comm_in_subprocess(env):
    code = (
        "import sys; from zerosim.comm import default_comm; c = default_comm(); "
        "print(type(c).__name__, c.size, 'mpi4py.MPI' in sys.modules)"
    )
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )


def test_default_comm_outside_any_launcher_is_one_rank_and_does_not_start_mpi():
    proc = _default_comm_in_subprocess(_clean_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["LocalComm", "1", "False"]


def test_default_comm_asks_mpi_under_a_launcher_it_does_not_recognise():
    proc = _default_comm_in_subprocess(_clean_env(PMI_RANK="0"))  # no size variable set
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["LocalComm", "1", "True"]  # MPI was asked: 1 rank here


def test_default_comm_refuses_a_launcher_size_that_mpi_does_not_see():
    proc = _default_comm_in_subprocess(_clean_env(OMPI_COMM_WORLD_SIZE="4"))
    assert proc.returncode != 0
    assert "the launcher started 4 ranks (OMPI_COMM_WORLD_SIZE=4) but MPI sees a world of 1" in (
        proc.stderr
    )
