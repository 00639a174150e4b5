"""ledger.ds_summary() / ds_table(): the ledger as DeepSpeed's comms logger prints it.

The oracle is DeepSpeed's own ``CommsLogger``: it is fed the very calls the ledger recorded (the
message size taken by DeepSpeed's ``get_msg_size_from_args`` from torch tensors of the call's
shapes, the latency from the record), and its ``log_all()`` text and dictionary must equal ours.
"""

from __future__ import annotations

import importlib
import inspect

import numpy as np
import pytest

import zerosim as zs
from zerosim.comm import Ledger, Record


def collectives(comm) -> list:
    """Every kind of call, several sizes, repeated calls, a sub-group: this rank's records."""
    f32 = np.float32
    for count in (1000, 1000, 3000, 0):
        comm.all_gather(np.empty(comm.size * count, f32), np.ones(count, f32))
    for count in (4000, 4000, 4000, 4000, 4000, 4000, 800):
        comm.reduce_scatter(np.empty(count // comm.size, f32), np.ones(count, f32))
    for count in (20_000, 1, 20_000):
        comm.all_reduce(np.ones(count))
    comm.iall_reduce(np.ones(7, np.int64)).wait()
    comm.broadcast(np.ones(300, f32), root=1)
    comm.barrier()
    for root in range(comm.size):
        comm.ireduce(np.ones(250, f32), root=root).wait()
    sub = comm.split(comm.rank % 2)
    sub.all_to_all(np.empty(8 * sub.size), np.ones(8 * sub.size))
    sub.all_gather(np.empty(6 * sub.size, f32), np.ones(6, f32))
    return comm.ledger.records


def test_rows_equal_deepspeeds_comms_logger_fed_the_same_calls(monkeypatch, capsys):
    deepspeed = pytest.importorskip("deepspeed")
    torch = pytest.importorskip("torch")
    from deepspeed.utils.comms_logging import CommsLogger

    ds_utils = importlib.import_module("deepspeed.comm.utils")  # deepspeed.comm.utils is another

    n = 4
    records = zs.LocalWorld(n).run(collectives)[0]
    monkeypatch.setattr(deepspeed.comm, "get_world_size", lambda group=None: n)

    def undecorated(name: str):
        """The deepspeed.comm function under its logging wrapper (what DeepSpeed inspects)."""
        cells = getattr(deepspeed.comm, name).__closure__
        return next(
            c.cell_contents
            for c in cells
            if inspect.isfunction(c.cell_contents) and c.cell_contents.__name__ == name
        )

    dtypes = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64}
    dtypes["uint8"] = torch.uint8  # a barrier's record
    logger = CommsLogger()
    for r in records:
        dt = dtypes[r.dtype]
        full = torch.zeros(r.elements, dtype=dt)
        shard = torch.zeros(r.elements // max(r.peers, 1), dtype=dt)
        name, args = {
            "all_gather": ("all_gather_into_tensor", (full, shard)),
            "reduce_scatter": ("reduce_scatter_tensor", (shard, full)),
            "all_reduce": ("all_reduce", (full,)),
            "reduce": ("reduce", (full, 0)),
            "broadcast": ("broadcast", (full, 0)),
            "all_to_all": ("all_to_all_single", (torch.zeros_like(full), full)),
            "barrier": ("barrier", ()),
        }[r.op]
        size = ds_utils.get_msg_size_from_args(undecorated(name), *args)
        logger.append(name, name, r.wall_time * 1e3, size)

    ledger = Ledger()
    ledger.records = list(records)
    ours = ledger.ds_summary()
    theirs = logger.log_all(print_log=True, return_dict=True)["summary"]
    printed = capsys.readouterr().out
    printed = printed[printed.index("Comm. Op") :]  # after DeepSpeed's accelerator warning
    assert list(ours) == list(theirs)  # the same names in the same order
    for name, sizes in theirs.items():
        assert list(ours[name]) == sorted(sizes), name
        for size, row in sizes.items():
            assert ours[name][size].keys() == row.keys()
            for key, value in row.items():
                want = value if isinstance(value, str) else pytest.approx(value, rel=1e-12)
                assert ours[name][size][key] == want, (name, size, key)
    assert ledger.ds_table().splitlines() == printed.splitlines()
    # the convention: an all-gather's message is its input shard, a reduce-scatter's its input
    assert 4000 in ours["all_gather_into_tensor"] and 16000 in ours["reduce_scatter_tensor"]


def record(op: str, elements: int, itemsize: int, peers: int, ms: float) -> Record:
    return Record(
        op=op,
        phase="none",
        group="world",
        dtype="float32",
        elements=elements,
        size_bytes=elements * itemsize,
        bytes_sent=0,
        bytes_recv=0,
        peers=peers,
        step=0,
        counted="model",
        blocking=True,
        start=0.0,
        wall_time=ms / 1e3,
    )


def test_message_sizes_units_and_bandwidths_by_hand():
    ledger = Ledger()
    ledger.records = [
        record("all_gather", 4000, 4, 4, 2.0),  # shard 4,000 B, gathered 16,000 B in 2 ms
        record("all_reduce", 1000, 4, 4, 1.0),
        record("reduce_scatter", 4000, 4, 2, 4.0),  # a 2-rank sub-group: n is still the world's
        *[record("broadcast", 256, 4, 4, ms) for ms in (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 9.0)],
    ]
    rows = ledger.ds_summary()
    ag = rows["all_gather_into_tensor"][4000]
    assert ag["msg_size_str"] == "3.91 KB"
    assert ag["tput_avg_gbps"] == pytest.approx(16_000 / 2e-3 * 8 / 1e9)  # Gbit/s
    assert ag["busbw_avg_gbps"] == pytest.approx(ag["tput_avg_gbps"] * 3 / 4)
    ar = rows["all_reduce"][4000]
    assert ar["tput_avg_gbps"] == pytest.approx(2 * 4000 / 1e-3 * 8 / 1e9)  # counted twice
    assert ar["busbw_avg_gbps"] == pytest.approx(4000 / 1e-3 * 2 * 3 / 4 * 8 / 1e9)
    rs = rows["reduce_scatter_tensor"][16000]  # the full buffer, times n = 4 in the bandwidth
    assert rs["tput_avg_gbps"] == pytest.approx(16000 * 4 / 4e-3 * 8 / 1e9)
    bc = rows["broadcast"][1024]
    assert bc["msg_size_str"] == "1.0 KB" and bc["count"] == 8
    assert bc["total_latency_ms"] == pytest.approx(16.0)
    assert bc["avg_latency_ms"] == pytest.approx(1.0)  # round(0.8) = 1 dropped at each end
    table = ledger.ds_table().splitlines()
    assert table[0].startswith("Comm. Op            Message Size        Count")
    assert table[1] == "all_gather_into_tensor"
    assert table[2].split() == ["3.91", "KB", "1", "2.00", "2.00", "0.06", "0.05"]


def test_zerosim_train_ds_summary_prints_deepspeeds_layout_and_json_rows(capsys):
    import json

    from zerosim.cli import main

    args = ["train", "--local", "2", "--model", "mlp", "--steps", "2", "--quiet", "--ds-summary"]
    assert main(args) == 0
    out = capsys.readouterr().out
    table = out[out.index("Comm. Op") :].split("\n\n")[0].splitlines()
    assert table[0].split("  ")[0] == "Comm. Op"
    names = [line for line in table if line and not line.startswith(" ")][1:]
    # the default job is stage 3: gathers and reduce-scatters, init's broadcasts, the norm
    assert set(names) == {
        "all_reduce",
        "broadcast",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
    }
    assert main([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.splitlines()[-1])["ds_summary"]
    calls = sum(row["count"] for sizes in rows.values() for row in sizes.values())
    assert calls > 0 and all(k.isdigit() for sizes in rows.values() for k in sizes)
