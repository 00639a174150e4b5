"""ZeRO-Offload / ZeRO-Infinity: bitwise parity, the swap files' contents, placement, errors."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import zerosim as zs
from zerosim.analysis import zero_model_states
from zerosim.engine import initialize
from zerosim.nn import GPT, MLP
from zerosim.zero.offload import KEEP_ENV, file_backed, optimizer_arrays, read_param_chunk

ROOT = Path(__file__).resolve().parent.parent
SUB = 7  # sub_group_size of the offloaded runs: many tiles per shard (the baselines use 1e9)


def config(stage, precision, nvme_path, opt="none", param="none", **zero):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.5,
        "steps_per_print": 10**6,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 50,
            "offload_optimizer": {"device": opt, "nvme_path": str(nvme_path)},
            **zero,
        },
    }
    if stage == 3:
        cfg["zero_optimization"]["offload_param"] = {"device": param, "nvme_path": str(nvme_path)}
        cfg["zero_optimization"].setdefault("stage3_param_persistence_threshold", 10)
    if precision == "fp32":
        cfg["zerosim"] = {"dtype": "float32"}
    else:
        cfg[precision] = {"enabled": True}
    return cfg


def batches(comm, step, model):
    """This rank's micro-batch of global step ``step`` (2 samples per rank)."""
    rng = np.random.default_rng(100 + step)
    lo, hi = 2 * comm.rank, 2 * comm.rank + 2
    if model == "gpt":
        x = rng.integers(0, 13, (2 * comm.size, 5))
        return x[lo:hi], np.roll(x, -1, axis=1)[lo:hi]
    return rng.standard_normal((2 * comm.size, 6)).astype(np.float32)[lo:hi], np.arange(4)[:2]


def train(comm, cfg, steps=3, model="gpt", engine=None, first=0):
    if engine is None:
        net = (
            GPT(vocab_size=13, block_size=5, n_layer=2, n_head=2, n_embd=6, seed=3)
            if model == "gpt"
            else MLP([6, 9, 5, 4], seed=3)
        )
        engine, *_ = initialize(net, cfg, comm=comm)
    for s in range(first, first + steps):
        engine.backward(engine(*batches(comm, s, model)))
        engine.step()
    return engine


def params_after(comm, cfg, steps=3):
    return train(comm, cfg, steps).full_state_dict()


PARITY = [
    (stage, precision, opt, param)
    for stage in (1, 2, 3)
    for precision in ("fp32", "bf16")
    for opt in ("none", "cpu", "nvme")
    for param in (("none", "cpu", "nvme") if stage == 3 else ("none",))
    if (opt, param) != ("none", "none")
]


@pytest.mark.parametrize("stage, precision, opt, param", PARITY)
def test_offload_gives_bitwise_the_parameters_of_the_run_without_offload(
    tmp_path, stage, precision, opt, param
):
    base = zs.LocalWorld(3).run(params_after, config(stage, precision, tmp_path))[0]
    cfg = config(stage, precision, tmp_path, opt, param, sub_group_size=SUB)
    got = zs.LocalWorld(3).run(params_after, cfg)[0]
    assert base.keys() == got.keys()
    start = dict(
        GPT(vocab_size=13, block_size=5, n_layer=2, n_head=2, n_embd=6, seed=3).state_dict()
    )
    assert not np.array_equal(base["wte.weight"], start["wte.weight"])  # training moved it
    for name in base:
        np.testing.assert_array_equal(got[name], base[name], name)


def test_fp16_overflow_skips_with_nvme_offload_match_the_run_without_offload(tmp_path):
    """fp16 from scale 2**20: the first steps overflow and are skipped on every rank."""

    def run(comm, opt):
        cfg = config(2, "fp16", tmp_path, opt, sub_group_size=SUB)
        cfg["fp16"]["initial_scale_power"] = 20
        engine = train(comm, cfg, steps=8)
        return engine.full_state_dict(), engine.skipped_steps

    (base, skipped), _ = zs.LocalWorld(2).run(run, "none")
    (got, skipped_nvme), _ = zs.LocalWorld(2).run(run, "nvme")
    assert 8 > skipped == skipped_nvme >= 1  # some steps skipped, some taken
    for name in base:
        np.testing.assert_array_equal(got[name], base[name], name)


