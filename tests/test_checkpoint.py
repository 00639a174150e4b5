"""Checkpoints on LocalWorld: exact resume, resharding across N/stage/layout, errors, crashes."""

import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import pytest
from ckpt_worker import (
    Case,
    assemble,
    big_engine,
    big_steps,
    build_model,
    config,
    load_run,
    make_engine,
    pool,
    reference,
    rel_error,
    save_loop,
    save_run,
    shapes_of,
    snapshot,
    train_steps,
)

import zerosim as zs
from zerosim.checkpoint import files as checkpoint_io
from zerosim.checkpoint.files import SavedIndex, consolidate, read_metadata
from zerosim.checkpoint.sharded import (
    CheckpointError,
    CheckpointNotFoundError,
    load_checkpoint,
    plan_reads,
    save_checkpoint,
)
from zerosim.data import ArrayDataset
from zerosim.engine import initialize
from zerosim.nn import GPT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (saved N, stage, layout) → (loaded M, stage, layout), with a model/optimizer variant each.
RESHARD = [
    ((4, 2, "deepspeed"), (3, 1, "deepspeed"), dict(model="gpt")),
    ((3, 1, "deepspeed"), (4, 2, "deepspeed"), dict(model="mlp", optimizer="sgd")),
    ((2, 0, "deepspeed"), (8, 1, "deepspeed"), dict(model="mlp", sub_group_size=7)),
    ((3, 1, "megatron"), (2, 2, "deepspeed"), dict(model="gpt", clip=0.5)),
    ((2, 2, "deepspeed"), (3, 1, "megatron"), dict(model="gpt", accumulation=2)),
    ((4, 1, "deepspeed"), (1, 0, "deepspeed"), dict(model="mlp", clip=0.05)),
    ((4, 3, "deepspeed"), (3, 1, "deepspeed"), dict(model="gpt")),
    ((2, 1, "deepspeed"), (3, 3, "deepspeed"), dict(model="mlp", sub_group_size=11)),
    ((3, 3, "deepspeed"), (2, 3, "deepspeed"), dict(model="gpt", persistence=20)),
]


@pytest.mark.parametrize("saved, loaded, variant", RESHARD)
def test_checkpoint_loads_at_another_world_size_stage_and_layout(tmp_path, saved, loaded, variant):
    (n, s, lay), (m, s2, lay2) = saved, loaded
    case_a = Case(stage=s, layout=lay, micro=2, **variant)
    case_b = case_a.with_(stage=s2, layout=lay2)
    snaps = zs.LocalWorld(n).run(save_run, case_a, 3, str(tmp_path))
    out = zs.LocalWorld(m).run(load_run, case_b, str(tmp_path), 10)
    shapes = shapes_of(case_a)
    before, after = assemble(snaps, shapes), assemble([o[0] for o in out], shapes)
    assert before.keys() == after.keys() and len(before) >= 2  # master + at least one state
    for kind in before:  # element by element, bitwise
        for name in shapes:
            np.testing.assert_array_equal(after[kind][name], before[kind][name], f"{kind} {name}")
    assert all(o[0]["scalars"] == snaps[0]["scalars"] for o in out)
    for name in shapes:  # gather() after the load rebuilt the full parameters
        np.testing.assert_array_equal(out[0][1][name], before["master"][name], name)
    ref = reference(case_a, [n * case_a.micro] * 3)
    assert all(rel_error(before[k], ref[k]) < 1e-12 for k in ref)  # the saved state is right
    ref_after = reference(case_a, [n * case_a.micro] * 3 + [m * case_a.micro] * 10)["master"]
    # float64, 13 steps; the runs sum gradients over N ranks, the reference in one process, and
    # Adam's 1/√v magnifies those last-bit differences (measured up to 1.8e-12 here). A lost or
    # misplaced state after the load shows as 1e-4 or more.
    assert rel_error(out[0][2], ref_after) <= 1e-11
    assert all(o[3] == 13 for o in out)


