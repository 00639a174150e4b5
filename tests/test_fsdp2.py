"""PyTorch FSDP2's schedule (``zerosim.schedule: "fsdp2"``, zero/stage3_fsdp2.py) on LocalWorld and
under mpirun: the one-process run's weights, the collectives of each step against closed forms
written here from the model's parameter shapes, and the config's refusals."""

import math

import numpy as np
import pytest
from engine_cases import Case, build_model, config, data, max_rel_error, optimizer_step, reference
from mpi_helpers import run_mpi

import zerosim as zs
from zerosim.config import load_config
from zerosim.engine import initialize
from zerosim.errors import ConfigError

BF16 = np.dtype(zs.backend.DTYPES["bfloat16"])


def fsdp2_config(case: Case, **fsdp2) -> dict:
    cfg = config(case.with_(stage=3, schedule="fsdp2"))
    cfg["zerosim"]["fsdp2"] = fsdp2
    return cfg


def train_fsdp2(comm, case: Case, fsdp2: dict) -> dict:
    """Train ``case`` under FSDP2's schedule; each step's collectives (op, dtype, bytes)."""
    model = build_model(case)
    engine, *_ = initialize(model, fsdp2_config(case, **fsdp2), comm=comm)
    x, y = data(case, comm.size)
    steps = []
    for s in range(case.steps):
        comm.ledger.reset()
        optimizer_step(engine, comm, case, x, y, s)
        steps.append(
            [
                (r.op, r.phase, np.dtype(r.dtype).name, r.bytes_sent)
                for r in comm.ledger.records
                if r.phase in ("forward", "backward")
            ]
        )
    return {
        "params": engine.full_state_dict(),
        "steps": steps,
        "memory": engine.memory_report(),
        "shard_dtype": engine.strategy.groups[0].flat_param.dtype,
        "master": engine.strategy.groups[0].master,
    }


# -- the FSDP modules and their all-gather inputs, from the model's shapes -------------------------
def unit_shapes(case: Case) -> list[list[tuple[int, ...]]]:
    """Each unit's parameter shapes as a torch user shards them: every block (GPT: blocks.i;
    MLP: each Linear of layers), then the root with the rest."""
    model = build_model(case)
    names = [(n, p.shape) for n, p in model.named_parameters()]
    prefix = "blocks." if case.model == "gpt" else "layers."
    blocks: dict[str, list] = {}
    root = []
    for name, shape in names:
        if name.startswith(prefix):
            blocks.setdefault(name.split(".")[1], []).append(shape)
        else:
            root.append(shape)
    return [*blocks.values(), root]


def shard_elements(shapes: list[tuple[int, ...]], n: int) -> int:
    """S_u: ceil(dim0 / N) rows of each parameter, end to end (torch.chunk on dim 0, padded)."""
    return sum(math.ceil(s[0] / n) * math.prod(s[1:]) for s in shapes)


def expected_collectives(case: Case, n: int, b_p: int, b_r: int, p_dtype, r_dtype, raf, rab):
    """One step's forward/backward collectives as torch 2.13's FSDP2 issues them, in order."""
    units = [shard_elements(s, n) for s in unit_shapes(case)]
    units = [u for u in units if u]  # a root without parameters gathers nothing
    blocks, root = units[:-1], units[-1] if case.model == "gpt" else None
    if root is None:
        blocks = units
    gather = [("all_gather", "forward", p_dtype, (n - 1) * u * b_p) for u in units]
    if case.model == "gpt":  # the root is gathered first, before the blocks
        gather = [gather[-1], *gather[:-1]]
    out = []
    for j in range(case.accumulation):
        last = j == case.accumulation - 1
        if j == 0 or rab:
            out += gather
        regather = [("all_gather", "backward", p_dtype, (n - 1) * u * b_p) for u in blocks][::-1]
        reduce = [("reduce_scatter", "backward", r_dtype, (n - 1) * u * b_r) for u in blocks][::-1]
        if not raf:
            regather = []
        if not last:
            out += regather
            continue
        # the root prefetches the last block; block i prefetches block i-1, then reduces
        order = regather[:1]
        for i in range(len(blocks)):
            order += regather[i + 1 : i + 2] + [reduce[i]]
        if case.model == "gpt":
            order.append(("reduce_scatter", "backward", r_dtype, (n - 1) * root * b_r))
        out += order
    return out


