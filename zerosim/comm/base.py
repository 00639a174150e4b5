"""The Communicator interface that every layer above ``comm/`` talks to.

A communicator is one rank's view of a group: ``rank``, ``size``, the collectives ZeRO needs, and a
ledger. This base class does the work common to every world, in one place:

1. check the arguments on this rank (types, dtypes, contiguity, sizes, op, root) before anything is
   sent, and, with ``validate=True``, check with one tiny exchange that every rank called the same
   collective with the same dtype and size (a mismatch would otherwise hang or corrupt memory);
2. pick the native collective of the world (``MPIComm``, ``LocalWorld``) or our own ring algorithm
   over point-to-point messages (``collectives="ring"``);
3. write a ledger record with the bytes this rank moved, split into bytes sent within this
   rank's node and bytes sent to other nodes (``set_ranks_per_node``; see ``comm/ledger.py``);
4. number the call in the ledger's flight recorder as it starts and name it (``_pending``) while
   this rank waits, so that a world's watchdog can say what it was waiting for when it gives up
   after ``timeout`` seconds (``set_watchdog``; ``comm/flight.py``).

Subclasses provide the native collectives (``_native_*``), a point-to-point ``_sendrecv`` for the
ring algorithms, ``_agree`` for the cross-rank check and ``split``.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from zerosim.backend import DTYPES, dtype_name, is_device_array, np_dtype, resolve_dtype
from zerosim.comm import ring
from zerosim.comm.flight import check_timeout, default_timeout, env_flight_dir, env_timeout
from zerosim.comm.ledger import Ledger
from zerosim.comm.record import Record

OPS = ("sum", "max", "min")
COLLECTIVES = ("native", "ring")
SUPPORTED_DTYPES = ("float64", "float32", "float16", "bfloat16", "int8", "uint8", "int32", "int64")
_SUPPORTED = {np.dtype(resolve_dtype(n)) if n in DTYPES else np.dtype(n) for n in SUPPORTED_DTYPES}
OP_CODES = {
    "all_gather": 1,
    "reduce_scatter": 2,
    "all_reduce": 3,
    "broadcast": 4,
    "all_to_all": 5,
    "barrier": 6,
    "reduce": 7,
}
# what the cross-rank check compares, one int64 each ("pieces": a hash of uneven counts, or 0)
SIGNATURE_FIELDS = ("op", "dtype", "count", "root", "pieces")


class Handle:
    """A non-blocking collective in flight; ``wait()`` completes it and times it in the ledger."""

    def __init__(
        self, finish: Callable[[], None], record: Record, comm: Communicator, seq: int
    ) -> None:
        self._finish = finish
        self._record = record
        self._comm = comm
        self._seq = seq  # the call's number in the flight recorder
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self._comm._pending = (self._seq, self._record, "wait()")
        self._finish()
        self._comm._pending = None
        self.done = True
        self._record.wall_time = self._comm.ledger.now() - self._record.start


def _address(x: Any) -> int | None:
    """Where ``x``'s first element lives: NumPy's and CuPy's pointers; None for an Array API
    standard array, which exposes none (its collectives then never run in place)."""
    if isinstance(x, np.ndarray):
        return x.__array_interface__["data"][0]
    data = getattr(x, "data", None)
    return data.ptr if hasattr(data, "ptr") else None


def _check_buffer(name: str, x: Any, writable: bool = False) -> None:
    if type(x) is np.ndarray:  # the common case, accepted in a few attribute reads
        flags = x.flags
        if x.dtype in _SUPPORTED and flags.c_contiguous and (flags.writeable or not writable):
            return
    _explain_buffer(name, x, writable)


def _explain_buffer(name: str, x: Any, writable: bool) -> None:
    """Raise the error that says what is wrong with ``x`` (device arrays that pass return)."""
    if not (isinstance(x, np.ndarray) or is_device_array(x)):
        raise TypeError(
            f"{name} must be an array (numpy, cupy or the Array API backend's), got "
            f"{type(x).__name__}"
        )
    if np_dtype(x.dtype) not in _SUPPORTED:
        raise TypeError(
            f"{name} has dtype {dtype_name(x.dtype)}; allowed: {list(SUPPORTED_DTYPES)}"
        )
    if not hasattr(x, "flags"):  # an Array API standard array: no memory layout to check
        return
    if not x.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous, got an array with strides {x.strides}")
    if writable and isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError(f"{name} must be writable, got a read-only array")


def check_collectives(value: str) -> str:
    if value not in COLLECTIVES:
        raise ValueError(f"collectives must be one of {list(COLLECTIVES)}, got {value!r}")
    return value


def _check_op(op: str, x: Any) -> None:
    if op not in OPS:
        raise ValueError(f"op must be one of {list(OPS)}, got {op!r}")


@functools.cache
def _dtype_code(dtype: Any) -> int:
    """A small non-negative int naming a dtype, for the cross-rank argument check."""
    code = np.frombuffer(dtype_name(dtype).encode()[:8].ljust(8), dtype=np.int64)[0]
    return int(code) & 0x7FFFFFFFFFFFFFFF


class Communicator(ABC):
    """One rank's handle on a group of ranks: collectives, sub-groups and a ledger."""

    def __init__(
        self,
        rank: int,
        size: int,
        ledger: Ledger | None,
        collectives: str,
        group: str,
        validate: bool,
    ) -> None:
        self.rank = rank
        self.size = size
        self.ledger = ledger if ledger is not None else Ledger()
        self.group = group
        self.validate = validate
        self.collectives = collectives
        self._node_of: tuple[int, ...] | None = None
        self._route_now = "host"  # how the current call's data travels (Record.transport)
        self._node_version = 0  # the ledger's node_version this group's map was learnt at
        self.timeout = default_timeout()  # seconds a wait may last (0: forever); the watchdog's
        # (call number, record, stage) of the call this rank may be waiting in, for the watchdog
        self._pending: tuple[int, Record | None, str] | None = None
        self._splits = 0  # sub-groups split off so far (every rank splits in the same order)
        self._child_names: set[str] = set()  # their names, so that no two share one

    # -- configuration --------------------------------------------------------------------------
    @property
    def collectives(self) -> str:
        """'native' (the world's own collectives) or 'ring' (our ring over point-to-point)."""
        return self._collectives

    @collectives.setter
    def collectives(self, value: str) -> None:
        self._collectives = check_collectives(value)

    @property
    def timeout(self) -> float:
        """Seconds any one wait of a collective may last before the watchdog ends the job
        (``MPIComm``) or raises (``LocalWorld``); 0 means never. Sub-groups inherit it."""
        return self._timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._timeout = check_timeout(value)

    def set_watchdog(
        self,
        timeout: float | None = None,
        flight_records: int | None = None,
        flight_dir: str | None = None,
    ) -> None:
        """Apply the config's ``zerosim.timeout``, ``flight_records`` and ``flight_dir``.

        The environment variables ``ZEROSIM_TIMEOUT`` and ``ZEROSIM_FLIGHT_DIR`` win over the
        values given, so that a job can be given a shorter limit without editing its config.
        Sub-groups split off later inherit the timeout; the flight recorder is the ledger's.
        """
        env = env_timeout()
        timeout = env if env is not None else timeout
        if timeout is not None:
            self.timeout = timeout
        if flight_records is not None:
            self.ledger.flight.resize(flight_records)
        folder = env_flight_dir() or flight_dir
        if folder is not None:
            self.ledger.flight.directory = str(folder)

    def phase(self, name: str) -> AbstractContextManager[None]:
        """Context manager labelling the ledger records made inside it (forward, step…)."""
        return self.ledger.phase(name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size}, group={self.group!r})"

    # -- nodes ----------------------------------------------------------------------------------
    @property
    def node_of(self) -> tuple[int, ...] | None:
        """The node of each rank of this group, in rank order; None when unknown (one node).

        A sub-group learns it at its first collective after the parent's map was set.
        """
        return self._node_of

    def set_ranks_per_node(self, ranks_per_node: int | None) -> None:
        """Place rank r of this group on node r // ranks_per_node, for the ledger's split.

        With None, an MPI world asks MPI which ranks share memory (``MPI_COMM_TYPE_SHARED``):
        one node per shared-memory domain, named by its lowest rank (a collective); any other
        world is left as one node. Call it on every rank of the group, which should be the
        world whose ledger the sub-groups share (``split`` groups inherit the map).
        """
        if ranks_per_node is None:
            node = self._shared_memory_node()
            nodes = None if node is None else tuple(s[0] for s in self._agree((node,)))
        elif (
            isinstance(ranks_per_node, bool)
            or not isinstance(ranks_per_node, (int, np.integer))
            or ranks_per_node < 1
        ):
            raise ValueError(f"ranks_per_node must be None or an int ≥ 1, got {ranks_per_node!r}")
        else:
            nodes = tuple(r // int(ranks_per_node) for r in range(self.size))
            node = nodes[self.rank]
        self.ledger.set_node(node)
        self._node_of, self._node_version = nodes, self.ledger.node_version

    def _shared_memory_node(self) -> int | None:
        """MPI worlds: the lowest rank of this rank's shared-memory node; other worlds: None."""
        return None

    def _sync_nodes(self) -> None:
        """Learn the members' nodes (one small exchange) if the ledger's node changed since."""
        if self._node_version == self.ledger.node_version:
            return
        node = self.ledger.node
        self._node_of = None if node is None else tuple(s[0] for s in self._agree((node,)))
        self._node_version = self.ledger.node_version

    def _split_sent(self, op: str, sent: int, count: int, itemsize: int) -> tuple[int, int]:
        """(intra, inter) bytes of ``sent``: ring ops and broadcast send all to rank + 1, reduce
        to rank − 1, all-to-all block j to rank j."""
        nodes = self._node_of
        if nodes is None or sent == 0:
            return sent, 0
        mine = nodes[self.rank]
        if op == "all_to_all":
            block = count // self.size * itemsize
            local = sum(1 for q, n in enumerate(nodes) if q != self.rank and n == mine)
            return local * block, sent - local * block
        step = -1 if op == "reduce" else 1  # a reduce's chain runs towards the root
        return (sent, 0) if nodes[(self.rank + step) % self.size] == mine else (0, sent)

    # -- collectives ------------------------------------------------------------------------------
    def all_gather(self, out: Any, inp: Any) -> None:
        """out ← concatenation of every rank's ``inp`` in rank order (out.size = size · inp.size).

        ``inp`` may be this rank's own slice of ``out`` (in place, as ZeRO gathers a flat buffer).
        """
        in_place = self._check_gather_scatter("all_gather", out, inp)
        self._run(
            "all_gather",
            out.dtype,
            out.size,
            lambda: self._native_all_gather(out, inp, in_place),
            lambda: ring.all_gather(self, out, inp),
        )

    def reduce_scatter(self, out: Any, inp: Any, op: str = "sum") -> None:
        """out ← chunk ``rank`` of the element-wise reduction of every rank's ``inp``."""
        in_place = self._check_gather_scatter("reduce_scatter", inp, out, op=op)
        self._run(
            "reduce_scatter",
            inp.dtype,
            inp.size,
            lambda: self._native_reduce_scatter(out, inp, op, in_place),
            lambda: ring.reduce_scatter(self, out, inp, op, None),
        )

    def reduce_scatter_v(self, out: Any, inp: Any, counts: Sequence[int], op: str = "sum") -> None:
        """Reduce-scatter with uneven pieces: rank q gets ``counts[q]`` elements of the reduction.

        Rank q's piece starts at ``sum(counts[:q])``. ZeRO stage 2 uses it to reduce a gradient
        bucket whose elements are owned unevenly by the ranks (MPI_Reduce_scatter).
        """
        counts = self._check_counts(out, inp, counts, op)
        self._run(
            "reduce_scatter",
            inp.dtype,
            inp.size,
            lambda: self._native_ireduce_scatter_v(out, inp, counts, op)(),
            lambda: ring.reduce_scatter(self, out, inp, op, counts),
            counts=counts,
        )

    def all_reduce(self, buf: Any, op: str = "sum") -> None:
        """buf ← element-wise reduction of every rank's ``buf`` (in place)."""
        _check_buffer("buf", buf, writable=True)
        _check_op(op, buf)
        self._run(
            "all_reduce",
            buf.dtype,
            buf.size,
            lambda: self._native_all_reduce(buf, op),
            lambda: ring.all_reduce(self, buf, op),
        )

    def broadcast(self, buf: Any, root: int = 0) -> None:
        """buf ← root's ``buf`` on every rank."""
        _check_buffer("buf", buf, writable=True)
        self._check_root(root)
        self._run(
            "broadcast",
            buf.dtype,
            buf.size,
            lambda: self._native_broadcast(buf, root),
            lambda: ring.broadcast(self, buf, root),
            root=root,
        )

    def reduce(self, buf: Any, root: int = 0, op: str = "sum") -> None:
        """buf on ``root`` ← element-wise reduction of every rank's ``buf`` (in place there); the
        other ranks' ``buf`` is left as it was. DeepSpeed's ``reduce_scatter`` path at stages
        1-2 reduces each piece of a gradient bucket to the rank that owns it this way."""
        self._check_reduce(buf, root, op)
        self._run(
            "reduce",
            buf.dtype,
            buf.size,
            lambda: self._native_reduce(buf, root, op),
            lambda: ring.reduce(self, buf, root, op),
            root=root,
        )

    def all_to_all(self, out: Any, inp: Any) -> None:
        """Block j of ``inp`` goes to rank j; block i of ``out`` comes from rank i."""
        _check_buffer("inp", inp)
        _check_buffer("out", out, writable=True)
        self._check_same_dtype(out, inp)
        if out.size != inp.size or inp.size % self.size:
            raise ValueError(
                f"all_to_all needs out.size == inp.size and a multiple of size={self.size}"
                f"; got out.size={out.size}, inp.size={inp.size}"
            )
        self._check_disjoint("all_to_all", out, inp)
        self._run(
            "all_to_all",
            inp.dtype,
            inp.size,
            lambda: self._native_all_to_all(out, inp),
            lambda: ring.all_to_all(self, out, inp),
        )

    def barrier(self) -> None:
        """Wait until every rank of the group has reached the barrier."""
        self._run("barrier", np.dtype(np.uint8), 0, self._native_barrier, None)

    # -- non-blocking collectives ------------------------------------------------------------
    def iall_gather(self, out: Any, inp: Any) -> Handle:
        """Start an all-gather; the result is in ``out`` after ``.wait()``."""
        in_place = self._check_gather_scatter("all_gather", out, inp)
        return self._start(
            "all_gather",
            out.dtype,
            out.size,
            lambda: self._native_iall_gather(out, inp, in_place),
            lambda: ring.all_gather(self, out, inp),
        )

    def ireduce_scatter(self, out: Any, inp: Any, op: str = "sum") -> Handle:
        """Start a reduce-scatter; the result is in ``out`` after ``.wait()``."""
        in_place = self._check_gather_scatter("reduce_scatter", inp, out, op=op)
        return self._start(
            "reduce_scatter",
            inp.dtype,
            inp.size,
            lambda: self._native_ireduce_scatter(out, inp, op, in_place),
            lambda: ring.reduce_scatter(self, out, inp, op, None),
        )

    def ireduce_scatter_v(
        self, out: Any, inp: Any, counts: Sequence[int], op: str = "sum"
    ) -> Handle:
        """Start a reduce-scatter with uneven pieces; ``out`` is ready after ``.wait()``."""
        counts = self._check_counts(out, inp, counts, op)
        return self._start(
            "reduce_scatter",
            inp.dtype,
            inp.size,
            lambda: self._native_ireduce_scatter_v(out, inp, counts, op),
            lambda: ring.reduce_scatter(self, out, inp, op, counts),
            counts=counts,
        )

    def iall_reduce(self, buf: Any, op: str = "sum") -> Handle:
        """Start an all-reduce; the result is in ``buf`` after ``.wait()``."""
        _check_buffer("buf", buf, writable=True)
        _check_op(op, buf)
        return self._start(
            "all_reduce",
            buf.dtype,
            buf.size,
            lambda: self._native_iall_reduce(buf, op),
            lambda: ring.all_reduce(self, buf, op),
        )

    def ireduce(self, buf: Any, root: int = 0, op: str = "sum") -> Handle:
        """Start a reduce to ``root``; root's ``buf`` holds the result after ``.wait()``."""
        self._check_reduce(buf, root, op)
        return self._start(
            "reduce",
            buf.dtype,
            buf.size,
            lambda: self._native_ireduce(buf, root, op),
            lambda: ring.reduce(self, buf, root, op),
            root=root,
        )

    # -- sub-groups ----------------------------------------------------------------------------
    @abstractmethod
    def split(self, color: int, key: int = 0, name: str | None = None) -> Communicator:
        """A communicator over the ranks that passed the same ``color``, ordered by (key, rank).

        Its ledger name is ``<this group>/<name>.<color>``; ``name`` defaults to ``split<k>`` for
        the k-th split of this communicator, so two sub-groups of one rank never share a name
        (hpZ's group and qgZ's two hops on rank 0 are ``world/split1.0``, ``world/split2.0``, …).
        """

    def split_by(
        self, rule: Callable[[int], tuple[int, int]], name: str | None = None
    ) -> Communicator:
        """``split(color, key, name)`` with ``(color, key) = rule(self.rank)``, where ``rule(r)``
        is what every rank r of this group passes: the same split, stated for all ranks at
        once, so that a world whose ranks cannot ask each other (the dry run's virtual world,
        ``comm/virtual.py``) knows the members of every sub-group."""
        color, key = rule(self.rank)
        return self.split(color, key, name)

    def _check_split(self, color: int, key: int, name: str | None) -> str:
        """Check ``split``'s arguments; return the new group's unique name."""
        if isinstance(color, bool) or not isinstance(color, (int, np.integer)) or color < 0:
            raise ValueError(f"color must be a non-negative int, got {color!r}")
        if isinstance(key, bool) or not isinstance(key, (int, np.integer)):
            raise ValueError(f"key must be an int, got {key!r}")
        if name is not None and (not isinstance(name, str) or not name or "/" in name):
            raise ValueError(f"name must be None or a non-empty string without '/', got {name!r}")
        self._splits += 1
        child = f"{self.group}/{name or f'split{self._splits}'}.{int(color)}"
        if child in self._child_names:  # a name given twice: number the second
            child = f"{child}#{self._splits}"
        self._child_names.add(child)
        return child

    # -- what a world provides ----------------------------------------------------------------
    # Native collectives (blocking, and non-blocking ones returning a function that completes
    # them), point-to-point messages for the ring algorithms, and the cross-rank argument check.
    # ``in_place``: ``inp`` is this rank's own chunk of ``out`` (all-gather), ``out`` of ``inp``
    # (reduce-scatter).
    @abstractmethod
    def _native_all_gather(self, out: Any, inp: Any, in_place: bool) -> None: ...
    @abstractmethod
    def _native_reduce_scatter(self, out: Any, inp: Any, op: str, in_place: bool) -> None: ...
    @abstractmethod
    def _native_all_reduce(self, buf: Any, op: str) -> None: ...
    @abstractmethod
    def _native_broadcast(self, buf: Any, root: int) -> None: ...
    @abstractmethod
    def _native_reduce(self, buf: Any, root: int, op: str) -> None: ...
    @abstractmethod
    def _native_all_to_all(self, out: Any, inp: Any) -> None: ...
    @abstractmethod
    def _native_barrier(self) -> None: ...
    @abstractmethod
    def _native_iall_gather(self, out: Any, inp: Any, in_place: bool) -> Callable[[], None]: ...
    @abstractmethod
    def _native_ireduce_scatter(
        self, out: Any, inp: Any, op: str, in_place: bool
    ) -> Callable[[], None]: ...
    @abstractmethod
    def _native_iall_reduce(self, buf: Any, op: str) -> Callable[[], None]: ...
    @abstractmethod
    def _native_ireduce(self, buf: Any, root: int, op: str) -> Callable[[], None]: ...
    @abstractmethod
    def _native_ireduce_scatter_v(
        self, out: Any, inp: Any, counts: tuple[int, ...], op: str
    ) -> Callable[[], None]: ...
    @abstractmethod
    def _send(self, buf: Any, dest: int) -> None: ...
    @abstractmethod
    def _recv(self, buf: Any, source: int) -> None: ...
    @abstractmethod
    def _sendrecv(self, sendbuf: Any, dest: int, recvbuf: Any, source: int) -> None:
        """Send ``sendbuf`` to ``dest`` while receiving ``recvbuf`` from ``source``."""

    @abstractmethod
    def _agree(self, signature: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Every rank's signature, in rank order (a tiny all-gather)."""

    # -- shared machinery ----------------------------------------------------------------------
    def _check_root(self, root: int) -> None:
        if (
            isinstance(root, bool)
            or not isinstance(root, (int, np.integer))
            or not (0 <= root < self.size)
        ):
            raise ValueError(f"root must be an int in [0, {self.size}), got {root!r}")

    def _check_reduce(self, buf: Any, root: int, op: str) -> None:
        self._check_root(root)
        _check_buffer("buf", buf, writable=self.rank == root)
        _check_op(op, buf)

    @staticmethod
    def _check_same_dtype(out: Any, inp: Any) -> None:
        if type(out) is not type(inp) and (is_device_array(out) or is_device_array(inp)):
            raise TypeError(
                f"out and inp must be arrays of one kind on one device, got out "
                f"{type(out).__module__}.{type(out).__name__} and inp "
                f"{type(inp).__module__}.{type(inp).__name__} (move one with "
                "zerosim.backend.from_host / to_host)"
            )
        if out.dtype != inp.dtype:
            raise TypeError(
                f"out and inp must have the same dtype, got out {dtype_name(out.dtype)}"
                f" and inp {dtype_name(inp.dtype)}"
            )

    @staticmethod
    def _check_disjoint(name: str, out: Any, inp: Any) -> None:
        if isinstance(out, np.ndarray) and np.may_share_memory(out, inp):
            raise ValueError(f"{name}: out and inp must not overlap")

    def _check_gather_scatter(self, name: str, full: Any, part: Any, op: str | None = None) -> bool:
        """Checks shared by all_gather (full=out, part=inp) and reduce_scatter (the reverse);
        True when ``part`` is this rank's own chunk of ``full`` (the call runs in place)."""
        full_name, part_name = ("out", "inp") if name == "all_gather" else ("inp", "out")
        _check_buffer(part_name, part, writable=name == "reduce_scatter")
        _check_buffer(full_name, full, writable=name == "all_gather")
        if op is not None:
            _check_op(op, full)
        self._check_same_dtype(full, part)
        if full.size != self.size * part.size:
            raise ValueError(
                f"{name} needs {full_name}.size == size * {part_name}.size = "
                f"{self.size} * {part.size} = {self.size * part.size}, "
                f"got {full_name}.size={full.size}"
            )
        if type(full) is np.ndarray and not np.may_share_memory(full, part):
            return False  # the common case: two buffers, told apart by a bounds check in C
        if self._is_own_slice(full, part):
            return True  # in place: the part is this rank's own chunk of the full buffer
        self._check_disjoint(name, full, part)
        return False

    def _check_counts(self, out: Any, inp: Any, counts: Sequence[int], op: str) -> tuple[int, ...]:
        _check_buffer("inp", inp)
        _check_buffer("out", out, writable=True)
        _check_op(op, inp)
        self._check_same_dtype(out, inp)
        if len(counts) != self.size or any(
            isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 0 for c in counts
        ):
            raise ValueError(
                f"counts must hold {self.size} non-negative ints (one per rank), got {counts!r}"
            )
        counts = tuple(int(c) for c in counts)
        if sum(counts) != inp.size or out.size != counts[self.rank]:
            raise ValueError(
                f"reduce_scatter_v needs sum(counts) == inp.size and out.size == "
                f"counts[{self.rank}]; got sum(counts)={sum(counts)}, inp.size={inp.size}, "
                f"out.size={out.size}, counts[{self.rank}]={counts[self.rank]}"
            )
        self._check_disjoint("reduce_scatter_v", out, inp)
        return counts

    def _is_own_slice(self, out: Any, inp: Any) -> bool:
        if inp.size == 0 or type(out) is not type(inp):
            return False
        if isinstance(out, np.ndarray) and not np.may_share_memory(out, inp):
            return False  # the common case, decided by a bounds check in C
        at, base = _address(inp), _address(out)
        if at is None or base is None:
            return False
        return at == base + self.rank * inp.size * np_dtype(inp.dtype).itemsize

    # The cross-rank check in two halves, so that its message travels while this rank writes the
    # ledger record: ``_post_agree`` sends this rank's signature and returns a token,
    # ``_agreed`` waits for every rank's and says whether they are all equal (the same answer on
    # every rank). Worlds override them with something cheaper than ``_agree``'s all-gather.
    def _post_agree(self, signature: tuple[int, ...]) -> Any:
        return signature

    def _agreed(self, token: Any) -> bool:
        every = self._agree(token)
        return all(s == every[0] for s in every)

    def _disagreement(self, op: str, dtype: Any, mine: tuple[int, ...]) -> ValueError:
        """The error every rank raises when the signatures differ (all of them are here, since
        every rank learnt the same answer: one more exchange gathers the details)."""
        every = self._agree(mine)
        names = {v: k for k, v in OP_CODES.items()}
        described = ", ".join(
            f"rank {r}: {names.get(s[0], '?')}(count={s[2]}, root={s[3]})"
            + ("" if s[4] == mine[4] else " with other counts")
            + ("" if s[1] == mine[1] else " with another dtype")
            for r, s in enumerate(every)
        )
        return ValueError(
            f"ranks of group {self.group!r} called different collectives or "
            f"passed different sizes/dtypes/roots: {described}; every rank must "
            f"make the same call ({op} here on rank {self.rank}, "
            f"dtype {dtype_name(dtype)})"
        )

    def _run(
        self,
        op: str,
        dtype: Any,
        count: int,
        native: Callable[[], None],
        ring_fn: Callable[[], tuple[int, int]] | None,
        root: int = 0,
        counts: tuple[int, ...] | None = None,
    ) -> None:
        """A blocking collective: ``native()`` (or our ring) between the check and the record."""
        self._call(op, dtype, count, native, ring_fn, root, counts, True)

    def _start(
        self,
        op: str,
        dtype: Any,
        count: int,
        native_start: Callable[[], Callable[[], None]],
        ring_fn: Callable[[], tuple[int, int]],
        root: int = 0,
        counts: tuple[int, ...] | None = None,
    ) -> Handle:
        """A non-blocking collective: ``native_start()`` returns what completes it in ``wait()``;
        our ring is synchronous, so its handle is already complete."""
        record, seq, finish = self._call(
            op, dtype, count, native_start, ring_fn, root, counts, False
        )
        return Handle(finish or _nothing, record, self, seq)

    def _call(
        self,
        op: str,
        dtype: Any,
        count: int,
        native: Callable[[], Any],
        ring_fn: Callable[[], tuple[int, int]] | None,
        root: int,
        counts: tuple[int, ...] | None,
        blocking: bool,
    ) -> tuple[Record, int, Any]:
        """One collective call, in order: post the cross-rank check; write the record (the
        ring-model bytes, or zeros for our ring to fill in) and number it in the flight
        recorder while the check's message travels; wait for the check; move the data; split
        the bytes by node and time the call. Returns (record, call number, what ``native``
        returned)."""
        ledger = self.ledger
        dtype = np_dtype(dtype)
        if self._node_version != ledger.node_version:
            self._sync_nodes()
        checking = self.validate and self.size > 1
        if checking:
            pieces = 0 if counts is None else hash(counts) & 0x7FFFFFFFFFFFFFFF
            signature = (OP_CODES[op], _dtype_code(dtype), count, int(root), pieces)
            token = self._post_agree(signature)
        use_ring = ring_fn is not None and self._collectives == "ring" and self.size > 1
        if use_ring:
            sent = recv = 0
        else:
            sent, recv = ring.model_bytes(
                op, count, self.size, self.rank, dtype.itemsize, root, counts
            )
        record = Record(  # positional (half the cost of keywords, on every call), in order:
            op,  # op
            ledger.current_phase,  # phase
            self.group,  # group
            _dtype_name(dtype),  # dtype
            count,  # elements
            count * dtype.itemsize,  # size_bytes
            sent,  # bytes_sent
            recv,  # bytes_recv
            self.size,  # peers
            ledger.step,  # step
            "wire" if use_ring else "model",  # counted
            blocking,  # blocking
            ledger.now(),  # start (set again when the data starts to move)
        )
        seq = ledger.flight.begin(record)
        if checking:
            self._pending = (seq, record, "cross-rank argument check")
            if not self._agreed(token):
                self._pending = None
                raise self._disagreement(op, dtype, signature)
        self._pending = (seq, record, "data exchange")
        record.start = ledger.now()  # the wall time is the transfer's, without the check
        returned = None
        self._route_now = "host"
        if use_ring:
            record.bytes_sent, record.bytes_recv = ring_fn()
        else:
            returned = native()
        self._pending = None
        record.transport = self._route_now
        if self._node_of is None:
            record.intra_bytes = record.bytes_sent  # one node: every byte stays on it
        else:
            record.intra_bytes, record.inter_bytes = self._split_sent(
                op, record.bytes_sent, count, dtype.itemsize
            )
        if blocking:
            record.wall_time = ledger.now() - record.start
        ledger.append(record)
        return record, seq, returned


def _nothing() -> None:
    """What completes a call that is already complete."""


_DTYPE_NAMES: dict[Any, str] = {}


def _dtype_name(dtype: Any) -> str:
    """``dtype_name`` memoised by dtype object (one dict lookup on the hot path)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype_name(dtype)
    return name