def two_group_run(comm, ckpt, stage, steps):
    """SGD with momentum on the first layer's group, plain SGD (no state) on the other."""
    case = Case(model="mlp", stage=stage, optimizer="sgd")
    model = build_model(case)
    named = list(model.named_parameters())
    sgd = zs.optim.SGD(
        [
            {"params": [p for _, p in named[:2]], "momentum": 0.9},
            {"params": [p for _, p in named[2:]], "momentum": 0.0, "lr": 0.1},
        ],
        lr=0.05,
    )
    cfg = config(case)
    del cfg["optimizer"]
    engine, *_ = initialize(model, cfg, comm=comm, optimizer=sgd)
    if steps == 0:
        engine.load_checkpoint(ckpt)
    train_steps(engine, comm, case, steps, 0)
    if steps:
        engine.save_checkpoint(ckpt)
    return snapshot(engine)


def test_param_groups_with_different_state_keep_their_own_state(tmp_path):
    saved = zs.LocalWorld(3).run(two_group_run, str(tmp_path), 2, 2)
    loaded = zs.LocalWorld(2).run(two_group_run, str(tmp_path), 1, 0)
    shapes = shapes_of(Case(model="mlp"))
    want, got = assemble(saved, shapes), assemble(loaded, shapes)
    assert sorted(want["momentum_buffer"]) == ["layers.0.bias", "layers.0.weight"]
    assert got.keys() == want.keys()
    for kind in want:
        assert got[kind].keys() == want[kind].keys()
        for name in want[kind]:
            np.testing.assert_array_equal(got[kind][name], want[kind][name])
    assert loaded[0]["scalars"][1] == {} and loaded[0]["scalars"] == saved[0]["scalars"]


def dropout_run(comm, ckpt, steps, mode, stage, layout):
    """GPT with dropout, a shuffling loader and a scheduler: 'full', 'save' or 'resume'."""
    rng = np.random.default_rng(2)
    x = rng.integers(0, 11, (96, 6))
    model = GPT(11, 6, 1, 2, 8, dropout=0.2, seed=4, dtype="float64")
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 60},
        "zerosim": {"dtype": "float64", "layout": layout},
    }
    data = ArrayDataset(x, np.roll(x, -1, axis=1))
    engine, _, loader, sched = initialize(model, cfg, comm=comm, training_data=data)
    if mode == "resume":
        load_checkpoint(engine, ckpt, loader=loader)
    batches = iter(loader)
    while engine.global_steps < steps:
        try:
            xb, yb = next(batches)
        except StopIteration:
            batches = iter(loader)
            continue
        engine.backward(engine(xb, yb))
        engine.step()
    if mode == "save":
        save_checkpoint(engine, ckpt, loader=loader)
    return engine.full_state_dict(), snapshot(engine), engine.get_lr(), loader.state_dict()


@pytest.mark.parametrize(
    "stage, layout", [(0, "deepspeed"), (2, "deepspeed"), (1, "megatron"), (3, "deepspeed")]
)
def test_resume_continues_bitwise_like_an_uninterrupted_run(tmp_path, stage, layout):
    """Same N and stage: weights, states, lr, dropout masks and data order all carry over."""
    straight = zs.LocalWorld(2).run(dropout_run, None, 7, "full", stage, layout)
    zs.LocalWorld(2).run(dropout_run, str(tmp_path), 4, "save", stage, layout)  # mid-epoch
    resumed = zs.LocalWorld(2).run(dropout_run, str(tmp_path), 7, "resume", stage, layout)
    for a, b in zip(straight, resumed, strict=True):
        for name in a[0]:
            np.testing.assert_array_equal(b[0][name], a[0][name], name)
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            for pa, pb in zip(a[1][kind], b[1][kind], strict=True):
                np.testing.assert_array_equal(pb[3], pa[3], kind)
        assert b[1]["scalars"] == a[1]["scalars"] and b[2] == a[2] and b[3] == a[3]