VARIANTS = [
    (dict(model="mlp"), {}),
    (dict(model="gpt"), {}),
    (dict(model="gpt"), {"reshard_after_forward": False}),
    (dict(model="gpt", accumulation=3, clip=0.5, optimizer="sgd"), {}),
    (dict(model="gpt", accumulation=3, overlap=False), {"reshard_after_backward": False}),
    (dict(model="mlp", accumulation=2, clip=0.05), {"reshard_after_forward": False}),
]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_fsdp2_matches_single_process_run_in_float64(n):
    for fields, fsdp2 in VARIANTS:
        case = Case(stage=3, steps=6, **fields)
        got = zs.LocalWorld(n).run(train_fsdp2, case, fsdp2)
        want = reference(case, n)
        for r in range(n):
            assert max_rel_error(got[r]["params"], want) < 1e-12, (n, fields, fsdp2)


@pytest.mark.parametrize("fields, fsdp2", VARIANTS)
def test_fsdp2_collectives_per_step_equal_the_closed_form_from_the_shapes(fields, fsdp2):
    n = 3
    case = Case(stage=3, steps=2, **fields)
    got = zs.LocalWorld(n).run(train_fsdp2, case, fsdp2)
    raf = fsdp2.get("reshard_after_forward", True)
    rab = fsdp2.get("reshard_after_backward", True)
    want = expected_collectives(case, n, 8, 8, "float64", "float64", raf, rab)
    for r in range(n):
        for step in got[r]["steps"]:
            assert step == want


def test_fsdp2_reshard_after_forward_true_and_false_give_equal_weights_and_other_gathers():
    case = Case(stage=3, steps=4, model="gpt")
    on = zs.LocalWorld(3).run(train_fsdp2, case, {"reshard_after_forward": True})[0]
    off = zs.LocalWorld(3).run(train_fsdp2, case, {"reshard_after_forward": False})[0]
    assert max_rel_error(on["params"], off["params"]) < 1e-14
    blocks = len(unit_shapes(case)) - 1

    def gathers(result):
        return sum(1 for op, *_ in result["steps"][0] if op == "all_gather")

    assert gathers(on) == 2 * blocks + 1 and gathers(off) == blocks + 1
    # kept gathered from forward to backward, every unit is whole at once; resharded, at most
    # the root and two blocks (the one in backward and the one it prefetched)
    *block_shards, root = [shard_elements(s, 3) for s in unit_shapes(case)]
    assert off["memory"]["peak_gathered_params"] == 3 * 8 * (root + sum(block_shards))
    assert on["memory"]["peak_gathered_params"] == 3 * 8 * (root + sum(sorted(block_shards)[-2:]))


def test_fsdp2_bf16_param_dtype_with_float32_reduce_gathers_bf16_and_reduces_float32():
    case = Case(stage=3, steps=6, model="gpt", dtype="float32", accumulation=2, clip=0.5)
    case = case.with_(optimizer="sgd")  # Adam's normalised step would magnify bf16's rounding
    fsdp2 = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    got = zs.LocalWorld(3).run(train_fsdp2, case, fsdp2)
    want = reference(case.with_(dtype="float64"), 3)
    want_steps = expected_collectives(case, 3, 2, 4, "bfloat16", "float32", True, True)
    for r in range(3):
        assert got[r]["steps"][-1] == want_steps
        assert got[r]["shard_dtype"] == np.float32 and got[r]["master"] is None
        err = max_rel_error(got[r]["params"], want)
        assert 1e-5 < err < 2e-3  # bf16 computation: near the float64 run, not equal to it
    assert max_rel_error(got[1]["params"], got[0]["params"]) == 0


def test_fsdp2_bf16_reduce_dtype_reduces_in_bf16():
    case = Case(stage=3, steps=1, model="mlp", dtype="float32")
    got = zs.LocalWorld(2).run(train_fsdp2, case, {"param_dtype": "bfloat16"})
    dtypes = {(op, dt) for op, _, dt, _ in got[0]["steps"][0]}
    assert dtypes == {("all_gather", "bfloat16"), ("reduce_scatter", "bfloat16")}


