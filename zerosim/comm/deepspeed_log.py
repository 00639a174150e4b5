"""The ledger in DeepSpeed's words: the table ``deepspeed.comm.log_summary()`` prints.

DeepSpeed's comms logger (``"comms_logger": {"enabled": true, "prof_all": true}``,
``deepspeed/utils/comms_logging.py``, 0.19) keeps, per collective name and message size, the
count and the latency of every call, and prints one row per (name, size)::

    Comm. Op            Message Size        Count               Total Latency(ms)   ...
    all_reduce
                        81.47 KB            6                   1.23                ...

``Ledger.ds_summary()`` builds the same rows from zerosim's records, with DeepSpeed's names,
message-size convention, units and arithmetic, so a zerosim run can be diffed against a DeepSpeed
log line by line. ``ledger.summary()`` keeps nccl-tests' conventions.

Names: zerosim's op → the ``deepspeed.comm`` function ZeRO calls (``NAMES``): all_gather →
``all_gather_into_tensor``, reduce_scatter → ``reduce_scatter_tensor``, all_to_all →
``all_to_all_single``; all_reduce, reduce, broadcast and barrier keep their names.

Message size (DeepSpeed logs the size of the tensor argument, in bytes):
    all_gather_into_tensor   the input shard, S / N
    reduce_scatter_tensor    the full input buffer, S
    all_reduce, reduce, broadcast, all_to_all_single   the buffer, S
    barrier                  0
where S is the record's ``size_bytes`` (the full buffer) and N the group's size. Sizes print with
DeepSpeed's ``convert_size``: powers of 1024, two decimals, "KB"/"MB" ("81.47 KB").

Latency is the call's wall time in ms (a non-blocking call: from its start to its ``wait()``).
Bandwidths are DeepSpeed's ``calc_bw_log`` in Gbit/s (bytes/ms · 8 / 1e6), with d the latency and
n the *world* size (DeepSpeed uses it for sub-group calls too):
    all_gather_into_tensor   algbw = size·n/d         busbw = algbw·(n−1)/n
    reduce_scatter_tensor    algbw = size·n/d         busbw = algbw·(n−1)/n
    all_reduce               algbw = 2·size/d         busbw = size/d · 2(n−1)/n
    all_to_all_single        algbw = size/d           busbw = algbw·(n−1)/n
    reduce, broadcast, barrier   algbw = busbw = size/d
DeepSpeed's reduce_scatter_tensor multiplies its message (already the full buffer) by n once more,
so its reduce-scatter bandwidths are n times nccl-tests'; its all_reduce algbw counts the buffer
twice. These rows reproduce DeepSpeed's numbers as they are, to be diffable. The averages are
DeepSpeed's ``trim_mean(values, 0.1)``: the mean after dropping round(0.1·count) values at each end
of the sorted list.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from zerosim.comm.record import Record

NAMES = {
    "all_gather": "all_gather_into_tensor",
    "reduce_scatter": "reduce_scatter_tensor",
    "all_to_all": "all_to_all_single",
    "all_reduce": "all_reduce",
    "reduce": "reduce",
    "broadcast": "broadcast",
    "barrier": "barrier",
}
COLUMNS = (
    "Comm. Op",
    "Message Size",
    "Count",
    "Total Latency(ms)",
    "Avg Latency(ms)",
    "tput_avg (Gbps)",
    "busbw_avg (Gbps)",
)


def message_size(record: Record) -> int:
    """The bytes DeepSpeed's logger names as the call's message size (its tensor argument)."""
    return _message_size(record.op, record.size_bytes, record.peers)


def _message_size(op: str, size_bytes: int, peers: int) -> int:
    return size_bytes // max(peers, 1) if op == "all_gather" else size_bytes


def convert_size(size_bytes: int) -> str:
    """DeepSpeed's ``convert_size``: "0B", "512.0 B", "81.47 KB", "1.5 MB" …"""
    if size_bytes == 0:
        return "0B"
    names = ("B", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")
    i = int(math.floor(math.log(size_bytes, 1024)))
    return f"{round(size_bytes / math.pow(1024, i), 2)} {names[i]}"


def bandwidths(name: str, size: int, latency_ms: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in Gbit/s as DeepSpeed's ``calc_bw_log`` computes them."""
    if latency_ms <= 0:
        return 0.0, 0.0
    if name == "all_to_all_single":
        algbw = size / latency_ms
        busbw = algbw * (n - 1) / n
    elif name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        algbw = size * n / latency_ms
        busbw = algbw * (n - 1) / n
    elif name == "all_reduce":
        algbw = 2 * size / latency_ms
        busbw = size / latency_ms * (2 * (n - 1) / n)
    else:
        algbw = busbw = size / latency_ms
    return algbw * 8 / 1e6, busbw * 8 / 1e6


def trim_mean(values: list[float], trim: float = 0.1) -> float:
    """DeepSpeed's ``trim_mean``: the mean of the sorted values less round(trim·n) at each end."""
    n = len(values)
    if n == 0:
        return 0
    k = int(round(n * trim))
    return float(np.mean(sorted(values)[k : n - k]))


def summary(
    records: Iterable[Record],
    world_size: int,
    folded: Iterable[tuple[str, int, int, Iterable[float]]] = (),
) -> dict[str, dict[int, dict[str, Any]]]:
    """``{name: {message size: row}}`` in first-call order of the names and ascending sizes, with
    the keys of ``deepspeed.comm.log_summary(return_dict=True)["summary"]``. ``folded``: more
    calls, as (op, size_bytes, peers, their wall times in seconds), before the records (how a
    bounded ledger hands over every call it counted, folded or kept)."""
    calls: dict[str, dict[int, list[float]]] = {}
    for op, size_bytes, peers, times in folded:
        latencies = calls.setdefault(NAMES[op], {}).setdefault(
            _message_size(op, size_bytes, peers), []
        )
        latencies.extend(t * 1e3 for t in times)
    for r in records:
        name = NAMES[r.op]
        latency = (r.wall_time or 0.0) * 1e3
        calls.setdefault(name, {}).setdefault(message_size(r), []).append(latency)
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for name, sizes in calls.items():
        out[name] = {}
        for size, latencies in sorted(sizes.items()):
            bws = [bandwidths(name, size, d, world_size) for d in latencies]
            out[name][size] = {
                "count": len(latencies),
                "total_latency_ms": sum(latencies),
                "avg_latency_ms": trim_mean(latencies),
                "tput_avg_gbps": trim_mean([a for a, _ in bws]),
                "busbw_avg_gbps": trim_mean([b for _, b in bws]),
                "msg_size_bytes": size,
                "msg_size_str": convert_size(size),
            }
    return out


def table(rows: dict[str, dict[int, dict[str, Any]]]) -> str:
    """The text ``deepspeed.comm.log_summary()`` prints for these rows (columns of 20)."""
    lines = ["".join(f"{c: <20}" for c in COLUMNS)]
    for name, sizes in rows.items():
        lines.append(name)
        for row in sizes.values():
            lines.append(
                f"{' ': <20}{row['msg_size_str']: <20}{row['count']: <20}"
                f"{row['total_latency_ms']: <20.2f}{row['avg_latency_ms']: <20.2f}"
                f"{row['tput_avg_gbps']: <20.2f}{row['busbw_avg_gbps']: <20.2f}"
            )
    return "\n".join(lines)