@pytest.mark.parametrize("stage, precision", [(2, "fp32"), (3, "bf16"), (1, "bf16")])
def test_nvme_files_hold_the_master_weights_and_optimizer_states(tmp_path, stage, precision):
    """Read each rank's swap files with numpy; compare with a run without offload."""
    keys = ("exp_avg", "exp_avg_sq")

    def run(comm, opt):
        cfg = config(
            stage,
            precision,
            tmp_path,
            opt,
            sub_group_size=SUB,
            stage3_param_persistence_threshold=0,
        )
        engine = train(comm, cfg, steps=2)
        strategy, state = engine.strategy, engine.optimizer.state
        want = {
            kind: [
                np.concatenate(
                    [np.asarray(s.data if kind == "master" else state[s][kind]) for s in g]
                )
                for g in strategy.sharded_step.tiles
            ]
            for kind in ("master", *keys)
        }
        if opt == "none":
            return want, None
        store = strategy.offload.optimizer_store
        files = {
            kind: [
                np.fromfile(store.path(f"group{gi}.{kind}"), dtype=np.float32)
                for gi in range(len(strategy.sharded_step.tiles))
            ]
            for kind in ("master", *keys)
        }
        views = all(file_backed(a) for a in optimizer_arrays(strategy))
        return files, views

    base = zs.LocalWorld(2).run(run, "none")
    nvme = zs.LocalWorld(2).run(run, "nvme")
    for (want, _), (files, views) in zip(base, nvme, strict=True):
        assert views  # between steps the master and the states are the files themselves
        for kind in want:
            for w, f in zip(want[kind], files[kind], strict=True):
                assert f.size == w.size > 0
                np.testing.assert_array_equal(f, w, kind)