BAD = [
    ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage"),
    ({"bf16": {"enabled": True}}, "bf16.enabled"),
    ({"fp16": {"enabled": True}}, "fp16.enabled"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}, "offload"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, "quantized"),
    ({"communication_data_type": "bf16"}, "communication_data_type"),
    ({"fsdp2": {"replicate": 2}}, "zerosim.fsdp2.replicate"),  # 2 does not divide 3
    ({"fsdp2": {"reshard_after_forward": 2}}, "zerosim.fsdp2.reshard_after_forward"),  # N = 3
    ({"fsdp2": {"reshard_after_forward": 0}}, "zerosim.fsdp2.reshard_after_forward"),
    ({"fsdp2": {"param_dtype": "float16"}}, "zerosim.fsdp2.param_dtype"),
    ({"fsdp2": {"units": "layers"}}, "zerosim.fsdp2.units"),
]


@pytest.mark.parametrize("change, key", BAD)
def test_fsdp2_bad_config_is_refused_naming_the_key(change, key):
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3},
        "zerosim": {"schedule": "fsdp2"},
    }
    for section, value in change.items():
        if section == "fsdp2":
            cfg["zerosim"]["fsdp2"] = value
        else:
            cfg[section] = value
    with pytest.raises(ConfigError, match=key):
        load_config(cfg, 3)


def test_fsdp2_unknown_key_is_named_in_a_warning():
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "zerosim": {"schedule": "fsdp2", "fsdp2": {"shard": 3}},
    }
    with pytest.warns(UserWarning, match="zerosim.fsdp2.shard"):
        load_config(cfg, 3)


def test_fsdp2_reshard_after_forward_equal_to_the_shard_group_is_true():
    case = Case(stage=3, steps=1, model="gpt")
    as_int = zs.LocalWorld(3).run(train_fsdp2, case, {"reshard_after_forward": 3})[0]
    as_one = zs.LocalWorld(3).run(train_fsdp2, case, {"reshard_after_forward": 1})[0]
    want = expected_collectives(case, 3, 8, 8, "float64", "float64", True, True)
    assert as_int["steps"][0] == want
    assert as_one["steps"][0] == expected_collectives(case, 3, 8, 8, "float64", "float64", 0, 1)