def _scheduled_engine(comm, case, lr):
    cfg = config(case)
    cfg["optimizer"]["params"]["lr"] = lr
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_max_lr": lr, "warmup_num_steps": 9}}
    engine, *_ = initialize(build_model(case), cfg, comm=comm)
    return engine


@pytest.mark.parametrize("load_optimizer, load_scheduler", [(False, True), (True, False)])
def test_optimizer_or_scheduler_can_be_left_out_of_a_load(tmp_path, load_optimizer, load_scheduler):
    case = Case(model="mlp", stage=1)

    def save(comm):
        engine = _scheduled_engine(comm, case, 0.05)
        train_steps(engine, comm, case, 3, 0)
        engine.save_checkpoint(tmp_path)
        return snapshot(engine), engine.lr_scheduler.state_dict(), engine.get_lr()

    def load(comm):
        engine = _scheduled_engine(comm, case, 0.01)
        fresh_sched, fresh_lr = engine.lr_scheduler.state_dict(), engine.get_lr()
        engine.load_checkpoint(tmp_path, None, load_optimizer, load_scheduler)
        got = (snapshot(engine), engine.lr_scheduler.state_dict(), engine.get_lr())
        return got, fresh_sched, fresh_lr, engine.global_steps

    saved = zs.LocalWorld(2).run(save)
    out = zs.LocalWorld(3).run(load)
    (snap, sched, lr), fresh_sched, fresh_lr, steps = out[0]
    got = assemble([o[0][0] for o in out], shapes_of(case))
    want = assemble([s[0] for s in saved], shapes_of(case))
    for name, w in want["master"].items():
        np.testing.assert_array_equal(got["master"][name], w)
    assert steps == 3 and sched == (saved[0][1] if load_scheduler else fresh_sched)
    if load_optimizer:
        assert set(got) == set(want) and snap["scalars"] == saved[0][0]["scalars"]
        assert lr == saved[0][2] != fresh_lr  # the lr lives in the optimizer's groups
    else:
        assert set(got) == {"master"} and snap["scalars"] == [{}] and lr == fresh_lr


@pytest.mark.parametrize(
    "client", [{"epoch": 3, "note": "x", "pair": (1, 2.5)}, {"ids": {4, 5}, 7: np.arange(3)}]
)
def test_client_state_round_trips_through_json_or_pickle(tmp_path, client):
    def run(comm):
        engine = make_engine(comm, Case(model="mlp"))
        train_steps(engine, comm, Case(model="mlp"), 1, 0)
        engine.save_checkpoint(tmp_path, tag="t", client_state=client)
        return engine.load_checkpoint(tmp_path)

    path, got = zs.LocalWorld(2).run(run)[1]
    assert path == tmp_path / "t" and (tmp_path / "latest").read_text() == "t"
    assert got.keys() == client.keys()
    for k in client:
        assert type(got[k]) is type(client[k])
        assert np.array_equal(got[k], client[k]) if k == 7 else got[k] == client[k]
    json_file = (tmp_path / "t" / "client_state.json").exists()
    assert json_file == (7 not in client)


def _saved(tmp_path, n=3):
    case = Case(model="mlp", stage=2)
    snaps = zs.LocalWorld(n).run(save_run, case, 2, str(tmp_path))
    return case, snaps


def _load_expecting(tmp_path, case, exc, m=2):
    """Load on m ranks; every rank must raise ``exc``; the weights must be untouched."""

    def run(comm):
        engine = make_engine(comm, case)
        before = engine.full_state_dict()
        with pytest.raises(exc) as info:
            engine.load_checkpoint(tmp_path)
        after = engine.full_state_dict()
        assert all(np.array_equal(before[k], after[k]) for k in before)
        assert engine.global_steps == 0 and not engine.optimizer.state
        return str(info.value)

    return zs.LocalWorld(m).run(run)


