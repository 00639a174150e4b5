"""What a CPU host spends besides array work: zerosim's own Python calls and fresh pages.

A NumPy step on a CPU pays for two things that no array operation counts, and the dry run can
count both because it executes the very same engine code as the real run:

**Python calls** (``PythonCalls``). Between two array calls the engine, the strategy, the hooks
and the layers run their own Python: thousands of calls a step (1,500 to 4,000 for GPTs of 1M to
19M parameters at N = 1, more at stage 3: a fetch and a release per module). While the
representative runs its traced step, a profile hook (``sys.setprofile``) counts every call of a
function in zerosim's package, leaving out

- ``zerosim.meta``, the stand-in for NumPy, absent from a real run;
- ``zerosim.comm``: a real run's ``MPIComm`` does other work there, and the collectives'
  measured latency already holds it;
- ``zerosim.dryrun``, and every call these three make into the rest of zerosim;
- ``zerosim.backend``'s small helpers, which the layers reach on a shape-only array where a NumPy
  array takes their ``isinstance(x, np.ndarray)`` shortcut.

The count goes into the trace as ("python", calls) between the collective events, priced at
``call_overhead_s``, one call's cost measured by ``zerosim calibrate``.

**Fresh pages** (``MallocModel``). A fresh buffer's pages fault on first touch: the kernel
zeroes each one. NumPy takes its buffers from glibc's malloc, which serves a request of n bytes

- below the mmap threshold from its heap (``Heap``: addresses, best fit, a freed chunk merged
  with its free neighbours and into the top): pages below the heap's break were touched before,
  so only a heap that grows touches new ones; when the free top exceeds the trim threshold
  (twice the mmap threshold) the break moves down to 128 KiB above it (``M_TOP_PAD``), and the
  next growth touches those pages again. A step's activations grow the heap and are freed at
  its end, so every step touches them afresh (``strace`` of a real step shows the same brk); a
  trim gives the kernel back the huge pages of the 2 MiB regions wholly above the new break,
  as an unmapping does;
- at or above the threshold with a fresh ``mmap``, unmapped again when freed: every such
  buffer faults all its pages. The threshold starts at 128 KiB and rises to the size of any
  mapped chunk freed above it, up to 32 MiB (glibc's dynamic ``M_MMAP_THRESHOLD``,
  ``mallopt(3)``).

NumPy asks for transparent huge pages (``madvise(MADV_HUGEPAGE)``) on buffers of 4 MiB and
more (``np._core.multiarray._get_madvise_hugepage()``), from the first page boundary after the
chunk's 16-byte header: the first 2 MiB of such a mapping (which starts on a 2 MiB boundary) and
its tail take 4 KiB pages and the 2 MiB regions between them one fault each; on the heap, the
2 MiB regions inside the advised range touched for the first time (the heap's start taken as
2 MiB-aligned). Left out: glibc's bins (unsorted, small, large, the last remainder), the Python
objects that share the heap, and NumPy's cache of buffers under 1 KiB. ``calibrate`` measures a
4 KiB fault and a 2 MiB one.
"""

from __future__ import annotations

import bisect
import sys
from typing import Any

PAGE = 4096
HUGE_PAGE = 2 << 20
HUGEPAGE_MIN_BYTES = 4 << 20  # NumPy madvises buffers of this size and more
MMAP_THRESHOLD = 128 << 10  # glibc's default M_MMAP_THRESHOLD
MMAP_THRESHOLD_MAX = 32 << 20  # its dynamic ceiling on 64-bit systems
CHUNK_HEADER = 16  # glibc's chunk header before a mmapped buffer's data
MIN_CHUNK = 32  # glibc's smallest chunk
TOP_PAD = 128 << 10  # M_TOP_PAD: what the heap keeps above its top when it grows or trims
TRIM_CHECK_BYTES = 64 << 10  # FASTBIN_CONSOLIDATION_THRESHOLD: a free this large may trim

# the packages whose calls are not a real run's zerosim code (module docstring)
NOT_COUNTED = ("zerosim.meta", "zerosim.comm", "zerosim.dryrun", "zerosim.backend")


def counted_code(module: str) -> bool:
    """Whether a call of a function in ``module`` is one of zerosim's own calls."""
    return module.startswith("zerosim.") and not module.startswith(NOT_COUNTED)