@pytest.mark.mpi
def test_fsdp2_under_mpirun_matches_single_process_run_on_3_ranks():
    out = run_mpi(3, ["tests/helpers/fsdp2_worker.py"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("FSDP2 OK") == 3, out.stdout


@pytest.mark.mpi
def test_zerosim_train_runs_schedule_fsdp2_under_mpirun(tmp_path):
    path = tmp_path / "fsdp2.json"
    path.write_text(
        '{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,'
        ' "optimizer": {"type": "AdamW", "params": {"lr": 0.001}},'
        ' "zero_optimization": {"stage": 3},'
        ' "zerosim": {"schedule": "fsdp2", "fsdp2": {"param_dtype": "bfloat16",'
        ' "reduce_dtype": "float32"}}}'
    )
    args = ["-m", "zerosim", "train", "--config", str(path), "--steps", "5", "--quiet"]
    args += ["--n-layer", "2", "--n-embd", "32", "--block-size", "16"]
    out = run_mpi(3, args)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "MISMATCH" not in out.stdout and out.stdout.count(" OK") >= 3, out.stdout


def test_fsdp2_hsdp_2x2_matches_single_process_run_and_all_reduces_each_row_across_replicas():
    n, replicate, shard = 4, 2, 2
    for fields in (dict(model="gpt", accumulation=2, clip=0.5), dict(model="mlp")):
        case = Case(stage=3, steps=4, **fields)
        got = zs.LocalWorld(n).run(train_fsdp2, case, {"replicate": replicate})
        want = reference(case, n)
        sizes = [shard_elements(s, shard) for s in unit_shapes(case)]
        sizes = [u for u in sizes if u]
        for r in range(n):
            assert max_rel_error(got[r]["params"], want) < 1e-12, (r, fields)
            step = got[r]["steps"][-1]
            reduced = [b for op, _, _, b in step if op == "reduce_scatter"]
            gathered = [b for op, _, _, b in step if op == "all_gather"]
            # inside the shard group of 2: each rank sends (2 - 1) · S_u elements of 8 bytes
            assert sorted(reduced) == sorted(8 * u for u in sizes)
            assert set(gathered) <= {8 * u for u in sizes}
            # one all-reduce of each reduced row, right after its reduce-scatter: a ring over
            # R = 2 ranks sends 2 · (R - 1) / R of the row
            ops = [op for op, *_ in step if op != "all_gather"]
            assert ops == ["reduce_scatter", "all_reduce"] * len(sizes)
            reduced_rows = [b for op, _, _, b in step if op == "all_reduce"]
            assert sorted(reduced_rows) == sorted(8 * u for u in sizes)


def test_fsdp2_int_reshard_after_forward_gathers_backward_inside_groups_of_that_size():
    """N = 4, reshard_after_forward = 2: after forward each block keeps ceil(dim0 / 2) rows of
    every parameter on each rank of its pair; backward gathers those inside the pair."""
    n, g = 4, 2
    case = Case(stage=3, steps=4, model="gpt", accumulation=2)
    got = zs.LocalWorld(n).run(train_fsdp2, case, {"reshard_after_forward": g})
    want = reference(case, n)
    *blocks, root = unit_shapes(case)
    forward = sorted(8 * (n - 1) * shard_elements(s, n) for s in [*blocks, root])
    backward = sorted(8 * (g - 1) * shard_elements(s, g) for s in blocks)
    for r in range(n):
        assert max_rel_error(got[r]["params"], want) < 1e-12
        step = got[r]["steps"][-1]
        per_micro = [
            sorted(b for op, ph, _, b in step if op == "all_gather" and ph == phase)
            for phase in ("forward", "backward")
        ]
        assert per_micro[0] == sorted(forward * case.accumulation)
        assert per_micro[1] == sorted(backward * case.accumulation)


@pytest.mark.parametrize(
    "saved, loaded",
    [((3, 3, "fsdp2"), (2, 1, "deepspeed")), ((2, 1, "deepspeed"), (4, 3, "fsdp2"))],
)
def test_fsdp2_checkpoint_loads_under_deepspeeds_stage_1_and_back(tmp_path, saved, loaded):
    from ckpt_worker import assemble, load_run, save_run, shapes_of

    (n, stage, schedule), (m, stage2, schedule2) = saved, loaded
    case_a = Case(stage=stage, schedule=schedule, model="gpt", micro=2)
    case_b = case_a.with_(stage=stage2, schedule=schedule2)
    snaps = zs.LocalWorld(n).run(save_run, case_a, 3, str(tmp_path))
    out = zs.LocalWorld(m).run(load_run, case_b, str(tmp_path), 2)
    shapes = shapes_of(case_a)
    before, after = assemble(snaps, shapes), assemble([o[0] for o in out], shapes)
    assert before.keys() == after.keys() and len(before) >= 2
    for kind in before:  # the master weights and every optimizer state, element by element
        for name in shapes:
            np.testing.assert_array_equal(after[kind][name], before[kind][name], f"{kind} {name}")


def test_fsdp2_refuses_a_model_built_inside_zero_init_naming_the_schedule():
    def fn(comm):
        cfg = fsdp2_config(Case(stage=3, model="mlp"))
        with zs.zero.Init(comm=comm, config=cfg):
            model = build_model(Case(model="mlp"))
        with pytest.raises(ConfigError, match="zerosim.schedule"):
            initialize(model, cfg, comm=comm)

    zs.LocalWorld(2).run(fn)


def _hsdp_save_or_load(comm, case: Case, fsdp2: dict, ckpt: str, save: bool) -> dict:
    cfg = config(case)
    if case.schedule == "fsdp2":
        cfg["zerosim"]["fsdp2"] = fsdp2
    engine, *_ = initialize(build_model(case), cfg, comm=comm)
    if save:
        x, y = data(case, comm.size)
        for s in range(3):
            optimizer_step(engine, comm, case, x, y, s)
        engine.save_checkpoint(ckpt)
    else:
        engine.load_checkpoint(ckpt)
    return engine.full_state_dict()


def test_fsdp2_hsdp_checkpoint_is_saved_once_and_loads_under_stage_1_and_back(tmp_path):
    hsdp = Case(stage=3, schedule="fsdp2", model="gpt", steps=3)
    stage1 = hsdp.with_(stage=1, schedule="deepspeed")
    first, second = str(tmp_path / "a"), str(tmp_path / "b")
    saved = zs.LocalWorld(4).run(_hsdp_save_or_load, hsdp, {"replicate": 2}, first, True)[0]
    loaded = zs.LocalWorld(2).run(_hsdp_save_or_load, stage1, {}, first, False)[0]
    assert all(np.array_equal(saved[k], loaded[k]) for k in saved)
    again = zs.LocalWorld(2).run(_hsdp_save_or_load, stage1, {}, second, True)[0]
    back = zs.LocalWorld(4).run(_hsdp_save_or_load, hsdp, {"replicate": 2}, second, False)
    assert all(np.array_equal(again[k], b[k]) for b in back for k in again)


# -- the torch-style face: zerosim.fsdp.fully_shard ---------------------------------------------
def train_fully_shard(comm, case: Case, mp: dict, raf=True, keep_gathered=False) -> dict:
    """A torch user's loop: fully_shard each block, then the model; AdamW over its parameters;
    with ``case.accumulation`` k, no gradient sync on the first k − 1 micro-batches (and, with
    ``keep_gathered``, no reshard after their backward); with ``case.clip``, clip_grad_norm_."""
    model = build_model(case)
    blocks = model.blocks if case.model == "gpt" else list(model.layers)[::2]  # the Linears
    policy = zs.fsdp.MixedPrecisionPolicy(**mp)
    for block in blocks:
        zs.fsdp.fully_shard(block, mesh=comm, reshard_after_forward=raf, mp_policy=policy)
    zs.fsdp.fully_shard(model, mesh=comm, mp_policy=policy)
    optimizer = zs.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.01)
    x, y = data(case, comm.size)
    width, steps, k = comm.size * case.micro, [], case.accumulation
    for s in range(case.steps):
        comm.ledger.reset()
        for j in range(k):
            last = j == k - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last or not keep_gathered)
            at = (s * k + j) * width + comm.rank * case.micro
            model(x[at : at + case.micro], y[at : at + case.micro])
            model.backward(grad_scale=1.0 / k)
        if case.clip > 0:
            zs.fsdp.clip_grad_norm_(model.parameters(), case.clip)
        optimizer.step()
        optimizer.zero_grad()
        steps.append([(r.op, np.dtype(r.dtype).name, r.bytes_sent) for r in comm.ledger.records])
    strategy = zs.fsdp.state_of(model).strategy
    return {
        "params": strategy.full_state_dict(),
        "steps": steps,
        "data": [(p.data.shape, p.data.dtype) for p in model.parameters()],
    }