@pytest.mark.parametrize(
    "target", ["rank00001.group0.exp_avg.npy", "rank00002.group0.master.npy", "metadata.json"]
)
def test_flipped_byte_is_detected_on_every_rank_naming_the_file(tmp_path, target):
    case, _ = _saved(tmp_path)
    path = tmp_path / "global_step2" / target
    raw = bytearray(path.read_bytes())
    raw[len(raw) - 9] ^= 0x10
    path.write_bytes(bytes(raw))
    messages = _load_expecting(tmp_path, case, CheckpointError)
    assert all(target in msg for msg in messages), messages


def test_truncated_shard_is_detected_naming_the_file(tmp_path):
    case, _ = _saved(tmp_path)
    path = tmp_path / "global_step2" / "rank00000.group0.exp_avg_sq.npy"
    path.write_bytes(path.read_bytes()[:-8])
    messages = _load_expecting(tmp_path, case, CheckpointError)
    assert all("rank00000.group0.exp_avg_sq.npy" in m and "truncated" in m for m in messages)


def test_missing_rank_files_are_listed_by_rank(tmp_path):
    case, _ = _saved(tmp_path, n=4)
    for f in (tmp_path / "global_step2").glob("rank0000[13].*"):
        f.unlink()
    messages = _load_expecting(tmp_path, case, CheckpointNotFoundError, m=3)
    assert all("rank(s) [1, 3]" in m for m in messages), messages


def test_missing_latest_and_model_mismatch_are_errors(tmp_path):
    _load_expecting(tmp_path, Case(model="mlp"), FileNotFoundError)
    _saved(tmp_path)
    messages = _load_expecting(tmp_path, Case(model="gpt"), CheckpointError)
    assert "layers.0.weight" in messages[0] and "wte.weight" in messages[0]
    messages = _load_expecting(tmp_path, Case(model="mlp", optimizer="sgd"), CheckpointError)
    assert "saved with optimizer AdamW" in messages[0]


@pytest.mark.parametrize("content", ["", "\n", "../elsewhere", "global_step9"])
def test_empty_or_damaged_latest_is_an_error_naming_it(tmp_path, content):
    case, _ = _saved(tmp_path)
    (tmp_path / "latest").write_text(content)
    kind = CheckpointNotFoundError if content == "global_step9" else CheckpointError
    messages = _load_expecting(tmp_path, case, kind)
    assert all(str(tmp_path / "latest") in m for m in messages), messages


def _writes_failing_at(monkeypatch, fail_at):
    """Make the ``fail_at``-th write of a checkpoint file (counted over all ranks) raise
    ENOSPC as a full disk does: an OSError that does not name the file. Returns the count."""
    import errno
    import threading

    calls, lock = [], threading.Lock()
    real = checkpoint_io._HashingFile.write

    def write(self, data):
        with lock:
            calls.append(1)
            full = len(calls) == fail_at + 1
        if full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, data)

    monkeypatch.setattr(checkpoint_io._HashingFile, "write", write)
    return calls


def test_save_on_a_full_disk_names_the_file_and_leaves_the_earlier_save_of_the_tag(
    tmp_path, monkeypatch
):
    """A write fails at each point of re-saving tag "t" in turn: every rank raises an OSError
    naming the file; the staging folder and temporary files are gone; "t" still holds the
    first save (or, when only `latest` failed, the complete second one)."""
    case = Case(model="mlp", stage=2)

    def save(comm, steps):
        engine = make_engine(comm, case)
        train_steps(engine, comm, case, steps, 0)
        try:
            engine.save_checkpoint(tmp_path, tag="t")
        except OSError as err:
            return snapshot(engine), str(err)
        return snapshot(engine), None

    def load(comm):
        engine = make_engine(comm, case)
        engine.load_checkpoint(tmp_path)
        return snapshot(engine)

    def weights(snaps):
        return assemble(snaps, shapes_of(case))["master"]

    first = weights([snap for snap, _ in zs.LocalWorld(2).run(save, 1)])
    counted = _writes_failing_at(monkeypatch, -1)  # never fails: counts a whole save's writes
    second = weights([snap for snap, _ in zs.LocalWorld(2).run(save, 2)])
    writes = len(counted)
    assert writes > 10, writes
    latest_write = writes - 1  # `latest` is written last
    zs.LocalWorld(2).run(save, 1)  # "t" back to the first save
    for fail_at in range(writes):
        monkeypatch.undo()
        _writes_failing_at(monkeypatch, fail_at)
        out = zs.LocalWorld(2).run(save, 2)
        monkeypatch.undo()
        errors = [err for _, err in out]
        assert all(err is not None and "No space left on device" in err for err in errors)
        assert all(str(tmp_path) in err for err in errors), errors  # the file is named
        assert {p.name for p in tmp_path.iterdir()} == {"t", "latest"}, fail_at
        assert not list(tmp_path.rglob(".*")), fail_at  # no staging folder or temporary file
        want = second if fail_at == latest_write else first
        got = weights(zs.LocalWorld(3).run(load))
        for name, w in want.items():
            np.testing.assert_array_equal(got[name], w)
        if fail_at == latest_write:
            zs.LocalWorld(2).run(save, 1)


