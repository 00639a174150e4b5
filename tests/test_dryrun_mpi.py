"""The dry run against real runs: its ledger and memory equal those of mpirun, rank by rank.

For N = 2, 3, 4 and 8, one mpirun launch trains every configuration of ``dryrun_cases`` (every
stage, both schedules, fp32 and bf16, ZeRO++ on and off) on real arrays; the dry run of the same
model and config (its representatives of each class of rank, as ``zerosim dryrun`` runs by
default) must give every rank the same ledger, record for record (op, phase, group, dtype,
elements, bytes sent and received, order), and the same ``memory_report()``, to the byte.

For N = 2 and 3, a second launch trains the cases of ``schedule_cases`` (stages 2 and 3, both
schedules, DeepSpeed's stage 1, recomputation, a binding ``stage3_max_live_parameters``, qgZ)
and records each rank's last step as the ordered collective issues, waits and stream notes
(``ledger.events``); the dry run's timeline events of each representative must be the same
list.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace

import dryrun_cases
import pytest
import schedule_cases
from mpi_helpers import ROOT, mpirun_path

from zerosim.dryrun import recipe, records_of, run_world

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def _start_mpi(n: int, args: list[str]) -> subprocess.Popen:
    """``mpirun -n n python ARGS`` started in the background (as mpi_helpers.run_mpi runs it)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("PYTHONUNBUFFERED", None)
    cmd = [mpirun_path(), "-n", str(n), sys.executable, *args]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _real_and_dry(n: int, worker: str, tmp_path, cases, dry_runs) -> tuple[list, dict]:
    """Each rank's JSON of ``mpirun -n n python tests/helpers/WORKER TMP`` and, computed while
    the real runs run, ``dry_runs(case)`` of every case by its name."""
    job = _start_mpi(n, [f"tests/helpers/{worker}", str(tmp_path)])
    try:
        dry = {case.name: dry_runs(case) for case in cases}
        out, err = job.communicate(timeout=600)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out[-3000:] + err[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)], dry


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_dry_run_ledger_and_memory_equal_the_mpirun_ones(n, tmp_path):
    model = recipe(dryrun_cases.MODEL_SPEC)

    def dry_runs(case):
        return run_world(
            model,
            n,
            dryrun_cases.config(case, n),
            micro_batch=dryrun_cases.MICRO_BATCH,
            steps=dryrun_cases.STEPS,
        )[0]

    real, dry = _real_and_dry(n, "dryrun_worker.py", tmp_path, dryrun_cases.cases(), dry_runs)
    mismatches = []
    for case in dryrun_cases.cases():
        runs = dry[case.name]
        assert sorted(r for members, _ in runs for r in members) == list(range(n))
        for members, run in runs:
            for r in members:
                want = real[r][case.name]
                got = [dryrun_cases.record_key(x) for x in records_of(run, r)]
                assert got, case.name
                if got != want["records"]:
                    first = next(
                        (
                            i
                            for i, (a, b) in enumerate(zip(got, want["records"], strict=False))
                            if a != b
                        ),
                        min(len(got), len(want["records"])),
                    )
                    mismatches.append(
                        f"{case.name} rank {r}: record {first} of {len(want['records'])}: "
                        f"dry {got[first : first + 1]} real {want['records'][first : first + 1]}"
                    )
                if run.memory != want["memory"]:
                    mismatches.append(
                        f"{case.name} rank {r}: memory {run.memory} real {want['memory']}"
                    )
    assert not mismatches, "\n".join(mismatches[:20])


def _dry_schedule(run) -> list[list]:
    """The issues, waits and stream notes the dry run's time model reads for ``run``'s last
    step."""
    calls = run.comm.calls
    return schedule_cases.schedule_of(
        [
            (kind, value if kind == "stream" else calls[value].record)
            for kind, value in run.events
            if kind in ("issue", "wait", "stream")
        ]
    )


@pytest.mark.parametrize("n", [2, 3])
def test_dry_run_schedule_equals_the_mpirun_one(n, tmp_path):
    """Each representative's step, as the time model replays it (issues, waits and stream
    notes in order), equals the same rank's real step under mpirun: stages 2 and 3, both
    schedules, and DeepSpeed's stage 1, with recomputation, with a binding
    ``stage3_max_live_parameters``, without ``overlap_comm``, under qgZ (DeepSpeed's buckets
    noted on its reduction stream at every stage, qgZ's too), and with Composer's train
    metrics (a barrier and an all-gather per metric and state after the step)."""
    model = recipe(schedule_cases.MODEL_SPEC)

    def dry_runs(case):
        return run_world(
            replace(model, metrics=schedule_cases.METRICS if case.metrics else ()),
            n,
            schedule_cases.config(case),
            micro_batch=schedule_cases.MICRO_BATCH,
            steps=schedule_cases.STEPS,
            recompute=case.recompute,
        )[0]

    real, dry = _real_and_dry(n, "schedule_worker.py", tmp_path, schedule_cases.cases(), dry_runs)
    mismatches = []
    for case in schedule_cases.cases():
        for _, run in dry[case.name]:
            want, got = real[run.rank][case.name], _dry_schedule(run)
            # with overlap, waits to compare; without, none (a blocking call has no wait)
            assert any(e[0] == "wait" for e in want) == case.overlap, case.name
            if got != want:
                first = next(
                    (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                    min(len(got), len(want)),
                )
                mismatches.append(
                    f"{case.name} rank {run.rank}: event {first} of {len(want)}: "
                    f"dry {got[first : first + 2]} real {want[first : first + 2]}"
                )
    assert not mismatches, "\n".join(mismatches[:20])
    # the metrics' sync closes the step: per metric and state a barrier and an all-gather
    synced = [e for e in real[0]["stage3-deepspeed-metrics"] if e[1:2] == ["metrics"]]
    assert [e[0] for e in synced] == ["barrier", "all_gather"] * 4
    assert [e[3:5] for e in synced[1::2]] == [["float32", n], ["int64", n]] * 2
    # the cap binds: without it DeepSpeed's coordinator prefetches, with it it cannot
    capped = schedule_cases.Case(3, "deepspeed", False, schedule_cases.BINDING_MAX_LIVE)
    assert real[0][capped.name] != real[0]["stage3-deepspeed"]
    # on DeepSpeed's schedule with overlap_comm every gradient reduction (stage 3's
    # reduce-scatters or qgZ's all-to-alls, stage 2's all-reduces) sits inside a
    # reduction-stream stretch, one per bucket ("reduce" at stage 3, "reduce_in_turn" at stage
    # 2), and each backward ends by waiting for the stream; elsewhere nothing is noted
    accumulation = schedule_cases.config(schedule_cases.cases()[0])["gradient_accumulation_steps"]
    for case in schedule_cases.cases():
        events = real[0][case.name]
        notes = [e[1] for e in events if e[0] == "stream"]
        if case.schedule != "deepspeed" or not case.overlap:
            assert not notes, case.name
            continue
        opening = "reduce" if case.stage == 3 else "reduce_in_turn"
        assert notes.count(opening) == notes.count("compute") > 0, case.name
        # stage 1 reduces in the boundary's backward only
        assert notes.count("sync") == (1 if case.stage == 1 else accumulation), case.name
        inside, reductions = False, 0
        for e in events:
            if e[0] == "stream":
                inside = e[1] == opening
            elif e[0] in ("reduce_scatter", "all_to_all", "all_reduce") and e[1] == "backward":
                assert inside, f"{case.name}: a gradient {e[0]} outside a reduction stretch"
                reductions += 1
        assert reductions > 0, case.name