def test_nvme_swap_reads_and_writes_master_and_states_once_per_step(tmp_path):
    """Per step: (1 + K)·P·4 bytes in and out; buffers ⌊buffer_count/(1+K)⌋·(1+K)·T·4 bytes."""
    n, steps, k, buffer_count = 2, 3, 2, 7

    def run(comm):
        cfg = config(2, "bf16", tmp_path, "nvme", sub_group_size=SUB)
        cfg["zero_optimization"]["offload_optimizer"]["buffer_count"] = buffer_count
        engine = train(comm, cfg, steps=steps, model="mlp")
        store = engine.strategy.offload.optimizer_store
        return store.bytes_read, store.bytes_written, engine.memory_report(), engine.strategy

    for read, written, report, strategy in zs.LocalWorld(n).run(run):
        p = strategy.padded_numel // n  # 137 parameters padded to 2N = 4's multiple 140: 70
        assert p == 70
        first_read = 4 * p  # the first step finds no state to read, only the master
        assert read == first_read + (steps - 1) * (1 + k) * 4 * p
        assert written == steps * (1 + k) * 4 * p
        assert report["swap_buffers"] == (buffer_count // (1 + k)) * (1 + k) * SUB * 4


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_memory_report_splits_device_host_and_nvme_bytes_as_the_offload_formula_says(
    tmp_path, n, precision
):
    """The split equals zero_model_states(...).split() (swap buffers added to host); the
    model-state categories sum to the run without offload (fp32 adds the master copy)."""
    b = 4 if precision == "fp32" else 2
    categories = (
        "params",
        "grads",
        "master_params",
        "optimizer_state.exp_avg",
        "optimizer_state.exp_avg_sq",
    )

    def run(comm, stage, opt, param):
        cfg = config(stage, precision, tmp_path, opt, param, stage3_param_persistence_threshold=0)
        engine = train(comm, cfg, steps=1, model="mlp")
        return {**engine.memory_report(), **engine.memory_totals()}, engine.strategy.padded_numel

    combos = [(1, "cpu", "none"), (2, "nvme", "none"), (3, "cpu", "nvme"), (3, "nvme", "cpu")]
    for stage, opt, param in combos:
        base, padded = zs.LocalWorld(n).run(run, stage, "none", "none")[0]
        got, padded_again = zs.LocalWorld(n).run(run, stage, opt, param)[0]
        assert padded == padded_again
        want = zero_model_states(
            padded,
            n,
            stage,
            param_bytes=b,
            master_bytes=4,
            state_bytes=4,
            num_states=2,
            offload_optimizer=opt,
            offload_param=param,
        )
        split = want.split()
        assert got["device_bytes"] == split["device"]
        assert got["host_bytes"] == split["host"] + got["swap_buffers"]
        assert got["nvme_bytes"] == split["nvme"]
        extra_master = 4 * padded // n if precision == "fp32" else 0  # forced master copy
        assert sum(got[c] for c in categories) == sum(base[c] for c in categories) + extra_master
        assert base["host_bytes"] == base["nvme_bytes"] == 0


def test_checkpoint_saved_with_nvme_offload_resumes_bitwise(tmp_path):
    """Save after 2 steps, train 2 more; a fresh engine (nvme offload, or none) loads and trains
    the same 2 steps: the same parameters to the bit. Loading into an engine with a separate
    master needs checkpoint.load_checkpoint to call strategy.sharded_step.params_from_master()
    before gather() (without it the parameters keep their pre-load values until the next step)."""
    ckpt = tmp_path / "ckpt"

    def run(comm, load_opt):
        cfg = config(2, "fp32", tmp_path, "nvme", sub_group_size=SUB)
        engine = train(comm, cfg, steps=2)
        engine.save_checkpoint(str(ckpt), tag="t")
        want = train(comm, cfg, steps=2, engine=engine, first=2).full_state_dict()
        fresh = train(comm, config(2, "fp32", tmp_path, load_opt, sub_group_size=SUB), steps=0)
        fresh.load_checkpoint(str(ckpt), tag="t")
        got = train(comm, None, steps=2, engine=fresh, first=2).full_state_dict()
        return want, got

    for load_opt in ("none", "nvme"):
        for want, got in zs.LocalWorld(2).run(run, load_opt):
            for name in want:
                np.testing.assert_array_equal(got[name], want[name], f"{load_opt} {name}")


def test_stage3_param_file_holds_the_shard_and_feeds_each_gather(tmp_path):
    def run(comm, param):
        cfg = config(3, "bf16", tmp_path, "none", param, stage3_param_persistence_threshold=0)
        engine = train(comm, cfg, steps=2)
        (g,) = engine.strategy.groups
        if param == "none":
            return np.asarray(g.flat_param).copy(), None
        store = engine.strategy.offload.param_store
        on_disk = np.fromfile(store.path("group0.params"), dtype=g.flat_param.dtype)
        before = store.bytes_read
        chunks = [read_param_chunk(engine.strategy, g, i) for i in range(len(g.named_params))]
        assert store.bytes_read - before == sum(c.nbytes for c in chunks)
        assert not any(np.shares_memory(c, g.flat_param) for c in chunks)  # read into memory
        return on_disk, np.concatenate(chunks)

    for (want, _), (on_disk, chunks) in zip(
        zs.LocalWorld(2).run(run, "none"), zs.LocalWorld(2).run(run, "nvme"), strict=True
    ):
        np.testing.assert_array_equal(on_disk, want)
        np.testing.assert_array_equal(chunks, want)


@pytest.mark.parametrize("section", ["offload_optimizer", "offload_param"])
@pytest.mark.parametrize("problem", ["does not exist", "is not a directory", "is not writable"])
def test_bad_nvme_path_is_a_config_error_naming_the_key_on_every_rank(tmp_path, section, problem):
    if problem == "does not exist":
        path = tmp_path / "missing"
    elif problem == "is not a directory":
        path = tmp_path / "a_file"
        path.write_text("x")
    else:
        path = tmp_path / "read_only"
        path.mkdir()
        path.chmod(0o500)
        if os.geteuid() == 0:  # root ignores permission bits; sysfs refuses new files to root
            path = Path("/sys")

    def run(comm):
        opt, param = ("nvme", "none") if section == "offload_optimizer" else ("cpu", "nvme")
        with pytest.raises(zs.ConfigError) as err:
            train(comm, config(3, "fp32", path, opt, param), steps=0)
        return str(err.value)

    for message in zs.LocalWorld(2).run(run):
        assert f"zero_optimization.{section}.nvme_path" in message and problem in message


def test_nvme_path_bad_on_one_rank_makes_every_rank_raise(tmp_path):
    def run(comm):
        path = tmp_path / ("missing" if comm.rank == 1 else "")
        with pytest.raises(zs.ConfigError) as err:
            train(comm, config(2, "fp32", path, "nvme"), steps=0)
        return str(err.value)

    messages = zs.LocalWorld(3).run(run)
    assert "does not exist" in messages[1]
    assert all("fails on rank(s) [1]" in m for m in (messages[0], messages[2]))


def test_buffer_count_below_one_plus_the_optimizer_states_is_a_config_error(tmp_path):
    def run(comm):
        cfg = config(2, "fp32", tmp_path, "nvme")
        cfg["zero_optimization"]["offload_optimizer"]["buffer_count"] = 2  # Adam needs 3
        with pytest.raises(zs.ConfigError, match="offload_optimizer.buffer_count.*>= 3"):
            train(comm, cfg, steps=0)

    zs.LocalWorld(2).run(run)
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_swap_files_are_removed_on_close_unless_kept(tmp_path, monkeypatch):
    def run(comm):
        engine = train(comm, config(3, "fp32", tmp_path, "nvme", "nvme"), steps=1)
        return engine.strategy

    strategies = zs.LocalWorld(2).run(run)
    dirs = sorted(p.name for p in tmp_path.iterdir())
    assert [d.split("_")[1] for d in dirs] == ["rank0", "rank1"]
    names = sorted(p.name for p in (tmp_path / dirs[0]).iterdir())
    assert names == [f"group0.{k}.swp" for k in ("exp_avg", "exp_avg_sq", "master", "params")]
    monkeypatch.setenv(KEEP_ENV, "1")
    strategies[0].close()
    assert (tmp_path / dirs[0]).is_dir()
    monkeypatch.delenv(KEEP_ENV)
    strategies[1].close()
    assert not (tmp_path / dirs[1]).exists()


@pytest.mark.slow
def test_swap_files_are_removed_when_the_process_exits(tmp_path):
    script = (
        "import sys, numpy as np, zerosim as zs\n"
        "from zerosim.nn import MLP\n"
        "cfg = {'train_micro_batch_size_per_gpu': 2, 'optimizer': {'type': 'Adam', 'params': {}},"
        " 'zero_optimization': {'stage': 2, 'offload_optimizer': {'device': 'nvme',"
        " 'nvme_path': sys.argv[1]}}}\n"
        "engine, *_ = zs.initialize(MLP([6, 9, 5, 4], seed=3), cfg)\n"
        "engine.backward(engine(np.ones((2, 6), np.float32), np.arange(2)))\n"
        "engine.step()\n"
        "print(len(list(engine.strategy.offload.optimizer_store.directory.iterdir())))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != KEEP_ENV}
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "3"  # master, exp_avg, exp_avg_sq existed during the run
    assert list(tmp_path.iterdir()) == []


MPI_SCRIPT = """
import os, sys
import numpy as np
import zerosim as zs
from zerosim.comm import MPIComm
from zerosim.nn import GPT

comm, root, out = MPIComm(), sys.argv[1], sys.argv[2]
lines = []


def run(opt, param, path):
    zero = {"stage": 3, "sub_group_size": 7, "stage3_param_persistence_threshold": 10,
            "offload_optimizer": {"device": opt, "nvme_path": path},
            "offload_param": {"device": param, "nvme_path": path}}
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
           "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "zero_optimization": zero}
    net = GPT(vocab_size=13, block_size=5, n_layer=2, n_head=2, n_embd=6, seed=3)
    engine, *_ = zs.initialize(net, cfg, comm=comm)
    rng = np.random.default_rng(1)
    for _ in range(3):
        x = rng.integers(0, 13, (2 * comm.size, 5))
        mine = slice(2 * comm.rank, 2 * comm.rank + 2)
        engine.backward(engine(x[mine], np.roll(x, -1, axis=1)[mine]))
        engine.step()
    return engine.full_state_dict()


base, nvme = run("none", "none", root), run("nvme", "nvme", root)
lines.append(f"parity {all(np.array_equal(base[k], nvme[k]) for k in base)}")
try:
    run("nvme", "none", root if comm.rank == 0 else os.path.join(root, "missing"))
except zs.ConfigError as err:
    lines.append(f"error {err}")
with open(os.path.join(out, f"rank{comm.rank}.txt"), "w") as f:  # ranks' stdout interleaves
    f.write("\\n".join(lines))
"""


@pytest.mark.mpi
@pytest.mark.slow
def test_nvme_offload_under_mpirun_matches_and_a_path_bad_on_one_rank_fails_everywhere(tmp_path):
    from mpi_helpers import run_mpi

    nvme, out = tmp_path / "nvme", tmp_path / "out"
    nvme.mkdir()
    out.mkdir()
    proc = run_mpi(2, ["-c", MPI_SCRIPT, str(nvme), str(out)], timeout=120)
    assert proc.returncode == 0, proc.stderr
    rank0, rank1 = ((out / f"rank{r}.txt").read_text().splitlines() for r in range(2))
    assert rank0[0] == rank1[0] == "parity True"
    allowed = "allowed: an existing directory every rank can write to"
    key = "zero_optimization.offload_optimizer.nvme_path"
    assert rank0[1] == f"error {key}: got '{nvme}', which fails on rank(s) [1]; {allowed}"
    assert rank1[1] == f"error {key}: got '{nvme / 'missing'}', which does not exist; {allowed}"
    assert list(nvme.iterdir()) == []  # both ranks removed their swap files at exit