def test_data_position_of_another_dataset_is_refused_naming_the_metadata(tmp_path):
    """A loader over another dataset would read another order from the saved position."""
    case = Case(model="mlp")
    x, y = pool(case)

    def run(comm, length, load):
        data = ArrayDataset(x[:length], y[:length])
        engine, *_ = initialize(build_model(case), config(case), comm=comm, training_data=data)
        if load:
            engine.load_checkpoint(tmp_path)
        else:
            engine.save_checkpoint(tmp_path)

    zs.LocalWorld(2).run(run, 100, False)
    with pytest.raises(
        CheckpointError,
        match=r"metadata.json: the saved data position .*"
        r"state\['dataset_len'\]=100, but this loader's dataset_len is 90",
    ):
        zs.LocalWorld(2).run(run, 90, True)


def test_save_inside_an_accumulation_window_is_refused(tmp_path):
    case = Case(model="mlp", accumulation=2)

    def run(comm):
        engine = make_engine(comm, case)
        x, y = np.ones((2, 6)), np.zeros(2, dtype=int)
        engine.backward(engine(x, y))
        engine.step()
        engine.save_checkpoint(tmp_path)

    with pytest.raises(ValueError, match="micro-step 1 is inside an accumulation window of 2"):
        zs.LocalWorld(2).run(run)
    assert not (tmp_path / "latest").exists()


def test_save_interrupted_at_every_rename_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """A rename that fails (as if the process died there) at each point of a save."""
    case = Case(model="mlp", stage=1)
    first = zs.LocalWorld(2).run(save_run, case, 2, str(tmp_path))
    # 3 kinds per rank, metadata and client state, the staging folder to the tag, latest
    renames = 2 * 3 + 2 + 1 + 1
    real = os.replace
    for fail_at in range(renames):
        calls = []

        def flaky(src, dst, fail_at=fail_at, calls=calls):
            calls.append(dst)
            if len(calls) == fail_at + 1:
                raise OSError(f"simulated crash renaming {dst}")
            return real(src, dst)

        monkeypatch.setattr(os, "replace", flaky)
        with pytest.raises(OSError, match="simulated crash"):
            zs.LocalWorld(2).run(save_run, case, 3, str(tmp_path))
        monkeypatch.setattr(os, "replace", real)
        assert (tmp_path / "latest").read_text() == "global_step2"
        out = zs.LocalWorld(2).run(load_run, case, str(tmp_path), 0)
        got, want = assemble([o[0] for o in out], shapes_of(case)), assemble(first, shapes_of(case))
        for kind in want:
            for name in want[kind]:
                np.testing.assert_array_equal(got[kind][name], want[kind][name])
        assert not list(tmp_path.rglob(".*.tmp*"))  # no temporary file left behind
        # nor a staging folder; the new tag exists only if it was complete (latest failed)
        left = {p.name for p in tmp_path.iterdir()}
        assert left == {"global_step2", "latest"} | (
            {"global_step3"} if fail_at == renames - 1 else set()
        )
    assert len(calls) == renames


