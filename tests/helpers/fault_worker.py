"""Faults as users meet them, under a real mpirun: ``mpirun -n 3 python
tests/helpers/fault_worker.py FAULT [DIR]``.

Every rank trains a small MLP (ZeRO stage 2, or 3 where the fault is in forward or backward, so that
the phase moves data); rank 1 meets the fault at micro-step ``AT``:

    kill_forward, kill_backward, kill_step   SIGKILL from a forward pre-hook, a backward hook, or
                                             the optimizer's step (between the clip all-reduce and
                                             the parameter all-gather)
    kill_save DIR                            save DIR/global_step2, train, and SIGKILL while
                                             writing DIR/global_step4 (after its own files)
    sleep                                    sleep instead of the backward's collectives
    raise                                    raise ValueError in forward
    hidden_launcher                          (no fault) hide the launcher's size variables, then
                                             initialize(comm=None) must still find 3 ranks
    exit, return                             (any number of ranks) leave the program before the
                                             forward: sys.exit("…"), or a return from the main
                                             program
    end_apart                                (no fault; 3 ranks) rank 1 ends first, the others go
                                             on in a group of their own: a normal end
    idle_wait                                (no fault) rank 1 computes 1.5 s before an all-reduce;
                                             the others say how much CPU their wait used
    config_differs                           rank 2 loads another config: ConfigError on all ranks
    late_in_the_abort                        rank 1 joins the last all-reduce only once a waiting
                                             rank's watchdog wrote its flight file (it has decided
                                             to abort): the program then finishes on every rank
    train_until_stopped                      (any number of ranks) print the pid, train stage 3
                                             (non-blocking gathers and reductions) until the test
                                             SIGSTOPs a rank

``tests/test_faults_mpi.py`` launches each and checks how the job ends.
"""

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from zerosim.engine import initialize  # noqa: E402
from zerosim.nn import MLP  # noqa: E402

AT = 3  # the micro-step (from 1) at which rank 1 meets its fault
VICTIM = 1
LATE_TIMEOUT_S = 0.5  # late_in_the_abort's timeout, set once the ranks are in step
STOP_TIMEOUT_S = 2.0  # train_until_stopped's


def config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64},
    }


def build(comm: object, stage: int) -> object:
    engine, *_ = initialize(MLP([8, 16, 16, 4], seed=0), config(stage), comm=comm)
    return engine


def train(engine: object, steps: int, start: int = 0) -> None:
    rng = np.random.default_rng(start * 10 + engine.comm.rank)
    for _ in range(steps):
        x, y = rng.standard_normal((4, 8)), rng.integers(0, 4, 4)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()


def say(text: str) -> None:
    sys.stdout.write(text + "\n")  # one write, so the ranks' lines do not interleave
    sys.stdout.flush()


def die() -> None:
    say(f"rank {VICTIM}: SIGKILL now")
    os.kill(os.getpid(), signal.SIGKILL)


def when_at(engine: object, action: object) -> object:
    """A hook body that runs ``action`` on the victim at micro-step AT, once."""

    def hook(*_: object) -> None:
        if engine.comm.rank == VICTIM and engine.micro_steps + 1 == AT:
            action()

    return hook


def kill_in(phase: str, comm: object) -> None:
    engine = build(comm, stage=2 if phase == "step" else 3)
    layer = engine.module.layers[2]
    if phase == "forward":
        layer.register_forward_pre_hook(when_at(engine, die))
    elif phase == "backward":
        layer.register_full_backward_hook(when_at(engine, die))
    else:
        update = engine.optimizer.step

        def step(*args: object, **kwargs: object) -> object:
            if engine.comm.rank == VICTIM and engine.micro_steps == AT:
                die()
            return update(*args, **kwargs)

        engine.optimizer.step = step
    train(engine, 2 * AT)


def kill_save(comm: object, ckpt: str) -> None:
    import zerosim.checkpoint.sharded as sharded

    engine = build(comm, stage=2)
    train(engine, 2)
    engine.save_checkpoint(ckpt)  # global_step2: the one that must still load
    if comm.rank == 0:
        np.savez(Path(ckpt) / "expected.npz", **engine.full_state_dict())
    else:
        engine.full_state_dict()
    train(engine, 2, start=2)
    write = sharded._write_rank_files

    def write_then_die(engine: object, tag_dir: Path) -> object:
        manifest = write(engine, tag_dir)
        if engine.comm.rank == VICTIM:
            die()
        return manifest

    sharded._write_rank_files = write_then_die
    engine.save_checkpoint(ckpt)  # global_step4: rank 1 dies in it


def sleep(comm: object) -> None:
    engine = build(comm, stage=2)
    engine.module.layers[2].register_full_backward_pre_hook(
        when_at(engine, lambda: (say(f"rank {VICTIM}: sleeping"), time.sleep(300)))
    )
    train(engine, 2 * AT)


def fail(comm: object) -> None:
    engine = build(comm, stage=2)

    def bad_batch() -> None:
        raise ValueError(f"deliberate failure on rank {VICTIM} in forward")

    engine.module.layers[0].register_forward_pre_hook(when_at(engine, bad_batch))
    train(engine, 2 * AT)


