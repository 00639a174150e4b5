"""Ring collectives over point-to-point messages, and the byte counts they imply.

With ``collectives="ring"`` a communicator runs these instead of the world's own collectives, so
the bytes in the ledger are the bytes really handed to send calls. ``model_bytes`` gives the same
numbers from the formulas, which is what the ledger records for native collectives; the two are
held equal by the tests. Ranks sit on a ring: each sends to ``rank + 1`` and receives from
``rank − 1``; the buffer is cut into ``size`` chunks.

all-gather (chunk c = S/N): step s = 0 … N−2, rank r sends chunk (r − s) and receives chunk
(r − s − 1). Each rank sends and receives (N−1)·c = (N−1)/N · S.

reduce-scatter: step s, rank r sends its partial sum of chunk (r − s − 1) and adds the partial
sum of chunk (r − s − 2) it receives to its own; after N−1 steps it holds the full sum of chunk r.
Each rank sends and receives (N−1)/N · S.

all-reduce: reduce-scatter then all-gather over chunks of sizes c_0 … c_{N−1} (the count need not
divide by N: the first ``count % N`` chunks are one element longer). Rank r sends every chunk but
r in the first half and every chunk but r + 1 in the second half:
    sent_r = 2·count − c_r − c_{r+1},   recv_r = 2·count − c_{r−1} − c_r   (elements, indices mod N)
which is 2(N−1)/N · S when N divides the count (nccl-tests' all-reduce volume).

broadcast: a chain from the root, rank at position i = (r − root) mod N forwards the whole buffer
to position i + 1; every rank but the last sends S, every rank but the root receives S.

reduce: the same chain run backwards, towards the root: position N−1 sends its buffer to N−2,
which adds its own and passes the partial sum on, until the root adds the last. Every rank but
the root sends S, every rank but the last receives S (the other ranks' buffers are untouched).

all-to-all: not a ring but a pairwise exchange: at step s = 1 … N−1, rank r sends block (r + s) to
rank r + s and receives block (r − s) from rank r − s. Each rank sends and receives
(N−1)/N · S, block j of it to rank j (which is how the ledger splits it by node).
"""

from __future__ import annotations

import itertools
from typing import Any, Protocol

from zerosim.backend import array_module, flat, nbytes, np_dtype
from zerosim.comm.checks import is_own_slice


class PointToPoint(Protocol):
    """What the ring algorithms need of a communicator: its rank, size and public point-to-point
    calls (every ``Communicator`` has them)."""

    rank: int
    size: int

    def send(self, buf: Any, dest: int) -> None: ...
    def recv(self, buf: Any, source: int) -> None: ...
    def sendrecv(self, sendbuf: Any, dest: int, recvbuf: Any, source: int) -> None: ...