@pytest.mark.slow
def test_save_killed_at_random_times_leaves_a_loadable_latest_checkpoint(tmp_path):
    rng = np.random.default_rng(0)
    found = []
    for trial in range(4):
        ckpt = tmp_path / f"run{trial}"
        env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
        proc = subprocess.Popen(
            [sys.executable, "tests/helpers/ckpt_worker.py", "save_loop", str(ckpt)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            first = proc.stdout.readline()
            assert first.startswith("saved 1"), first
            time.sleep(rng.uniform(0.0, 0.5))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            proc.stdout.close()
        k = int((ckpt / "latest").read_text().removeprefix("global_step"))
        found.append((ckpt, k))
    wanted = {k: None for _, k in found} | {k + 1: None for _, k in found}
    zs.LocalWorld(2).run(save_loop, None, wanted)

    def load(comm, ckpt, tag):
        engine = big_engine(comm)
        engine.load_checkpoint(ckpt, tag=tag)
        return engine.full_state_dict(), engine.global_steps

    for ckpt, k in found:
        got, steps = zs.LocalWorld(2).run(load, ckpt, None)[0]
        assert steps == k
        for name, w in wanted[k].items():
            np.testing.assert_array_equal(got[name], w)
        if (ckpt / f"global_step{k + 1}").exists():  # the save that was killed
            try:
                got, _ = zs.LocalWorld(2).run(load, ckpt, f"global_step{k + 1}")[0]
            except CheckpointError:  # unfinished: refused, never half-loaded
                continue
            for name, w in wanted[k + 1].items():  # finished but for `latest`
                np.testing.assert_array_equal(got[name], w)


def test_each_loading_rank_plans_to_read_only_what_it_steps(tmp_path):
    case = Case(model="gpt", stage=1)
    zs.LocalWorld(4).run(save_run, case, 1, str(tmp_path))
    index = SavedIndex(read_metadata(tmp_path / "global_step1"))
    total = sum(int(np.prod(s)) for s in shapes_of(case).values())

    def plan(comm):
        engine = make_engine(comm, case.with_(stage=2))
        segs = engine.strategy.segments("stepped")
        reads = plan_reads(segs, index)
        return sum(r.size for r in reads), sum(s.size for s in segs)

    out = zs.LocalWorld(3).run(plan)
    assert all(read == held for read, held in out)
    assert sum(read for read, _ in out) == total and max(r for r, _ in out) < total / 2


def test_consolidated_file_equals_full_state_dict_with_bounded_memory(tmp_path):
    def run(comm):
        engine = big_engine(comm, [256] * 7 + [10])
        big_steps(engine, comm, 2)
        engine.save_checkpoint(tmp_path / "ckpt")
        return engine.full_state_dict(), snapshot(engine)

    out = zs.LocalWorld(3).run(run)
    full = out[0][0]
    largest = max(a.nbytes for a in full.values())
    bound = 2 * largest + 2**18
    assert sum(a.nbytes for a in full.values()) > bound  # only streaming stays under it
    tracemalloc.start()
    try:
        consolidate(tmp_path / "ckpt", tmp_path / "full.npz", with_optimizer=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < bound, (peak, largest)
    states = assemble([o[1] for o in out], {n: a.shape for n, a in full.items()})
    with np.load(tmp_path / "full.npz") as z:
        for name, w in full.items():
            np.testing.assert_array_equal(z[name], w)
            for kind in ("exp_avg", "exp_avg_sq"):
                np.testing.assert_array_equal(z[f"optimizer/{kind}/{name}"], states[kind][name])
        assert float(z["optimizer/step/group0"]) == 2.0


def test_consolidate_command_writes_the_weights(tmp_path, capsys):
    from zerosim.cli import main

    case = Case(model="gpt", stage=1, layout="megatron")
    zs.LocalWorld(3).run(save_run, case, 2, str(tmp_path / "c"))
    assert main(["consolidate", str(tmp_path / "c"), str(tmp_path / "w.npz")]) == 0
    want = reference(case, [3 * case.micro] * 2)["master"]
    with np.load(tmp_path / "w.npz") as z:
        assert sorted(z.files) == sorted(want)
        assert rel_error({k: z[k] for k in z.files}, want) < 1e-12
    with pytest.raises(ValueError, match="must end in .npz"):
        consolidate(tmp_path / "c", tmp_path / "w.safetensors")


def test_metadata_is_plain_json_describing_every_rank(tmp_path):
    case = Case(model="mlp", stage=2)
    zs.LocalWorld(3).run(save_run, case, 1, str(tmp_path))
    meta = json.loads((tmp_path / "global_step1" / "metadata.json").read_text())
    assert (meta["stage"], meta["world_size"], meta["layout"]) == (2, 3, "deepspeed")
    assert meta["padded_numel"] == 138 and meta["optimizer"] == "AdamW"
    assert meta["groups"][0]["state_keys"] == ["exp_avg", "exp_avg_sq"]
    assert meta["groups"][0]["scalars"] == {"step": 1.0}
    for r, rank in enumerate(meta["ranks"]):  # rank r owns [46r, 46r+46) of the flat buffer
        owned = sum(stop - start for _, start, stop, _ in rank["segments"][0])
        assert owned == min(46, 137 - 46 * r)
        arr = np.load(tmp_path / "global_step1" / f"rank{r:05d}.group0.master.npy")
        assert arr.shape == (owned,)
    assert checkpoint_io.FORMAT_VERSION == meta["format_version"]


def test_train_command_resumes_from_its_saved_checkpoint(tmp_path):
    from zerosim.cli import build_parser
    from zerosim.cli import train as train_demo

    def run(comm, *extra):
        argv = ["train", "--model", "mlp", "--quiet", *extra]
        return train_demo.train(comm, build_parser().parse_args(argv))["engine"].full_state_dict()

    straight = zs.LocalWorld(2).run(run, "--steps", "5")[0]
    zs.LocalWorld(2).run(run, "--steps", "3", "--save", str(tmp_path))
    resumed = zs.LocalWorld(2).run(run, "--steps", "5", "--resume", str(tmp_path))[0]
    assert (tmp_path / "latest").read_text() == "global_step3"
    for name, w in straight.items():
        np.testing.assert_array_equal(resumed[name], w)


def test_saving_a_tag_again_replaces_all_of_its_files(tmp_path):
    case = Case(model="mlp", stage=2)

    def save(comm, steps):
        engine = make_engine(comm, case)
        train_steps(engine, comm, case, steps, 0)
        engine.save_checkpoint(tmp_path, tag="same")
        return snapshot(engine)

    zs.LocalWorld(3).run(save, 1)
    second = zs.LocalWorld(2).run(save, 2)
    names = sorted(f.name for f in (tmp_path / "same").iterdir())
    assert (
        not [n for n in names if n.startswith("rank00002")] and len(names) == 2 * 3 + 1
    )  # + metadata

    def load(comm):
        engine = make_engine(comm, case)
        engine.load_checkpoint(tmp_path)
        return snapshot(engine)

    out = zs.LocalWorld(3).run(load)
    got, want = assemble(out, shapes_of(case)), assemble(second, shapes_of(case))
    for name, w in want["exp_avg"].items():
        np.testing.assert_array_equal(got["exp_avg"][name], w)


def test_ranks_passing_different_tags_all_raise(tmp_path):
    def run(comm):
        engine = make_engine(comm, Case(model="mlp"))
        with pytest.raises(ValueError, match="tag differs across ranks"):
            engine.save_checkpoint(tmp_path, tag=f"t{comm.rank}")
        with pytest.raises(ValueError, match="tag must be a non-empty directory name"):
            engine.save_checkpoint(tmp_path, tag="../escape")

    zs.LocalWorld(3).run(run)
    assert not list(tmp_path.iterdir())