@pytest.mark.parametrize("model", ["gpt", "mlp"])
def test_fully_shard_matches_single_process_run_and_the_config_routes_collectives(model):
    n = 3
    case = Case(stage=3, steps=5, model=model)
    got = zs.LocalWorld(n).run(train_fully_shard, case, {})
    route = zs.LocalWorld(n).run(train_fsdp2, case, {})
    want = reference(case, n)
    for r in range(n):
        assert max_rel_error(got[r]["params"], want) < 1e-12
        for mine, theirs in zip(got[r]["steps"], route[r]["steps"], strict=True):
            assert mine == [(op, dt, b) for op, _, dt, b in theirs]
        # between steps each parameter holds this rank's chunk, float32/64 (torch's local shard)
        shapes = dict(build_model(case).named_parameters())
        for (shape, dtype), p in zip(got[r]["data"], shapes.values(), strict=True):
            assert shape == (math.ceil(p.shape[0] / n) * math.prod(p.shape[1:]),)
            assert dtype == np.float64


def train_fsdp2_all_phases(comm, case: Case, fsdp2: dict) -> dict:
    """The config route, every collective of each step (the clip phase's too)."""
    engine, *_ = initialize(build_model(case), fsdp2_config(case, **fsdp2), comm=comm)
    x, y = data(case, comm.size)
    steps = []
    for s in range(case.steps):
        comm.ledger.reset()
        optimizer_step(engine, comm, case, x, y, s)
        steps.append([(r.op, np.dtype(r.dtype).name, r.bytes_sent) for r in comm.ledger.records])
    return {"params": engine.full_state_dict(), "steps": steps}


