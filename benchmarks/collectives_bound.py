"""How close a Python wrapper around mpi4py can come to the raw call: the bound behind the
collectives target's cause in docs/benchmarks.md.

    python benchmarks/collectives_bound.py [--ranks 2] [--mib 1 4] [--repeats 40]

Times a reduce-scatter at N ranks, back-to-back, interleaved, as ratios raw / variant:

* ``raw + bare check``: the raw call after a persistent all-gather of the check's 40-byte
  signature in MPI alone (``collectives.bare_check``): the ceiling of any checked call;
* ``zerosim``: ``MPIComm.reduce_scatter``, check on and off;
* ``one frame``: the same argument checks, ledger record, flight entry and watchdog note for
  NumPy buffers written as a single function (``OneFrame`` below, a measuring device, not a code
  path of zerosim), check on and off: what restructuring zerosim's layers could win at most.

Not a target of its own; docs/benchmarks.md quotes its numbers where the collectives target
is missed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.collectives import bare_check, worker_rows  # noqa: E402

MIB = 2**20


def one_frame_class():
    """An MPIComm whose reduce_scatter of NumPy buffers is one function: the general path's
    checks (anything else goes to it), record, flight entry, cross-rank check and watchdog note."""
    from mpi4py import MPI  # noqa: F401  (MPI is initialised before the communicator)

    from zerosim.comm import MPIComm, watchdog
    from zerosim.comm.agreement import disagreement, dtype_code
    from zerosim.comm.call import cached_dtype_name
    from zerosim.comm.checks import OPS, SUPPORTED
    from zerosim.comm.mpi import buffer_spec, mpi_op
    from zerosim.comm.record import Record

    current = watchdog._CURRENT
    clock = time.perf_counter

    class OneFrame(MPIComm):
        def reduce_scatter(self, out, inp, op="sum"):
            if not (
                type(inp) is np.ndarray
                and type(out) is np.ndarray
                and op in OPS
                and inp.dtype is out.dtype
                and inp.dtype in SUPPORTED
                and inp.flags.c_contiguous
                and out.flags.c_contiguous
                and out.flags.writeable
                and inp.size == self.size * out.size
                and not np.may_share_memory(inp, out)
            ):
                return MPIComm.reduce_scatter(self, out, inp, op)
            ledger, dtype, count, size = self.ledger, inp.dtype, inp.size, self.size
            signature = (2, dtype_code(dtype), count, 0, 0)
            if self.validate:
                token = self._check.start(signature)
            moved = (size - 1) * (count // size) * dtype.itemsize
            record = Record(
                "reduce_scatter", ledger.current_phase, self.group, cached_dtype_name(dtype), count,
                count * dtype.itemsize, moved, moved, size, ledger.step, "model", True,
                clock() - ledger._t0,
            )  # fmt: skip
            seq = ledger.flight.begin(record)
            if self.validate:
                self.waiting = (seq, record, "cross-rank argument check")
                watchdog.poll(self, token)
                if not self._check.all_equal():
                    every = self.gather_ints(signature)
                    raise disagreement(
                        self.group, self.rank, "reduce_scatter", dtype, signature, every
                    )
            self.waiting = pending = (seq, record, "data exchange")
            start = clock()
            record.start = start - ledger._t0
            current[0] = (self, pending, time.monotonic())
            row = watchdog.ROW  # this rank's row of the progress table (set by the first MPIComm)
            row[watchdog.WAITING] = seq
            try:
                self.mpi.Reduce_scatter_block(buffer_spec(inp), buffer_spec(out), mpi_op(dtype, op))
            finally:
                row[watchdog.WAITING] = watchdog.NOT_WAITING
            self.waiting = None
            record.intra_bytes = moved
            record.wall_time = clock() - start
            ledger.append(record)

    return OneFrame


def _same_as_zerosim(mpi, zerosim, one_frame) -> bool:
    """Whether the one-frame path reduces as zerosim does and writes the same record (but for
    its times), on every rank."""
    from mpi4py import MPI

    rank, n = mpi.Get_rank(), mpi.Get_size()
    inp = np.arange(6 * n, dtype=np.float32) * (rank + 1)
    outs = [np.empty(6, dtype=np.float32) for _ in range(2)]
    zerosim.reduce_scatter(outs[0], inp)
    one_frame.reduce_scatter(outs[1], inp)
    timeless = [
        {k: v for k, v in vars_of(c.ledger.records[-1]).items() if k not in ("start", "wall_time")}
        for c in (zerosim, one_frame)
    ]
    mine = np.array([np.array_equal(*outs) and timeless[0] == timeless[1]], dtype=np.int64)
    mpi.Allreduce(MPI.IN_PLACE, mine, op=MPI.MIN)
    return bool(mine[0])


def vars_of(record) -> dict:
    return {k: getattr(record, k) for k in record.__slots__}


def worker(mibs: list[float], repeats: int) -> None:
    from mpi4py import MPI

    from zerosim.comm import MPIComm
    from zerosim.comm.agreement import SIGNATURE_FIELDS

    mpi = MPI.COMM_WORLD
    n = mpi.Get_size()
    one_frame = one_frame_class()
    comms = {
        "zerosim": MPIComm(),
        "zerosim, check off": MPIComm(validate=False),
        "one frame": one_frame(),
        "one frame, check off": one_frame(validate=False),
    }
    check = bare_check(mpi, len(SIGNATURE_FIELDS))
    same = _same_as_zerosim(mpi, comms["zerosim"], comms["one frame"])
    for mib in mibs:
        count = int(mib * MIB) // 4 // n * n
        full = np.ones(count, dtype=np.float32)
        part = np.ones(count // n, dtype=np.float32)

        def raw(full=full, part=part):
            mpi.Reduce_scatter_block(full, part, op=MPI.SUM)

        calls = {"raw": raw, "raw + bare check": lambda raw=raw: (check(), raw())}
        for name, c in comms.items():
            calls[name] = lambda c=c, full=full, part=part: c.reduce_scatter(part, full)
        iters = max(5, int(0.01 / (mib * 100e-6)))
        samples: dict[str, list[float]] = {k: [] for k in calls}
        for fn in calls.values():
            fn()
        for rep in range(repeats):
            for name in list(calls) if rep % 2 == 0 else list(calls)[::-1]:
                mpi.Barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    calls[name]()
                took = np.array([(time.perf_counter() - t0) / iters])
                mpi.Allreduce(MPI.IN_PLACE, took, op=MPI.MAX)
                samples[name].append(float(took[0]))
            for c in comms.values():
                c.ledger.reset()
        if mpi.Get_rank() == 0:
            raw_t = np.array(samples["raw"])
            row = {"n": n, "mib": mib, "raw_us": float(np.median(raw_t) * 1e6), "same": same}
            for name, times in samples.items():
                row[name] = float(np.median(raw_t / np.array(times)))
            print(json.dumps(row), flush=True)
    if hasattr(check, "request"):
        check.request.Free()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mib", type=float, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.mib, args.repeats)
        return 0
    rows = worker_rows(
        __file__, args.ranks, ["--repeats", str(args.repeats), "--mib", *map(str, args.mib)]
    )
    names = [k for k in rows[0] if k not in ("n", "mib", "raw_us", "same")]
    print("| N | S (MiB) | raw µs | " + " | ".join(names) + " |")
    print("|" + "---|" * (3 + len(names)))
    for r in rows:
        cells = [r["n"], f"{r['mib']:g}", f"{r['raw_us']:.0f}", *(f"{r[k]:.3f}" for k in names)]
        print("| " + " | ".join(map(str, cells)) + " |")
    print("\nratio = raw time / variant time (median of interleaved paired samples)")
    agree = all(r["same"] for r in rows)
    print(f"one frame reduces and records as zerosim does: {'yes' if agree else 'NO'}")
    return 0 if agree else 1


if __name__ == "__main__":
    raise SystemExit(main())