def leave(comm: object, how: str) -> None:
    """Rank 1 leaves the program at micro-step AT (before its forward, stage 2), while the others
    train on: ``exit`` calls ``sys.exit`` with a message (exit code 1), ``return`` returns from the
    main program (exit code 0). Neither goes through the exception hook."""
    engine = build(comm, stage=2)
    rng = np.random.default_rng(comm.rank)
    for _ in range(2 * AT):
        if comm.rank == VICTIM and engine.micro_steps + 1 == AT:
            say(f"rank {VICTIM}: leaving ({how})")
            if how == "exit":
                sys.exit(f"rank {VICTIM}: deliberate sys.exit at micro-step {AT}")
            return
        x, y = rng.standard_normal((4, 8)), rng.integers(0, 4, 4)
        engine.backward(engine(x, y))
        engine.step()


def end_apart(comm: object) -> None:
    """Rank 1 ends as soon as the training they share is done; ranks 0 and 2 go on in a group of
    their own, where rank 2 waits 2.5 s for rank 0 (it computes) in an all-reduce, long after
    rank 1 left: a normal end, in which no rank may be reported."""
    train(build(comm, stage=2), AT)
    pair = comm.split(1 if comm.rank == VICTIM else 0, name="pair")
    if comm.rank == VICTIM:
        return
    if comm.rank == 0:
        time.sleep(2.5)
    pair.all_reduce(np.ones(4))


def hidden_launcher() -> None:
    from mpi4py import MPI  # noqa: F401  (MPI starts as the launcher set it up)

    from zerosim.comm import SIZE_VARIABLES

    for var in SIZE_VARIABLES:  # now zerosim's environment check recognises no launcher
        os.environ.pop(var, None)
    engine, *_ = initialize(MLP([8, 4], seed=0), config(1))  # comm=None: MPI is asked
    train(engine, 1)
    say(f"rank {engine.comm.rank}: {type(engine.comm).__name__} of size {engine.comm.size}")


def idle_wait(comm: object) -> None:
    """Rank 1 computes (sleeps) 1.5 s before an all-reduce; the others report the CPU time they
    spent waiting for it: the watchdog's poll sleeps, where MPI's own call would spin."""
    import resource

    if comm.rank == VICTIM:
        time.sleep(1.5)
    before = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.monotonic()
    comm.all_reduce(np.ones(1024))
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    if comm.rank != VICTIM:
        say(f"rank {comm.rank}: waited {time.monotonic() - t0:.2f} s using {cpu:.3f} s of CPU")


def config_differs(comm: object) -> None:
    cfg = config(stage=3 if comm.rank == 2 else 2)
    cfg["gradient_clipping"] = 1.0 if comm.rank == 2 else 0.0
    try:
        initialize(MLP([8, 4], seed=0), cfg, comm=comm)
    except ValueError as err:
        say(f"rank {comm.rank}: {type(err).__name__}: {err}")
        return
    raise AssertionError("the differing configs were not detected")


def late_in_the_abort(comm: object) -> None:
    """Three all-reduces, then the last one, which rank 1 joins late: once a flight file exists in
    ZEROSIM_FLIGHT_DIR, written by a waiting rank's watchdog after it decided to abort and before
    it says so. Every rank then completes the program while that watchdog is still ending the
    job: the job must fail all the same."""
    for _ in range(3):
        comm.all_reduce(np.ones(4))
    comm.timeout = LATE_TIMEOUT_S  # not before: the ranks start at different times
    if comm.rank == VICTIM:
        folder, deadline = Path(comm.ledger.flight.directory), time.monotonic() + 60
        while not any(folder.glob("rank*.json")) and time.monotonic() < deadline:
            time.sleep(0.002)
    comm.all_reduce(np.ones(4))


def train_until_stopped(comm: object, limit_s: float = 120.0) -> None:
    """Say this rank's pid, then train (stage 3 with overlap_comm: all-gathers and
    reduce-scatters started early and completed in ``wait()``) until a rank is stopped and the
    watchdog ends the job; "training" once a few steps are done. Gives up after ``limit_s``."""
    say(f"rank {comm.rank}: pid {os.getpid()}")
    cfg = config(stage=3)
    cfg["zero_optimization"]["overlap_comm"] = True
    engine, *_ = initialize(MLP([8, 16, 16, 16, 4], seed=0), cfg, comm=comm)
    comm.timeout = STOP_TIMEOUT_S  # not before: the ranks start at different times
    rng = np.random.default_rng(comm.rank)
    deadline, steps = time.monotonic() + limit_s, 0
    while time.monotonic() < deadline:
        x, y = rng.standard_normal((4, 8)), rng.integers(0, 4, 4)
        engine.backward(engine(x, y))
        engine.step()
        steps += 1
        if steps == 3:
            say(f"rank {comm.rank}: training")
    raise SystemExit(f"rank {comm.rank}: no rank was stopped within {limit_s} s")


if __name__ == "__main__":
    fault = sys.argv[1]
    if fault == "hidden_launcher":
        hidden_launcher()
        sys.exit(0)
    from zerosim.comm import MPIComm

    comm = MPIComm()
    if fault.startswith("kill_") and fault != "kill_save":
        kill_in(fault[5:], comm)
    elif fault == "kill_save":
        kill_save(comm, sys.argv[2])
    elif fault == "sleep":
        sleep(comm)
    elif fault == "raise":
        fail(comm)
    elif fault in ("exit", "return"):
        leave(comm, fault)  # rank 1's "return": its program ends here, early, with "finished"
    elif fault == "end_apart":
        end_apart(comm)
    elif fault == "idle_wait":
        idle_wait(comm)
    elif fault == "config_differs":
        config_differs(comm)
    elif fault == "late_in_the_abort":
        late_in_the_abort(comm)
    elif fault == "train_until_stopped":
        train_until_stopped(comm)
    else:
        raise SystemExit(f"unknown fault {fault!r}")
    say(f"rank {comm.rank}: finished")