class PythonCalls:
    """A profile hook counting zerosim's own Python calls (module docstring) while it is on;
    with ``events``, each count goes into the trace as ("python", calls) after the last event."""

    def __init__(self, events: list | None = None) -> None:
        self.calls = 0
        self.events = events
        self._counted: dict[tuple[Any, bool], bool] = {}  # (code, as a caller) → counted
        self._before: Any = None  # the profile function that was on before this one

    def _hook(self, frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        if not (self._is_counted(frame) and self._is_counted(frame.f_back, caller=True)):
            return
        self.calls += 1
        events = self.events
        if events is not None:
            if events and events[-1][0] == "python":
                events[-1] = ("python", events[-1][1] + 1)
            else:
                events.append(("python", 1))

    def _is_counted(self, frame: Any, caller: bool = False) -> bool:
        """Whether ``frame`` runs zerosim's own code; as a ``caller``, whether it is not one of
        the stand-ins (a call the shape-only arrays make into ``zerosim.backend`` is theirs)."""
        if frame is None:
            return caller
        code = frame.f_code
        found = self._counted.get((code, caller))
        if found is None:
            module = frame.f_globals.get("__name__", "")
            found = not module.startswith(NOT_COUNTED) if caller else counted_code(module)
            self._counted[(code, caller)] = found
        return found

    def __enter__(self) -> PythonCalls:
        self._before = sys.getprofile()  # a profiler already on (cProfile, …) is put back after
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(self._before)


def request_size(nbytes: int) -> int:
    """glibc's normalized request: the bytes and an 8-byte size field, rounded up to 16."""
    return max(32, (nbytes + 8 + 15) // 16 * 16)


def mapped_chunk(nbytes: int) -> int:
    """The size of the chunk glibc maps for ``nbytes``: header and data, whole pages."""
    return -(-(nbytes + CHUNK_HEADER) // PAGE) * PAGE


def mapped_pages(nbytes: int, hugepages: bool) -> tuple[int, int]:
    """(4 KiB faults, 2 MiB faults) of touching every byte of a fresh mmapped buffer of
    ``nbytes``: its header and data in 4 KiB pages, except, with NumPy's huge-page advice on a
    buffer of 4 MiB or more, the 2 MiB regions after the first (module docstring)."""
    pages = -(-(nbytes + CHUNK_HEADER) // PAGE)
    if not (hugepages and nbytes >= HUGEPAGE_MIN_BYTES):
        return pages, 0
    huge = nbytes // HUGE_PAGE - 1
    return pages - huge * (HUGE_PAGE // PAGE), huge


def advised_regions(data: int, nbytes: int, touched: int, resident: int) -> range:
    """The 2 MiB regions of the heap (its start taken as 2 MiB-aligned; region i spans bytes
    i · 2 MiB … (i + 1) · 2 MiB) inside NumPy's advised range of a buffer at ``data`` (from its
    first page boundary to its last) that lie wholly in the pages first touched now, from
    ``touched`` to ``resident``: one fault each. A region part-touched before keeps its 4 KiB
    pages."""
    start = max(-(-data // PAGE) * PAGE, touched)
    end = min((data + nbytes) // PAGE * PAGE, resident)
    return range(-(-start // HUGE_PAGE), max(-(-start // HUGE_PAGE), end // HUGE_PAGE))


class Heap:
    """glibc's main heap as addresses: a request is served by the smallest free chunk that
    holds it (split, the rest stays free), else carved from the top; a freed chunk merges with
    free neighbours, and into the top when it ends there. When the top exceeds the trim
    threshold, the break moves down to ``TOP_PAD`` above it (``systrim``) and the pages above
    are given back. ``touch`` counts the pages a chunk reaches beyond what is resident."""

    def __init__(self) -> None:
        self.top = 0  # where the top chunk starts: everything above is free
        self.resident = 0  # pages below this address have been touched and not given back
        self.free_chunks: list[tuple[int, int]] = []  # (size, address), sorted
        self.free_at: dict[int, int] = {}  # address → size of a free chunk
        self.free_ending: dict[int, int] = {}  # end address → address of a free chunk

    def allocate(self, size: int) -> tuple[int, int, int]:
        """(address, chunk size, 4 KiB pages touched for the first time) of a chunk of at least
        ``size`` bytes (a free chunk less than ``MIN_CHUNK`` larger is taken whole)."""
        i = bisect.bisect_left(self.free_chunks, (size, -1))
        if i < len(self.free_chunks):
            found, address = self.free_chunks[i]
            self._unlink(address)
            if found - size >= MIN_CHUNK:
                self._link(address + size, found - size)
            else:
                size = found
        else:
            address, self.top = self.top, self.top + size
        end = address + size
        if end <= self.resident:
            return address, size, 0
        pages = -(-(end - self.resident) // PAGE)
        self.resident += pages * PAGE
        return address, size, pages

    def free(self, address: int, size: int, trim_threshold: int) -> int:
        """Give the chunk back; return where the break was if this free trimmed the heap
        (``resident`` is then the new break), else 0."""
        if address + size in self.free_at:  # merge with the free chunk after it
            size += self._unlink(address + size)
        if address in self.free_ending:  # and the one before it
            before = self.free_ending[address]
            size += self._unlink(before)
            address = before
        if address + size == self.top:
            self.top = address
            if size >= TRIM_CHECK_BYTES and self.resident - self.top >= trim_threshold:
                trimmed_from = self.resident
                self.resident = min(self.resident, -(-(self.top + TOP_PAD) // PAGE) * PAGE)
                return trimmed_from
        else:
            self._link(address, size)
        return 0

    def _link(self, address: int, size: int) -> None:
        bisect.insort(self.free_chunks, (size, address))
        self.free_at[address] = size
        self.free_ending[address + size] = address

    def _unlink(self, address: int) -> int:
        size = self.free_at.pop(address)
        del self.free_ending[address + size]
        self.free_chunks.remove((size, address))
        return size


class MallocModel:
    """glibc malloc as NumPy's buffers meet it: which allocations touch fresh pages (module
    docstring). ``allocate`` returns the (4 KiB, 2 MiB) faults of touching a new buffer named
    ``key`` (the tracker's storage), ``free`` gives that buffer back."""

    def __init__(self, hugepages: bool = True) -> None:
        self.hugepages = hugepages
        self.threshold = MMAP_THRESHOLD
        self.heap = Heap()
        self.live: dict[int, tuple[int, int] | None] = {}  # key → heap (address, size) or None
        self.heap_huge: set[int] = set()  # the heap's 2 MiB regions faulted as huge pages
        self.faults = [0, 0]  # (4 KiB, 2 MiB) faults so far

    def allocate(self, nbytes: int, key: int) -> tuple[int, int]:
        request = request_size(nbytes)
        if request >= self.threshold:
            chunk = None  # mapped
            small, huge = mapped_pages(nbytes, self.hugepages)
        else:
            before = self.heap.resident
            address, size, small = self.heap.allocate(request)
            chunk, huge = (address, size), 0
            if self.hugepages and nbytes >= HUGEPAGE_MIN_BYTES and small:
                regions = advised_regions(
                    address + CHUNK_HEADER, nbytes, before, self.heap.resident
                )
                self.heap_huge.update(regions)
                huge = len(regions)
                small -= huge * (HUGE_PAGE // PAGE)
        self.live[key] = chunk
        self.faults[0] += small
        self.faults[1] += huge
        return small, huge

    def free(self, nbytes: int, key: int) -> int:
        """Give buffer ``key`` back; return the 2 MiB huge pages this gives back to the kernel:
        a mapping's (none if of 4 KiB pages), or, where freeing a heap chunk trims the heap,
        the huge pages of the regions wholly above the new break."""
        if key not in self.live:  # made before the model was watching: nothing to give back
            return 0
        chunk = self.live.pop(key)
        if chunk is not None:
            trimmed_from = self.heap.free(*chunk, 2 * self.threshold)
            if not trimmed_from:
                return 0
            above = range(-(-self.heap.resident // HUGE_PAGE), trimmed_from // HUGE_PAGE)
            given = self.heap_huge.intersection(above)
            self.heap_huge -= given
            return len(given)
        chunk = mapped_chunk(nbytes)  # unmapped
        if self.threshold < chunk <= MMAP_THRESHOLD_MAX:
            self.threshold = chunk  # glibc's dynamic threshold: the freed chunk's size
        return mapped_pages(nbytes, self.hugepages)[1]


def numpy_hugepages() -> bool:
    """Whether NumPy advises huge pages for its large buffers on this machine."""
    import numpy as np  # noqa: PLC0415

    core = getattr(np, "_core", None) or np.core
    return bool(core.multiarray._get_madvise_hugepage())


def real_step_counts(model: str, config: dict[str, Any]) -> tuple[int, int]:
    """(zerosim's own Python calls, minor page faults) of the third optimizer step of a real
    NumPy run of ``model`` (a ``--model`` spec) under ``config`` on this process's MPI world:
    the calls counted by ``PythonCalls``, the faults by the kernel (``ru_minflt``). What the
    dry run's counts are held to."""
    import resource  # noqa: PLC0415

    import numpy as np  # noqa: PLC0415

    from zerosim.comm import MPIComm  # noqa: PLC0415
    from zerosim.engine import initialize  # noqa: PLC0415
    from zerosim.report import workloads  # noqa: PLC0415

    net, _ = workloads.build(model)
    seq = workloads.gpt_shape(model).seq  # a GPT preset or gpt:LAYERS,HIDDEN,VOCAB,SEQ[,HEADS]
    x = np.zeros((config["train_micro_batch_size_per_gpu"], seq), np.int64)
    engine, *_ = initialize(net, config, comm=MPIComm())
    counter = PythonCalls()
    for step in range(3):
        if step == 2:
            counter.__enter__()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        engine.backward(engine(x, x))
        engine.step()
    counter.__exit__()
    return counter.calls, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
