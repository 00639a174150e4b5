"""The engine on Array API standard arrays held on a non-host device (array_api_strict's
``Device("device1")``): every stage trains to the NumPy run's weights, and nothing crosses to
the host but what must.

array_api_strict arrays refuse to mix with NumPy arrays and refuse ``numpy.asarray``, exactly as
GPU arrays do, and they have none of NumPy's methods: a full training step that runs on them
proves the hot path calls no NumPy-only function. The crossings the backend counts then show
that the only data moved between host and device in a step are the batch (in) and a few
scalars (out: the loss, the gradient norm), unless offload puts the optimizer on the host.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

pytest.importorskip(
    "array_api_strict",
    reason="array-api-strict (the stand-in device) is in the test extra",
)

import engine_cases  # noqa: E402
from engine_cases import Case, data, train_on  # noqa: E402
from mpi_helpers import run_mpi  # noqa: E402

import zerosim as zs  # noqa: E402
from zerosim.backend import StandardNamespace, from_host, get_backend, to_host, xp_of  # noqa: E402
from zerosim.config import load_config  # noqa: E402
from zerosim.errors import ConfigError  # noqa: E402

STRICT = {"zerosim": {"backend": "array_api_strict"}}

# (case, extra config): every stage, both layouts, accumulation, clipping, the paper's schedule,
# float32, optimizer offload and parameter offload.
VARIANTS = [
    (Case(stage=0, model="gpt", accumulation=2, clip=0.5), {}),
    (Case(stage=1, model="mlp", optimizer="sgd"), {}),
    (Case(stage=1, model="gpt", layout="megatron", clip=1.0), {}),
    (Case(stage=2, model="gpt", accumulation=3, clip=0.05), {}),
    (Case(stage=2, model="mlp", overlap=False, schedule="paper"), {}),
    (Case(stage=1, model="mlp", dtype="float32", layout="megatron"), {}),
    (Case(stage=3, model="gpt", accumulation=2, clip=0.5), {}),
    (Case(stage=3, model="mlp", persistence=40, overlap=False, reuse=10**9), {}),
    (Case(stage=2, model="mlp"), {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}),
    (
        Case(stage=3, model="gpt"),
        {
            "zero_optimization": {
                "offload_optimizer": {"device": "cpu"},
                "offload_param": {"device": "cpu"},
            }
        },
    ),
]


def _name(variant) -> str:
    case, extra = variant
    offload = "-offload" if extra else ""
    return f"s{case.stage}-{case.model}-{case.layout}-k{case.accumulation}-{case.dtype}{offload}"


def _merge(extra: dict) -> dict:
    merged = {**extra}
    merged["zerosim"] = {**extra.get("zerosim", {}), "backend": "array_api_strict"}
    return merged


def _both(comm, case: Case, extra: dict, save_to=None) -> dict:
    case = case.with_(steps=4)
    numpy_run = train_on(comm, case, extra, save_to and f"{save_to}/numpy")
    strict_run = train_on(comm, case.with_(backend="array_api_strict"), extra,
                          save_to and f"{save_to}/strict")  # fmt: skip
    return {"numpy": numpy_run, "strict": strict_run}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


@pytest.mark.parametrize("variant", VARIANTS, ids=_name)
def test_every_stage_trains_on_a_non_host_device_to_the_numpy_weights(variant):
    case, extra = variant
    runs = zs.LocalWorld(2).run(_both, case, extra)
    for out in runs:
        numpy_run, strict_run = out["numpy"], out["strict"]
        assert strict_run["devices"] == {"array_api_strict.Device('device1')"}
        assert numpy_run["devices"] == {"cpu"}
        tol = 1e-12 if case.dtype == "float64" else 1e-6
        assert _max_diff(strict_run["params"], numpy_run["params"]) <= tol
        # the same collectives, byte for byte: the device run sends what the host run sends
        assert strict_run["bytes"] == numpy_run["bytes"]
        # nothing crosses in the NumPy run; in the device run, each micro-step's batch goes
        # in (x and y: two crossings, their bytes) and no array-sized data comes out unless
        # the optimizer is offloaded
        assert numpy_run["crossings"] == dict.fromkeys(numpy_run["crossings"], 0)
        moved = strict_run["crossings"]
        micro_steps = case.accumulation * strict_run["steps"]
        x, y = data(case, 2)
        batch_bytes = (x[: case.micro].nbytes + y[: case.micro].nbytes) * micro_steps
        offloaded = bool(extra)
        if not offloaded:
            assert moved["from_host_calls"] == 2 * micro_steps
            assert moved["from_host_bytes"] == batch_bytes
            assert moved["to_host_bytes"] <= 64 * moved["to_host_calls"]  # scalars only
        else:  # the step runs in host memory: gradients out, updated parameters back in
            assert moved["from_host_bytes"] > batch_bytes
            assert moved["to_host_bytes"] > 64 * moved["to_host_calls"] // 2


def test_checkpoint_saved_and_loaded_on_the_device_resumes_to_the_numpy_weights(tmp_path):
    for case in (Case(stage=2, model="gpt", accumulation=2), Case(stage=3, model="mlp")):
        runs = zs.LocalWorld(2).run(_both, case, {}, str(tmp_path / f"s{case.stage}"))
        for out in runs:
            assert _max_diff(out["strict"]["params"], out["numpy"]["params"]) <= 1e-12
        # and the resumed run equals the uninterrupted one
        straight = zs.LocalWorld(2).run(train_on, case.with_(steps=4, backend="array_api_strict"))
        assert _max_diff(runs[0]["strict"]["params"], straight[0]["params"]) <= 1e-12


def test_odd_world_size_on_the_device():
    case = Case(stage=3, model="gpt", accumulation=2, clip=0.5)
    for out in zs.LocalWorld(3).run(_both, case, {}):
        assert _max_diff(out["strict"]["params"], out["numpy"]["params"]) <= 1e-12


@pytest.mark.parametrize(
    "case, extra",
    [
        (Case(stage=3, model="mlp"), {"zero_optimization": {"zero_quantized_weights": True}}),
        (Case(stage=3, model="mlp"), {"zero_optimization": {"zero_quantized_gradients": True}}),
        (Case(stage=3, model="gpt"), {"zero_optimization": {"zero_hpz_partition_size": 2}}),
        (Case(stage=2, model="gpt", collectives="ring"), {}),
        (Case(stage=3, model="gpt", collectives="ring", accumulation=2), {}),
    ],
    ids=["qwZ", "qgZ", "hpZ", "ring-s2", "ring-s3"],
)
def test_zeropp_and_ring_collectives_on_the_device_at_four_ranks(case, extra):
    """Four ranks: small parameters leave some ranks a chunk of padding only."""
    for out in zs.LocalWorld(4).run(_both, case, extra):
        assert _max_diff(out["strict"]["params"], out["numpy"]["params"]) <= 1e-12
        assert out["strict"]["bytes"] == out["numpy"]["bytes"]


@pytest.mark.mpi
def test_every_stage_on_the_device_under_mpirun_2():
    proc = run_mpi(2, ["tests/helpers/mpi_worker.py", "array_api_parity"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the ranks share one stdout: their lines may run together
    results = re.findall(r"OK rank (\d+) result ([0-9.e+-]+)", proc.stdout)
    assert sorted(rank for rank, _ in results) == ["0", "1"], proc.stdout
    for _, worst in results:
        assert float(worst) <= 1e-12, results


def test_the_device_namespace_refuses_host_data_mixed_into_its_compute():
    """The device namespace really refuses host data: the stand-in for a GPU is not NumPy."""
    xp = get_backend("array_api_strict").xp
    assert isinstance(xp, StandardNamespace)
    a = from_host(np.ones(3), xp=xp)
    with pytest.raises((TypeError, ValueError)):
        a + np.ones(3)  # noqa: B018
    with pytest.raises(RuntimeError):
        np.asarray(a)
    with pytest.raises(TypeError, match="from_host"):
        xp.asarray(np.ones(3))
    assert xp_of(a) is xp
    np.testing.assert_array_equal(to_host(a), np.ones(3))


@pytest.mark.parametrize(
    "section",
    [{"fp16": {"enabled": True}}, {"bf16": {"enabled": True}}, {"communication_data_type": "bf16"}],
)
def test_16_bit_training_on_array_api_strict_is_refused_naming_the_backend(section):
    cfg = {"train_micro_batch_size_per_gpu": 1, **section}
    cfg["zerosim"] = {**cfg.get("zerosim", {}), "backend": "array_api_strict"}
    with pytest.raises(ConfigError, match="zerosim.backend.*16-bit"):
        load_config(cfg, 2)


def test_cupy_backend_is_accepted_by_the_config_and_named_when_no_gpu():
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "zerosim": {"backend": "cupy"}}, 1)
    assert cfg.zerosim.backend == "cupy"
    from zerosim.backend import gpu_available

    if gpu_available():
        pytest.skip("a GPU is visible: the engine runs on it (tests/test_gpu.py)")
    model = engine_cases.build_model(Case())
    before = {n: p.data.copy() for n, p in model.named_parameters()}
    cfg = {"train_micro_batch_size_per_gpu": 1, "zerosim": {"backend": "cupy"}}
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    with pytest.raises(RuntimeError, match="'cupy' was requested but"):
        zs.initialize(model, cfg, comm=zs.LocalWorld(1).comms()[0])
    for n, p in model.named_parameters():  # refused before anything changed
        assert p.data.dtype == before[n].dtype and np.array_equal(p.data, before[n])


def test_initialize_moves_each_weight_across_once_and_counts_it():
    """engine.crossings(): the model's arrays cross once each at initialize (their bytes, in the
    model dtype), a step adds its batch in and scalars out; numpy counts nothing."""
    case = Case(stage=2, model="gpt")
    cfg = engine_cases.config(case.with_(backend="array_api_strict"))

    def run(comm):
        model = engine_cases.build_model(case)
        arrays = [p.data for p in model.parameters()] + [b for _, b in model.named_buffers()]
        engine, *_ = zs.initialize(model, cfg, comm=comm)
        at_start = engine.crossings()
        x, y = data(case, comm.size)
        engine.backward(engine(x[: case.micro], y[: case.micro]))
        engine.step()
        return at_start, engine.crossings(), arrays, (x[: case.micro], y[: case.micro])

    for at_start, after, arrays, batch in zs.LocalWorld(2).run(run):
        assert at_start["from_host_calls"] == len(arrays)
        assert at_start["from_host_bytes"] == sum(a.nbytes for a in arrays)
        assert at_start["to_host_bytes"] == 0
        step = {k: after[k] - at_start[k] for k in after}
        assert step["from_host_calls"] == 2
        assert step["from_host_bytes"] == sum(a.nbytes for a in batch)
        # scalars only: the loss, the norm, the embedding's id bounds, the target count
        assert 0 < step["to_host_calls"] and step["to_host_bytes"] <= 16 * step["to_host_calls"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradients_reduced_in_another_dtype_on_the_device(stage):
    """communication_data_type fp32 under a float64 model: the gradients are rounded into
    float32 wire buffers and back, which the standard's assignment does not do by itself."""
    case, extra = Case(stage=stage, model="mlp"), {"communication_data_type": "fp32"}

    def run(comm):
        out = _both(comm, case, extra)
        wire = {r.dtype for r in comm.ledger.records if r.phase == "backward"}
        return out, wire

    for out, wire in zs.LocalWorld(2).run(run):
        assert "float32" in wire
        assert _max_diff(out["strict"]["params"], out["numpy"]["params"]) <= 1e-12
