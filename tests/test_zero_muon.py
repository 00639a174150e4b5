"""Muon under ZeRO stages 0-3 equals its single-process oracle (tests/helpers/zero_muon_cases.py),
in one process (LocalWorld) and under a real mpirun; what splitting a matrix costs, counted."""

from __future__ import annotations

import math

import engine_cases
import numpy as np
import pytest
import zero_muon_cases
from engine_cases import Case
from mpi_helpers import run_mpi

import zerosim as zs


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize(
    "variant", zero_muon_cases.VARIANTS, ids=[str(v) for v in zero_muon_cases.VARIANTS]
)
def test_muon_at_every_stage_equals_the_single_process_run(n, variant):
    case = Case(optimizer="muon", steps=4, **variant)
    zs.LocalWorld(n).run(zero_muon_cases.check_muon, case)


@pytest.mark.parametrize("stage", [1, 2])
def test_split_matrices_reach_every_owner_when_slices_are_reduced_to_one(stage):
    """use_multi_rank_bucket_allreduce false: each owner's slices are reduced to it, but a
    split Muon matrix's slices are all-reduced, so each of its owners orthogonalizes it."""
    case = Case(optimizer="muon", steps=3, stage=stage, model="gpt", accumulation=2)
    zs.LocalWorld(3).run(zero_muon_cases.check_muon, case, use_multi_rank_bucket_allreduce=False)