def chunk_bounds(count: int, n: int) -> list[tuple[int, int]]:
    """[start, stop) of each of the n chunks of a count-element buffer (first count % n longer)."""
    base, extra = divmod(count, n)
    bounds, start = [], 0
    for i in range(n):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def model_bytes(
    op: str,
    count: int,
    n: int,
    rank: int,
    itemsize: int,
    root: int = 0,
    counts: tuple[int, ...] | None = None,
) -> tuple[int, int]:
    """(bytes sent, bytes received) by ``rank`` for one collective over a count-element buffer.

    ``counts`` gives uneven reduce-scatter pieces: rank r sends every piece but its own and
    receives every piece but its left neighbour's (count − c_r and count − c_{r−1} elements).
    """
    if n == 1 or op == "barrier":
        return 0, 0
    if counts is not None:
        return (count - counts[rank]) * itemsize, (count - counts[(rank - 1) % n]) * itemsize
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        moved = (n - 1) * (count // n) * itemsize
        return moved, moved
    if op == "all_reduce":  # chunk i of chunk_bounds holds base + (i < extra) elements
        base, extra = divmod(count, n)
        mine, right, left = (base + (i < extra) for i in (rank, (rank + 1) % n, (rank - 1) % n))
        sent = 2 * count - mine - right
        recv = 2 * count - left - mine
        return sent * itemsize, recv * itemsize
    position = (rank - root) % n
    total = count * itemsize
    if op == "broadcast":
        return (total if position < n - 1 else 0), (total if position > 0 else 0)
    if op == "reduce":
        return (total if position > 0 else 0), (total if position < n - 1 else 0)
    raise ValueError(f"no byte model for op {op!r}")


def split_by_node(
    nodes: tuple[int, ...] | None, rank: int, op: str, sent: int, count: int, itemsize: int
) -> tuple[int, int]:
    """(intra, inter) bytes of the ``sent`` bytes of ``rank`` (``nodes``: the node of each rank
    of the group, None for one node): ring ops and broadcast send all to rank + 1, reduce to
    rank − 1, all-to-all block j to rank j."""
    if nodes is None or sent == 0:
        return sent, 0
    size, mine = len(nodes), nodes[rank]
    if op == "all_to_all":
        block = count // size * itemsize
        local = sum(1 for q, n in enumerate(nodes) if q != rank and n == mine)
        return local * block, sent - local * block
    step = -1 if op == "reduce" else 1  # a reduce's chain runs towards the root
    return (sent, 0) if nodes[(rank + step) % size] == mine else (0, sent)


def _reduce_into(acc: Any, other: Any, op: str) -> None:
    xp = array_module(acc)
    {"sum": xp.add, "max": xp.maximum, "min": xp.minimum}[op](acc, other, out=acc)


Step = tuple[tuple[int, int], tuple[int, int]]  # ([start, stop) sent, [start, stop) received)


def reduce_scatter_plan(rank: int, bounds: list[tuple[int, int]]) -> list[Step]:
    """The ring reduce-scatter's steps on ``rank`` over chunks ``bounds``: at step s it sends
    its partial sum of chunk (rank − s − 1) and receives chunk (rank − s − 2) to add to its own,
    so that after N − 1 steps it holds the full sum of chunk ``rank``."""
    n = len(bounds)
    return [(bounds[(rank - s - 1) % n], bounds[(rank - s - 2) % n]) for s in range(n - 1)]


def all_gather_plan(rank: int, bounds: list[tuple[int, int]]) -> list[Step]:
    """The ring all-gather's steps on ``rank``, which starts with chunk ``rank`` complete: at step
    s it sends chunk (rank − s) and receives chunk (rank − s − 1)."""
    n = len(bounds)
    return [(bounds[(rank - s) % n], bounds[(rank - s - 1) % n]) for s in range(n - 1)]


def plan_bytes(plan: list[Step], itemsize: int) -> tuple[int, int]:
    """(bytes sent, bytes received) by the steps of ``plan``."""
    sent = sum(stop - start for (start, stop), _ in plan)
    recv = sum(stop - start for _, (start, stop) in plan)
    return sent * itemsize, recv * itemsize


# The algorithms below call the communicator's ``sendrecv`` (or ``send``/``recv``) from their own
# frame, so that the transfer is two Python frames below the public collective that runs them.
def all_gather(comm: PointToPoint, out: Any, inp: Any) -> tuple[int, int]:
    """Ring all-gather; returns (bytes sent, bytes received) by this rank."""
    n, r = comm.size, comm.rank
    bounds = chunk_bounds(out.size, n)
    whole = flat(out)
    if not is_own_slice(out, inp, r):
        start, stop = bounds[r]
        whole[start:stop] = flat(inp)
    plan = all_gather_plan(r, bounds)
    for (a0, a1), (b0, b1) in plan:
        comm.sendrecv(whole[a0:a1], (r + 1) % n, whole[b0:b1], (r - 1) % n)
    return plan_bytes(plan, np_dtype(out.dtype).itemsize)


def reduce_scatter(
    comm: PointToPoint, out: Any, inp: Any, op: str, counts: tuple[int, ...] | None
) -> tuple[int, int]:
    """Ring reduce-scatter; returns (bytes sent, bytes received).

    Equal chunks unless ``counts`` gives each rank's piece. When ``out`` is this rank's own chunk
    of ``inp`` the reduction runs in place and the rest of ``inp`` is left holding partial sums.
    """
    n, r = comm.size, comm.rank
    if counts is None:
        bounds = chunk_bounds(inp.size, n)
    else:
        edges = [0, *itertools.accumulate(counts)]
        bounds = list(zip(edges[:-1], edges[1:], strict=True))
    in_place = counts is None and is_own_slice(inp, out, r)
    xp = array_module(inp)
    work = flat(inp) if in_place else xp.asarray(flat(inp), copy=True)
    scratch = xp.empty(max(stop - start for start, stop in bounds), dtype=work.dtype)
    plan = reduce_scatter_plan(r, bounds)
    for (a0, a1), (b0, b1) in plan:
        incoming = scratch[: b1 - b0]
        comm.sendrecv(work[a0:a1], (r + 1) % n, incoming, (r - 1) % n)
        _reduce_into(work[b0:b1], incoming, op)
    if not in_place:
        start, stop = bounds[r]
        flat(out)[...] = work[start:stop]
    return plan_bytes(plan, np_dtype(inp.dtype).itemsize)


def all_reduce(comm: PointToPoint, buf: Any, op: str) -> tuple[int, int]:
    """Ring all-reduce in place: the reduce-scatter's steps, then the all-gather's, over the same
    chunks; returns (bytes sent, bytes received)."""
    n, r = comm.size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    bounds = chunk_bounds(buf.size, n)
    whole = flat(buf)
    scratch = array_module(buf).empty(bounds[0][1], dtype=whole.dtype)  # chunk 0 is the longest
    first, second = reduce_scatter_plan(r, bounds), all_gather_plan(r, bounds)
    for (a0, a1), (b0, b1) in first:  # rank r ends with the full sum of chunk r …
        incoming = scratch[: b1 - b0]
        comm.sendrecv(whole[a0:a1], right, incoming, left)
        _reduce_into(whole[b0:b1], incoming, op)
    for (a0, a1), (b0, b1) in second:  # … which the all-gather starts from
        comm.sendrecv(whole[a0:a1], right, whole[b0:b1], left)
    sent1, recv1 = plan_bytes(first, np_dtype(buf.dtype).itemsize)
    sent2, recv2 = plan_bytes(second, np_dtype(buf.dtype).itemsize)
    return sent1 + sent2, recv1 + recv2


def broadcast(comm: PointToPoint, buf: Any, root: int) -> tuple[int, int]:
    """Chain broadcast from ``root``; returns (bytes sent, bytes received)."""
    n = comm.size
    position = (comm.rank - root) % n
    whole = flat(buf)
    sent = recv = 0
    if position > 0:
        comm.recv(whole, (comm.rank - 1) % n)
        recv = nbytes(whole)
    if position < n - 1:
        comm.send(whole, (comm.rank + 1) % n)
        sent = nbytes(whole)
    return sent, recv


def reduce(comm: PointToPoint, buf: Any, root: int, op: str) -> tuple[int, int]:
    """Chain reduce towards ``root`` (broadcast's chain backwards); returns (sent, received).

    Only the root's ``buf`` changes: a rank in the middle adds its buffer to the partial sum it
    received, in a scratch array, and forwards that.
    """
    n = comm.size
    position = (comm.rank - root) % n
    whole = flat(buf)
    sent = recv = 0
    partial = whole
    if position < n - 1:
        incoming = array_module(whole).empty_like(whole)
        comm.recv(incoming, (comm.rank + 1) % n)
        recv = nbytes(whole)
        if position == 0:
            _reduce_into(whole, incoming, op)
        else:
            _reduce_into(incoming, whole, op)
            partial = incoming
    if position > 0:
        comm.send(partial, (comm.rank - 1) % n)
        sent = nbytes(whole)
    return sent, recv


def all_to_all(comm: PointToPoint, out: Any, inp: Any) -> tuple[int, int]:
    """Pairwise all-to-all (block j of ``inp`` to rank j); returns (bytes sent, bytes received)."""
    n, r = comm.size, comm.rank
    block = inp.size // n
    src, dst = flat(inp), flat(out)
    dst[r * block : (r + 1) * block] = src[r * block : (r + 1) * block]
    for s in range(1, n):
        to, source = (r + s) % n, (r - s) % n
        outgoing = src[to * block : (to + 1) * block]
        comm.sendrecv(outgoing, to, dst[source * block : (source + 1) * block], source)
    moved = (n - 1) * block * np_dtype(inp.dtype).itemsize
    return moved, moved
