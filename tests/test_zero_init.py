"""zero.Init, GatheredParameters and save_16bit_model: a model built partitioned, read, saved.

The oracle for values is the ordinary build with the same seed (zero.Init must not change a
single bit); the oracle for memory is what the kernel and tracemalloc measure.
"""

import json
import logging
import tracemalloc

import numpy as np
import pytest
from mpi_helpers import run_mpi

import zerosim as zs
from zerosim.checkpoint import load_16bit_model
from zerosim.errors import ConfigError
from zerosim.zero import GatheredParameters, Init


def _cfg(stage=3, threshold=0, dtype="float64", **zero):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": threshold,
            "reduce_bucket_size": 500,
            **zero,
        },
        "zerosim": {"dtype": dtype},
    }


def _gpt(seed, dtype="float64"):
    return zs.nn.GPT(11, 8, 2, 2, 16, seed=seed, dtype=dtype)


def _train(engine, comm, steps=4):
    rng = np.random.default_rng(100 + comm.rank)
    for _ in range(steps):
        x, y = rng.integers(0, 11, (2, 8)), rng.integers(0, 11, (2, 8))
        engine.backward(engine(x, y))
        engine.step()
    return engine.full_state_dict()


def _inside_vs_outside(comm, threshold):
    cfg = _cfg(threshold=threshold)
    with Init(comm=comm, config=cfg) as init:
        inside = _gpt(seed=comm.rank)  # per-rank seeds: rank 0's values win, as in DeepSpeed
    engine, *_ = zs.initialize(inside, cfg, comm=comm)
    got = _train(engine, comm)
    engine, *_ = zs.initialize(_gpt(seed=0), cfg, comm=comm)
    want = _train(engine, comm)
    return got, want, init.partitioned


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("threshold", [0, 20])
def test_gpt_built_inside_init_trains_to_the_weights_of_an_ordinary_build(n, threshold):
    for got, want, partitioned in zs.LocalWorld(n).run(_inside_vs_outside, threshold):
        assert partitioned > 0
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_each_parameter_is_cut_to_its_chunk_as_its_module_creates_it():
    def fn(comm):
        with Init(comm=comm, config=_cfg(threshold=7, dtype="float32")):
            model = zs.nn.MLP([5, 4, 3], seed=0)
        whole = dict(zs.nn.MLP([5, 4, 3], seed=0).named_parameters())
        out = {}
        for name, p in model.named_parameters():
            out[name] = (p.data.size, p.partition and p.partition.chunk.copy(), whole[name].data)
        return out

    n = 3
    for rank, out in enumerate(zs.LocalWorld(n).run(fn)):
        for name, (size, chunk, full) in out.items():
            if full.size <= 7:  # persistent: stays whole
                assert chunk is None and size == full.size, name
                continue
            c = -(-full.size // n)  # ceil(numel / N), DeepSpeed's per-parameter chunk
            assert size == 0 and chunk.size == c, name
            piece = full.reshape(-1)[rank * c : (rank + 1) * c]
            np.testing.assert_array_equal(chunk[: piece.size], piece)
            assert not chunk[piece.size :].any()  # padding past the end is zero


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_initialize_refuses_a_model_built_inside_init_below_stage_3(stage):
    def fn(comm):
        with Init(comm=comm):
            model = zs.nn.MLP([4, 3, 2], seed=0)
        with pytest.raises(ConfigError, match=rf"zero_optimization.stage = {stage}: .*zero.Init"):
            zs.initialize(model, _cfg(stage=stage), comm=comm)

    zs.LocalWorld(2).run(fn)


def test_gathered_parameters_reads_and_the_modifier_ranks_changes_reach_every_chunk():
    def fn(comm):
        with Init(comm=comm):
            model = zs.nn.MLP([6, 5, 3], seed=0)
        weight = model.layers[0].weight
        seen = {}
        with GatheredParameters(weight):
            seen["read"] = weight.data.copy()
            weight.data[...] = comm.rank  # discarded: no modifier_rank
        with GatheredParameters([weight], modifier_rank=1):
            seen["kept"] = weight.data.copy()
            weight.data[...] = 10 + comm.rank  # only rank 1's survives
        assert weight.data.size == 0  # released again
        with GatheredParameters(weight, enabled=False):
            seen["disabled"] = weight.data.size
        with GatheredParameters(weight):
            seen["after"] = weight.data.copy()
        return seen

    want = zs.nn.MLP([6, 5, 3], seed=0).layers[0].weight.data
    for seen in zs.LocalWorld(3).run(fn):
        np.testing.assert_array_equal(seen["read"], want)
        np.testing.assert_array_equal(seen["kept"], want)
        assert seen["disabled"] == 0
        np.testing.assert_array_equal(seen["after"], np.full_like(want, 11))


def test_gathered_parameters_reads_a_stage_3_engines_weights_and_rejects_bad_ranks():
    def fn(comm):
        cfg = _cfg()
        engine, *_ = zs.initialize(_gpt(seed=0), cfg, comm=comm)
        full = _train(engine, comm, steps=2)
        p = engine.module.lm_head.weight
        with GatheredParameters(p):
            got = p.data.copy()
        with pytest.raises(ValueError, match="modifier_rank must be None or a rank in"):
            GatheredParameters(p, modifier_rank=comm.size)
        return got, full["lm_head.weight"]

    for got, want in zs.LocalWorld(2).run(fn):
        np.testing.assert_array_equal(got, want)


def _save(comm, tmp_path, stage, gather):
    cfg = _cfg(stage=stage, dtype="float32", stage3_gather_16bit_weights_on_model_save=gather)
    cfg["bf16"] = {"enabled": True}
    cfg["zerosim"] = {}
    engine, *_ = zs.initialize(zs.nn.MLP([8, 64, 64, 64, 4], seed=0), cfg, comm=comm)
    rng = np.random.default_rng(comm.rank)
    for _ in range(2):
        engine.backward(engine(rng.normal(size=(2, 8)), rng.integers(0, 4, 2)))
        engine.step()
    master = engine.full_state_dict()
    saved = engine.save_16bit_model(tmp_path / f"s{stage}")
    return saved, master


@pytest.mark.parametrize("stage", [2, 3])
def test_save_16bit_model_writes_the_bf16_weights_one_parameter_at_a_time(tmp_path, stage):
    results = zs.LocalWorld(3).run(_save, tmp_path, stage, True)
    assert all(saved for saved, _ in results)
    master = results[0][1]
    saved = load_16bit_model(tmp_path / f"s{stage}" / "zerosim_model.npz")
    assert sorted(saved) == sorted(master)
    for name, want in master.items():
        assert saved[name].dtype.name == "bfloat16"
        # the bf16 weights are the fp32 master rounded to nearest
        np.testing.assert_array_equal(saved[name], want.astype(saved[name].dtype))


def test_save_16bit_model_at_stage_3_needs_the_gather_switch_as_in_deepspeed(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="zerosim.engine"):
        results = zs.LocalWorld(2).run(_save, tmp_path, 3, False)
    assert [saved for saved, _ in results] == [False, False]
    assert not (tmp_path / "s3").exists()
    assert "stage3_gather_16bit_weights_on_model_save is false" in caplog.text


def test_save_16bit_model_holds_a_parameter_or_so_not_the_model(tmp_path):
    """The gathered parameter, the communicator's copy of it and the writer's: 3 parameters at
    most, where the model is 16."""
    sizes = [256] * 17  # 16 layers of 256 x 256

    def fn(comm, out):
        cfg = _cfg(dtype="float32", stage3_gather_16bit_weights_on_model_save=True)
        engine, *_ = zs.initialize(zs.nn.MLP(sizes, seed=0), cfg, comm=comm)
        tracemalloc.start()
        try:
            engine.save_16bit_model(out)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        return peak

    (peak,) = zs.LocalWorld(1).run(fn, tmp_path)
    largest, model = 256 * 256 * 4, 16 * (256 * 256 + 256) * 4
    assert peak <= 3 * largest + 2**18 < model / 3


@pytest.mark.mpi
@pytest.mark.slow
def test_a_model_larger_than_the_os_memory_cap_trains_at_stage_3_only_inside_init():
    """8 ranks, each capped by RLIMIT_DATA at start-up + 120 MiB; the MLP's fp32 weights are
    128 MiB. Outside zero.Init the build fails with MemoryError on every rank; inside, each rank
    holds 1/8 and trains (SGD: 8Ψ/N bytes of parameters and gradients, plus buffers)."""
    common = ["tests/helpers/zero_init_worker.py", "--layers", "32", "--margin-mib", "120"]
    common += ["--optimizer", "SGD", "--steps", "2"]
    outside = run_mpi(8, common, timeout=240)
    assert outside.returncode != 0
    rows = [json.loads(line) for line in outside.stdout.splitlines() if line.startswith("{")]
    assert rows and all("MemoryError" in r["error"] for r in rows)
    assert all(r["fp32_model_bytes"] > r["allowance"] for r in rows)

    inside = run_mpi(8, [*common, "--inside"], timeout=400)
    assert inside.returncode == 0, inside.stderr[-3000:]
    rows = [json.loads(line) for line in inside.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in rows) == list(range(8))
    largest = 1024 * 1024 * 4
    for r in rows:
        assert r["fp32_model_bytes"] > r["allowance"]
        assert all(np.isfinite(r["losses"]))
        shard = r["padded_numel"] // 8 * 4
        # construction: this rank's chunks plus creating one parameter (float64 draw + cast)
        assert r["build_peak"] <= shard + 3 * largest + 2**20
        # the counted categories add up to `held`: params + grads (SGD keeps no state) + buckets
        report = r["report"]
        assert r["held"] == sum(v for k, v in report.items() if not k.startswith("peak_"))
        assert report["params"] == report["grads"] == shard
        # measured (tracemalloc) against counted: held + one gathered parameter + its full-size
        # gradient before it is packed into a bucket, within 4 MiB of activations and the like
        counted = r["held"] + report["peak_gathered_params"] + largest
        assert r["held"] <= r["train_peak"] <= counted + 4 * 2**20


@pytest.mark.mpi
def test_the_zero_init_example_runs_under_mpirun():
    proc = run_mpi(2, ["examples/tie_weights_in_zero_init.py"], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(line.split()[-1]) for line in proc.stdout.splitlines() if "loss" in line]
    assert len(losses) == 4 and losses[-1] < losses[0]