def test_the_stage_0_oracle_differs_from_the_zero_oracle_when_clipping_bites():
    """DeepSpeed clips raw gradients at stage 0 and Muon's updates under ZeRO: with a small
    gradient_clipping the two runs really part (so the cases above tell them apart)."""
    case = Case(optimizer="muon", steps=3, model="mlp", clip=0.05)
    zero0 = zero_muon_cases.reference(case.with_(stage=0), 2)
    zero2 = zero_muon_cases.reference(case.with_(stage=2), 2)
    assert engine_cases.max_rel_error(zero0, zero2) > 1e-3


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_muon_at_every_stage_equals_the_single_process_run_under_mpirun(n):
    proc = run_mpi(n, ["tests/helpers/zero_muon_cases.py"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("OK rank") == n


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_a_muon_run_resumed_from_its_checkpoint_equals_the_uninterrupted_run(
    tmp_path, stage, dtype
):
    """Saved after step 2 and resumed by a fresh engine on the same world: bit for bit, so the
    momentum (and the auxiliary Adam's state) came back exactly (bf16: saved in fp32)."""
    case = Case(optimizer="muon", steps=4, stage=stage, model="gpt", dtype=dtype)
    world = zs.LocalWorld(2)
    whole = world.run(zero_muon_cases.save_after, case, 2, str(tmp_path))[0]
    resumed = world.run(zero_muon_cases.resume_from, case, 2, str(tmp_path))[0]
    for name, want in whole.items():
        np.testing.assert_array_equal(resumed[name], want, err_msg=name)


@pytest.mark.parametrize(("saved", "resumed"), [(1, 3), (2, 1), (3, 0), (0, 2)])
def test_a_muon_checkpoint_resumes_on_another_world_size_and_stage(tmp_path, saved, resumed):
    """N = 2 at one stage saves after step 2; N = 3 at another resumes (the same global batch
    of 6): the single-process run's weights."""
    case = Case(optimizer="muon", steps=4, stage=saved, model="mlp", micro=3, accumulation=2)
    zs.LocalWorld(2).run(zero_muon_cases.save_after, case, 2, str(tmp_path))
    later = case.with_(stage=resumed, micro=2)
    got = zs.LocalWorld(3).run(zero_muon_cases.resume_from, later, 2, str(tmp_path))[0]
    assert engine_cases.max_rel_error(got, zero_muon_cases.reference(case, 2)) <= 1e-6


# (stage, offload) saved by N = 2, (stage, offload) resumed by N = 3
OFFLOAD_RESUMES = [
    ((2, "cpu"), (1, "none")),
    ((1, "none"), (2, "cpu")),
    ((3, "nvme"), (2, "cpu")),
    ((2, "cpu"), (3, "nvme")),
]


@pytest.mark.parametrize(("saved", "resumed"), OFFLOAD_RESUMES, ids=str)
def test_a_muon_checkpoint_resumes_with_and_without_offload(tmp_path, saved, resumed):
    """Offload keeps the momentum of the owned slices (stages 1-2) or chunks, in host memory or
    a swap file: a checkpoint of either resumes on another N, stage and offload to the
    single-process run's weights, and with the momentum gathered from the first resumed step."""

    def zero(offload):
        return {"offload_optimizer": {"device": offload, "nvme_path": str(tmp_path)}}

    case = Case(optimizer="muon", steps=4, stage=saved[0], model="mlp", micro=3, accumulation=2)
    zs.LocalWorld(2).run(zero_muon_cases.save_after, case, 2, str(tmp_path), **zero(saved[1]))
    later = case.with_(stage=resumed[0], micro=2)
    got = zs.LocalWorld(3).run(
        zero_muon_cases.resume_from, later, 2, str(tmp_path), **zero(resumed[1])
    )[0]
    assert engine_cases.max_rel_error(got, zero_muon_cases.reference(case, 2)) <= 1e-6


@pytest.mark.mpi
def test_a_muon_checkpoint_saved_by_2_ranks_resumes_on_3_under_mpirun(tmp_path):
    """mpirun -n 2 (stage 2) saves after step 2; mpirun -n 3 (stage 3) resumes: the
    single-process run's weights (checked in the job)."""
    proc = run_mpi(2, ["tests/helpers/zero_muon_cases.py", "save", str(tmp_path)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("OK rank") == 2
    proc = run_mpi(3, ["tests/helpers/zero_muon_cases.py", "resume", str(tmp_path)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("OK rank") == 3


def expected_muon_memory(case: Case, n: int, rank: int) -> tuple[int, int]:
    """(momentum bytes, copied-gradient bytes) of ``rank``, from the shapes alone: stage 0 every
    matrix; stages 1-2 every matrix overlapping the rank's partition of the Muon group's flat
    buffer (matrices sorted by shape, padded to 2N, P = Ψ_pad/N), whole (DeepSpeed's momentum
    buffer is Σ numel of the partition's parameters), plus the whole gradient of each split one;
    stage 3 the rank's chunks ⌈numel/N⌉."""
    named = engine_cases.build_model(case).named_parameters()
    shapes = sorted(
        (tuple(p.shape) for name, p in named if p.ndim == 2 and "lm_head" not in name),
        reverse=True,
    )
    numels = [math.prod(s) for s in shapes]
    b = np.dtype(case.dtype).itemsize
    if case.stage == 0:
        return sum(numels) * b, 0
    if case.stage == 3:
        return sum(-(-m // n) for m in numels) * b, 0
    total = sum(numels)
    part = -(-total // (2 * n)) * 2 * n // n
    momentum = copies = start = 0
    for m in numels:
        touched = range(start // part, -(-(start + m) // part))
        if rank in touched:
            momentum += m * b
            copies += m * b if len(touched) > 1 else 0
        start += m
    return momentum, copies


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_the_momentum_is_kept_whole_on_every_owner_at_stages_1_2_and_partitioned_at_3(stage, model):
    case = Case(optimizer="muon", steps=1, stage=stage, model=model)
    out = zs.LocalWorld(3).run(zero_muon_cases.train, case)
    for rank in range(3):
        mem = out[rank]["memory"]
        want = expected_muon_memory(case, 3, rank)
        assert (mem["optimizer_state.momentum_buffer"], mem["muon_gradient_copies"]) == want


def _fp16_weights(comm, case: Case, loss_scale: float, offload: str = "none") -> dict:
    from zerosim.engine import initialize

    cfg = zero_muon_cases.config(case, offload_optimizer={"device": offload})
    cfg["fp16"] = {"enabled": True, "loss_scale": loss_scale}
    engine, *_ = initialize(engine_cases.build_model(case), cfg, comm=comm)
    zero_muon_cases.run_steps(engine, comm, case, range(case.steps))
    assert engine.skipped_steps == 0
    return engine.full_state_dict()


@pytest.mark.parametrize("offload", ["none", "cpu"])
@pytest.mark.parametrize("scale", [2.0**4, 2.0**12])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_muon_updates_are_not_unscaled_as_gradients_are(stage, scale, offload):
    """Newton–Schulz gives the same update at any loss scale, so the update carries none
    (DeepSpeed's "lacks loss scale"). fp16 at static scales 2⁴ and 2¹² against the float64
    single-process oracle: within lr/8 (measured 5.5e-4 at both). Unscaling the updates as
    gradients would shrink Muon's steps by the scale (measured 0.037 and 0.040); scaling them
    in fp16 would overflow (every step skipped: the helper asserts none is). Under optimizer
    offload the gradients are unscaled before they enter the momentum (DeepSpeed's path
    there): a momentum of scaled gradients would be off by the scale after a step."""
    case = Case(optimizer="muon", steps=3, stage=stage, model="mlp", dtype="float16")
    got = zs.LocalWorld(2).run(_fp16_weights, case, scale, offload)[0]
    want = zero_muon_cases.reference(case.with_(dtype="float64"), 2)
    for name, w in want.items():
        np.testing.assert_allclose(got[name], w, rtol=0, atol=zero_muon_cases.LR / 8, err_msg=name)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_muon_on_n_ranks_stays_near_the_single_process_run(dtype, stage, n):
    """N ranks against one rank on the same global batches. The 16-bit sum over ranks rounds
    otherwise, and Newton–Schulz turns rounding in a gradient's null space into O(1) update
    components, so the bound is loose: 2 lr (weights move by lr a step); measured worst: fp16
    8.6e-4, bf16 7.8e-3 with this model's rank-deficient gradients."""
    case = Case(optimizer="muon", steps=4, stage=stage, model="mlp", dtype=dtype)
    got = zs.LocalWorld(n).run(zero_muon_cases.train, case)[0]["params"]
    one = zs.LocalWorld(1).run(zero_muon_cases.train, case.with_(micro=n * case.micro))
    for name, want in one[0]["params"].items():
        diff = np.abs(got[name].astype(np.float64) - want.astype(np.float64)).max()
        assert diff <= 2 * zero_muon_cases.LR, (name, diff)


# ZeRO++ at stage 3 (hpZ, qwZ): DeepSpeed's Muon gathers (``_partitioned_buffers_all_gather``,
# ``_muon_update_sub_group``) run over each parameter's ``ds_process_group``, the whole
# data-parallel group, in ``communication_data_type``: hpZ's secondary group and qwZ's int8
# codes are used only by the weights' gathers (partition_parameters.py). So hpZ trains exactly
# the single-process run, and Muon's phase sends what it sends without ZeRO++.
ZEROPP_MUON = [
    (4, {"zero_hpz_partition_size": 2}),
    (3, {"zero_hpz_partition_size": 3}),
    (3, {"zero_quantized_weights": True}),
    (4, {"zero_quantized_weights": True, "zero_hpz_partition_size": 2}),
]


@pytest.mark.parametrize("n,zero", ZEROPP_MUON, ids=[f"{n}-{z}" for n, z in ZEROPP_MUON])
def test_muon_with_zeropp_weight_gathers_at_stage_3(n, zero):
    from test_analysis_whole_params import formula_kwargs, model_layout

    from zerosim.analysis.whole_params import muon_step_bytes

    case = Case(optimizer="muon", steps=3, stage=3, model="gpt", clip=0.5, sub_group_size=40,
                accumulation=2)  # fmt: skip
    runs = zs.LocalWorld(n).run(zero_muon_cases.train, case, **zero)
    err = engine_cases.max_rel_error(runs[0]["params"], zero_muon_cases.reference(case, n))
    if zero.get("zero_quantized_weights"):
        # qwZ: forward and backward run on int8 block-quantized weights (relative rounding
        # error up to 1/254 of a block's largest value; under DeepSpeed's schedule the backward
        # gather is quantized again, so twice that), so the gradients, and the steps taken on
        # them, differ; not by more than a few steps of that rounding (measured 0.026 at N = 3
        # and 0.030 with hpZ at N = 4; below 1e-2 while only the forward gather was quantized).
        assert 1e-9 < err < 5e-2, err
    else:
        assert err <= 1e-6, err
    shapes, is_muon = model_layout(case)
    for rank in range(n):
        want = muon_step_bytes(3, shapes, is_muon, n, rank, 8, **formula_kwargs(case, {}))
        for step in runs[rank]["bytes"]:
            assert step["muon"] == want["muon"] > 0, (rank, step, want)
            assert step["clip"] == want["clip"], (rank, step, want)


# Optimizer offload: DeepSpeed's other Muon path (zerosim/zero/muon_offload.py): every rank
# gathers every rank's owned slices of the gradients and momentums and orthogonalizes every
# matrix. The oracle is the same single-process run; the bytes are muon_offload_bytes'.
OFFLOAD_VARIANTS = [
    dict(stage=1, model="mlp"),
    dict(stage=2, model="gpt", clip=0.5, accumulation=2),
    dict(stage=3, model="gpt", clip=0.5, sub_group_size=40),
]


def muon_numels(case: Case) -> list[int]:
    """The Muon group's matrices' sizes in DeepSpeed's flat order (``muon_layout``)."""
    from test_analysis_whole_params import model_layout

    from zerosim.analysis.whole_params import muon_layout

    shapes, is_muon = model_layout(case)
    return [math.prod(shapes[i]) for i in muon_layout(shapes, is_muon) if is_muon[i]]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("cap", [None, 600], ids=["64MiB", "600B"])
@pytest.mark.parametrize("variant", OFFLOAD_VARIANTS, ids=[str(v) for v in OFFLOAD_VARIANTS])
def test_muon_with_cpu_offload_equals_the_single_process_run(variant, cap, n, monkeypatch):
    """Weights within 1e-6 of the oracle; each step's ``muon`` bytes equal the closed form
    (stages 1-2: the gradient alone in the first step). ``cap`` 600 bytes in place of
    DeepSpeed's 64 MiB gather cap (the code's and the formula's): stages 1-2 then gather each
    matrix alone, in chunks of a few elements."""
    from zerosim.analysis import whole_params
    from zerosim.analysis.whole_params import muon_offload_bytes
    from zerosim.zero import muon_offload

    if cap is not None:
        monkeypatch.setattr(muon_offload, "BATCH_BYTES", cap)
        monkeypatch.setattr(whole_params, "MUON_GATHER_BYTES", cap)
    case = Case(optimizer="muon", steps=3, **variant)
    runs = zs.LocalWorld(n).run(zero_muon_cases.train, case, offload_optimizer={"device": "cpu"})
    err = engine_cases.max_rel_error(runs[0]["params"], zero_muon_cases.reference(case, n))
    assert err <= 1e-6, err
    numels = muon_numels(case)
    for rank in range(n):
        for step, got in enumerate(runs[rank]["bytes"]):
            kwargs = dict(first_step=step == 0, sub_group_size=case.sub_group_size)
            want = muon_offload_bytes(case.stage, numels, n, 8, **kwargs)
            assert got["muon"] == want > 0, (rank, step, got, want)
        mem = runs[rank]["memory"]
        assert mem["muon_gradient_copies"] == 0
        assert mem["optimizer_state.momentum_buffer"] == 8 * _owned_muon(case, numels, n, rank)


def _owned_muon(case: Case, numels: list[int], n: int, rank: int) -> int:
    """Elements of the Muon matrices whose momentum ``rank`` keeps under offload: stages 1-2
    its partition [r·P, (r+1)·P) of the group's flat buffer (padded to 2N); stage 3 its
    chunks."""
    if case.stage == 3:
        return sum(-(-m // n) for m in numels)
    total = sum(numels)
    part = -(-total // (2 * n)) * 2
    return max(0, min(total, (rank + 1) * part) - rank * part)


def _nvme_run(comm, case: Case, path: str, in_memory: bool) -> dict:
    from zerosim.engine import initialize
    from zerosim.zero.offload import file_backed

    zero = {
        "offload_optimizer": {"device": "nvme", "nvme_path": path},
        "save_muon_momentum_buffer_in_memory": in_memory,
    }
    engine, *_ = initialize(
        engine_cases.build_model(case), zero_muon_cases.config(case, **zero), comm=comm
    )
    zero_muon_cases.run_steps(engine, comm, case, range(case.steps))
    muon = engine.strategy.muon
    store = engine.strategy.offload.optimizer_store
    return {
        "params": engine.full_state_dict(),
        "in_files": [file_backed(m) for m in muon.momentum3.values()],
        "momentum": sum(m.nbytes for m in muon.momentum3.values()),
        "read": store.bytes_read,
        "written": store.bytes_written,
        "placement": engine.strategy.placement(),
    }


@pytest.mark.parametrize("n", [2, 3])
def test_muon_with_nvme_offload_swaps_its_momentum_unless_kept_in_memory(tmp_path, n):
    """Stage 3, nvme: the momentum lives in a swap file, read and written once a step, unless
    ``save_muon_momentum_buffer_in_memory`` keeps it in host memory; weights as the oracle's
    either way."""
    case = Case(optimizer="muon", steps=3, stage=3, model="gpt", sub_group_size=40)
    want = zero_muon_cases.reference(case, n)
    runs = {}
    for in_memory in (False, True):
        path = tmp_path / str(in_memory)
        path.mkdir()
        runs[in_memory] = zs.LocalWorld(n).run(_nvme_run, case, str(path), in_memory)
        assert engine_cases.max_rel_error(runs[in_memory][0]["params"], want) <= 1e-6
    for rank in range(n):
        swapped, kept = runs[False][rank], runs[True][rank]
        assert all(swapped["in_files"]) and not any(kept["in_files"])
        momentum = 8 * sum(-(-m // n) for m in muon_numels(case))
        assert swapped["momentum"] == kept["momentum"] == momentum
        assert swapped["read"] - kept["read"] == case.steps * momentum
        assert swapped["written"] - kept["written"] == case.steps * momentum
        moved = swapped["placement"]["nvme_bytes"] - kept["placement"]["nvme_bytes"]
        assert moved == kept["placement"]["host_bytes"] - swapped["placement"]["host_bytes"]
        assert moved == momentum


PARAM_OFFLOADS = [("cpu", "none"), ("nvme", "cpu"), ("nvme", "nvme")]  # (param, optimizer)


@pytest.mark.parametrize(("param", "optimizer"), PARAM_OFFLOADS)
def test_muon_at_stage_3_with_parameter_offload_equals_the_single_process_run(
    tmp_path, param, optimizer
):
    """offload_param moves the weights' shards (host memory, a swap file read before each
    gather); Muon's updates are made from the gradients, so the weights are the oracle's."""
    case = Case(optimizer="muon", steps=3, stage=3, model="gpt", clip=0.5)
    zero = {
        "offload_param": {"device": param, "nvme_path": str(tmp_path)},
        "offload_optimizer": {"device": optimizer, "nvme_path": str(tmp_path)},
    }
    runs = zs.LocalWorld(2).run(zero_muon_cases.train, case, **zero)
    assert engine_cases.max_rel_error(runs[0]["params"], zero_muon_cases.reference(case, 2)) <= 1e-6