@pytest.mark.parametrize("keep_gathered", [False, True])
def test_fully_shard_accumulates_without_sync_and_clips_as_the_config_route(keep_gathered):
    """set_requires_gradient_sync(False) on the first micro-batch of two (and, with
    ``keep_gathered``, set_reshard_after_backward(False)), then clip_grad_norm_: the one-process
    run's weights, and the config route's collectives (gradient_accumulation_steps 2,
    gradient_clipping, reshard_after_backward), call for call with the norm's all-reduce."""
    n = 3
    case = Case(stage=3, steps=4, model="gpt", accumulation=2, clip=0.05)
    got = zs.LocalWorld(n).run(train_fully_shard, case, {}, True, keep_gathered)
    route = zs.LocalWorld(n).run(
        train_fsdp2_all_phases, case, {"reshard_after_backward": not keep_gathered}
    )
    want = reference(case, n)
    params = dict(build_model(case).named_parameters())
    for r in range(n):
        assert max_rel_error(got[r]["params"], want) < 1e-12
        for mine, theirs in zip(got[r]["steps"], route[r]["steps"], strict=True):
            assert mine == theirs
        # one reduce-scatter per FSDP module per step (the last micro-batch's), one norm
        for step in got[r]["steps"]:
            assert sum(op == "reduce_scatter" for op, _, _ in step) == len(unit_shapes(case))
            assert sum(op == "all_reduce" for op, _, _ in step) == 1
    # the norm: one float64 element per parameter (zerosim's float64 reference runs), which a
    # ring all-reduce sends 2(N − 1) times over all ranks, whatever the chunking
    for s in range(case.steps):
        sent = [b for r in range(n) for op, _, b in got[r]["steps"][s] if op == "all_reduce"]
        assert sum(sent) == 2 * (n - 1) * len(params) * 8


def test_the_torch_face_refuses_bad_switches_and_parameters_of_no_run_model():
    model = build_model(Case(model="mlp"))
    zs.fsdp.fully_shard(model)
    with pytest.raises(TypeError, match="requires_gradient_sync must be True or False, got 1"):
        model.set_requires_gradient_sync(1)
    with pytest.raises(TypeError, match="reshard_after_backward must be True or False, got None"):
        model.set_reshard_after_backward(None)
    with pytest.raises(ValueError, match="fully_shard"):
        zs.fsdp.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(ValueError, match="max_norm"):
        zs.fsdp.clip_grad_norm_(model.parameters(), 0.0)


def test_fully_shard_with_a_bf16_policy_gathers_bf16_and_reduces_float32():
    case = Case(stage=3, steps=2, model="gpt", dtype="float32")
    mp = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    got = zs.LocalWorld(2).run(train_fully_shard, case, mp)[0]
    assert {(op, dt) for op, dt, _ in got["steps"][-1]} == {
        ("all_gather", "bfloat16"),
        ("reduce_scatter", "float32"),
    }
    assert {dtype for _, dtype in got["data"]} == {np.dtype(np.float32)}


def test_fully_shard_refuses_a_second_call_and_a_bad_policy():
    model = build_model(Case(model="mlp"))
    zs.fsdp.fully_shard(model)
    with pytest.raises(ValueError, match="already applied"):
        zs.fsdp.fully_shard(model)
    with pytest.raises(TypeError, match="mp_policy"):
        zs.fsdp.fully_shard(model.layers, mp_policy={"param_dtype": "bfloat16"})


def test_fsdp2_dry_run_sends_the_closed_form_from_the_shapes():
    """The shape-only run at N = 6 (bf16 gathers, fp32 reductions) sends per step what the
    FSDP modules' dim-0 shards give, for the GPT "gpt:2,16,40,32,2" (torch's shapes)."""
    from zerosim.dryrun import dry_run

    n, layers, h, vocab, seq = 6, 2, 16, 40, 32
    block = [(h,), (h,), (3 * h, h), (3 * h,), (h, h), (h,), (h,), (h,)]
    block += [(4 * h, h), (4 * h,), (h, 4 * h), (h,)]
    root = [(vocab, h), (seq, h), (h,), (h,), (vocab, h)]
    blocks = layers * shard_elements(block, n)
    total = blocks + shard_elements(root, n)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3},
        "zerosim": {"schedule": "fsdp2", "fsdp2": {"param_dtype": "bfloat16"}},
    }
    cfg["zerosim"]["fsdp2"]["reduce_dtype"] = "float32"
    report = dry_run(f"gpt:{layers},{h},{vocab},{seq},2", n, cfg)
    for entry in report["ranks"]:
        sent = entry["bytes_sent"]
        assert sent["forward"] == (n - 1) * 2 * total
        assert sent["backward"] == (n - 1) * (2 * blocks + 4 * total)


def _step_rows(comm, case: Case, fsdp2: dict) -> dict:
    """One optimizer step's bytes sent by phase (the ledger) and ``zerosim train``'s rows."""
    from zerosim.cli.train import PHASES, expected_rows

    engine, *_ = initialize(build_model(case), fsdp2_config(case, **fsdp2), comm=comm)
    x, y = data(case, comm.size)
    comm.ledger.reset()
    optimizer_step(engine, comm, case, x, y, 0)
    measured = [comm.ledger.bytes_sent(phase=p) for p in PHASES]
    return {"measured": measured, "rows": expected_rows(engine, [], 0)}


@pytest.mark.parametrize("accumulation", [1, 2])
def test_fsdp2_hsdp_and_int_reshard_bytes_equal_zerosim_trains_rows_and_the_closed_form(
    accumulation,
):
    """N = 4, float64. HSDP 2 x 2: the gathers and reduce-scatters of a shard group of 2 and
    an all-reduce of each reduced row over R = 2 replicas (a ring of two sends half the row
    twice: S_u elements). reshard_after_forward = 2 (no HSDP): forward gathers over all 4,
    backward over pairs, ceil(dim0 / 2) rows of each block parameter (the other test's forms).
    HSDP reducing every micro-batch: k reduce-scatters and k all-reduces of each unit."""
    n, b = 4, 8
    case = Case(stage=3, steps=1, model="gpt", accumulation=accumulation, clip=0.5)
    k = accumulation
    *blocks, root = unit_shapes(case)
    every = {"replicate": 2, "reduce_every_micro_batch": True}
    for fsdp2, m in (({"replicate": 2}, 2), ({"reshard_after_forward": 2}, 4), (every, 2)):
        units = [shard_elements(s, m) for s in [*blocks, root]]
        s_blocks = sum(units[:-1])
        if "replicate" in fsdp2:
            regather, replicas = k * (m - 1) * s_blocks, sum(units)
        else:
            regather, replicas = k * sum(shard_elements(s, 2) for s in blocks), 0
        forward = k * (m - 1) * b * sum(units)
        reductions = k if fsdp2.get("reduce_every_micro_batch") else 1
        backward = b * (regather + reductions * ((m - 1) * sum(units) + replicas))
        got = zs.LocalWorld(n).run(_step_rows, case, fsdp2)
        for r in range(n):
            assert got[r]["measured"][:3] == [forward, backward, 0], (fsdp2, r)
            assert got[0]["rows"][r] == got[r]["measured"], (fsdp2, r)


def test_fsdp2_memory_counts_the_gradients_kept_between_micro_batches():
    """float64, N = 3: with 2 micro-batches every unsharded gradient waits for the last one in
    reduce_dtype (Ψ · 8 bytes); with 1 nothing waits. reshard_after_forward false: every FSDP
    module gathered at the end of forward, N · 8 · Σ_u S_u."""
    n = 3
    for k in (1, 2):
        case = Case(stage=3, steps=1, model="mlp", accumulation=k)
        memory = zs.LocalWorld(n).run(train_fsdp2, case, {"reshard_after_forward": False})[0][
            "memory"
        ]
        numel = sum(math.prod(s) for u in unit_shapes(case) for s in u)
        assert memory["peak_accumulated_grads"] == (8 * numel if k == 2 else 0)
        shards = sum(shard_elements(s, n) for s in unit_shapes(case))
        assert memory["peak_gathered_params"] == n * 8 * shards


def test_fsdp2_reduce_every_micro_batch_reduces_k_times_keeps_nothing_and_trains_the_same():
    """reduce_every_micro_batch (torch's default; FSDP1 under Composer): with k = 3 micro-batches
    each FSDP module is reduce-scattered 3 times a step, its rows added into the gradient shard,
    so the weights are the one-process run's and no unsharded gradient waits between
    micro-batches."""
    n, k = 3, 3
    case = Case(stage=3, steps=3, model="gpt", accumulation=k)
    got = zs.LocalWorld(n).run(train_fsdp2, case, {"reduce_every_micro_batch": True})
    once = zs.LocalWorld(n).run(train_fsdp2, case, {})[0]
    want = reference(case, n)
    units = len(unit_shapes(case))

    def reduce_scatters(result):
        return [op for op, *_ in result["steps"][0]].count("reduce_scatter")

    for r in range(n):
        assert max_rel_error(got[r]["params"], want) < 1e-12
        assert reduce_scatters(got[r]) == k * units
        assert got[r]["memory"]["peak_accumulated_grads"] == 0
    assert reduce_scatters(once) == units and once["memory"]["peak_accumulated_grads"] > 0
