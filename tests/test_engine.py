"""The engine on LocalWorld: parity with the single-process run, bytes and memory per stage."""

import numpy as np
import pytest
from engine_cases import Case, check_case, max_rel_error, train

import zerosim as zs
from zerosim.engine import initialize
from zerosim.errors import ConfigError
from zerosim.nn import MLP

STAGES = [(0, "deepspeed"), (1, "deepspeed"), (2, "deepspeed"), (1, "megatron")]
VARIANTS = [  # rotated over (stage, N) so every option meets every stage somewhere
    dict(model="mlp", accumulation=1, clip=0.0, optimizer="adam"),
    dict(model="gpt", accumulation=3, clip=0.5, optimizer="sgd", schedule="paper"),
    dict(model="mlp", accumulation=3, clip=0.05, optimizer="adam", overlap=False),
    dict(model="gpt", accumulation=1, clip=0.0, optimizer="adam", sub_group_size=7),
    dict(model="mlp", accumulation=1, clip=1e-3, optimizer="sgd", bucket=10**6, schedule="paper"),
]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("stage, layout", STAGES)
def test_stage_matches_single_process_run_in_float64(stage, layout, n):
    for i, variant in enumerate(VARIANTS):
        if (i + n + stage) % 2 and n == 8:
            continue  # keep the 8-rank runs to half the variants: they cost 8 threads each
        case = Case(stage=stage, layout=layout, steps=8 if n == 8 else 20, **variant)
        zs.LocalWorld(n).run(check_case, case)


@pytest.mark.parametrize("model, optimizer", [("gpt", "sgd"), ("mlp", "adam")])
@pytest.mark.parametrize("stage, layout", STAGES)
def test_stage_matches_single_process_run_in_float32_after_20_steps(
    stage, layout, model, optimizer
):
    """Not GPT with Adam in float32: the attention key bias has an exactly-zero true gradient
    (softmax ignores a per-row shift), so its computed gradient is pure rounding noise, which
    Adam's m/√v turns into lr-sized steps in different directions for any two summation orders."""
    case = Case(
        stage=stage,
        layout=layout,
        dtype="float32",
        model=model,
        optimizer=optimizer,
        accumulation=3,
        clip=1.0,
    )
    zs.LocalWorld(3).run(check_case, case)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_ring_collectives_give_the_same_parameters_and_bytes(stage):
    case = Case(stage=stage, model="gpt", steps=5)
    native = zs.LocalWorld(3).run(train, case)
    ring = zs.LocalWorld(3).run(train, case.with_(collectives="ring"))
    for a, b in zip(native, ring, strict=True):
        assert a["bytes"] == b["bytes"]
        assert max_rel_error(a["params"], b["params"]) < 1e-12


def test_stages_1_and_2_are_bitwise_equal_when_their_reduction_order_is_the_same():
    """At k = 1 both add the same N gradients element by element in rank order; stage 2 only
    cuts the sum into buckets. Megatron's layout too, without clipping (with clipping the norm's
    partial sums run over other owned ranges, so the clip coefficient rounds differently)."""
    runs = {
        (stage, layout): zs.LocalWorld(4).run(train, Case(stage=stage, layout=layout, steps=6))[0]
        for stage, layout in [(1, "deepspeed"), (2, "deepspeed"), (1, "megatron")]
    }
    base = runs[(1, "deepspeed")]["params"]
    for key in [(2, "deepspeed"), (1, "megatron")]:
        for name in base:
            assert np.array_equal(runs[key]["params"][name], base[name]), (key, name)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("scaling", [dict(prescale=True), dict(predivide=1.5)])
def test_prescaled_or_predivided_gradients_still_match_the_single_process_run(stage, scaling):
    """prescale_gradients divides by N before the sum; gradient_predivide_factor f multiplies by
    1/f before and f/N after: either way the mean gradient, to rounding (float64 1e-10)."""
    case = Case(stage=stage, accumulation=2, optimizer="adam", steps=10, **scaling)
    zs.LocalWorld(3).run(check_case, case)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_power_of_two_predivision_is_bitwise_the_plain_average(stage):
    """With N = 2 and f = 4 every scaling (×1/4 before, ×4/2 after) is exact in binary, so the
    parameters equal the default run's bit for bit; with f = 3 they differ by rounding only."""
    runs = {
        f: zs.LocalWorld(2).run(train, Case(stage=stage, steps=6, dtype="float32", predivide=f))
        for f in (1.0, 4.0, 3.0)
    }
    base = runs[1.0][0]["params"]
    for name in base:
        assert np.array_equal(runs[4.0][0]["params"][name], base[name]), name
    assert not all(np.array_equal(runs[3.0][0]["params"][k], base[k]) for k in base)
    assert max_rel_error(runs[3.0][0]["params"], base) < 1e-5


def test_stage_2_bytes_grow_with_accumulation_as_k_plus_1():
    """The paper's schedule: a reduce-scatter of Ψ_pad per micro-step, one all-gather."""
    one = zs.LocalWorld(4).run(train, Case(stage=2, steps=2, schedule="paper"))[0]
    three = zs.LocalWorld(4).run(train, Case(stage=2, steps=2, accumulation=3, schedule="paper"))
    v = 3 * 140 // 4 * 8  # (N-1)/N · Ψ_pad · b, Ψ = 137 padded to a multiple of N = 140
    assert one["padded"] == 140
    assert one["bytes"][1]["backward"] == v and three[0]["bytes"][1]["backward"] == 3 * v
    assert one["bytes"][1]["step"] == three[0]["bytes"][1]["step"] == v


def test_deepspeeds_stage_2_all_reduces_every_micro_step_and_gathers_once():
    """DeepSpeed's schedule: every micro-step all-reduces the unpadded Ψ = 137 (one bucket):
    rank r sends 2·137 − c_r − c_{r+1} elements (chunks 35, 34, 34, 34), 1.5× the paper's
    reduce-scatter and more; the all-gather moves Ψ padded to a multiple of 2N = 144."""
    case = Case(stage=2, steps=2, bucket=10**6)
    runs = {k: zs.LocalWorld(4).run(train, case.with_(accumulation=k)) for k in (1, 3)}
    chunks = [35, 34, 34, 34]
    for rank in range(4):
        reduce = (2 * 137 - chunks[rank] - chunks[(rank + 1) % 4]) * 8
        for k, ranks in runs.items():
            assert ranks[rank]["padded"] == 144
            assert ranks[rank]["bytes"][1]["backward"] == k * reduce
            assert ranks[rank]["bytes"][1]["step"] == 3 * 144 // 4 * 8


def test_memory_falls_with_n_as_the_stage_formula_says():
    per_stage = {}
    for stage in (0, 1, 2):
        per_stage[stage] = [
            zs.LocalWorld(n).run(train, Case(stage=stage, steps=1))[0]["memory"] for n in (1, 2, 4)
        ]
    states = [sum(v for k, v in m.items() if k.startswith("optimizer_state")) for m in per_stage[1]]
    assert states[0] > states[1] > states[2]
    assert [m["grads"] for m in per_stage[2]][1] < [m["grads"] for m in per_stage[1]][1]
    # stage 0 keeps everything: only the padding of Ψ = 137 to a multiple of N changes
    assert [m["grads"] for m in per_stage[0]] == [137 * 8, 138 * 8, 140 * 8]


def test_megatron_range_maps_cover_each_owned_element_once():
    def maps(comm):
        engine, *_ = initialize(
            MLP([6, 9, 5, 4], seed=3),
            {
                "train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                "zero_allow_untested_optimizer": True,
                "zero_optimization": {"stage": 1, "reduce_bucket_size": 60},
                "zerosim": {"layout": "megatron"},
            },
            comm=comm,
        )
        (group,) = engine.strategy.groups
        owned = sum(r.size for r in group.owned)
        (ranges,) = engine.strategy.layout.range_maps()
        covered = sum(r.world.size for r in ranges.values())
        for name, r in ranges.items():
            slot = next(s for s in group.slots if s.name == name)
            assert r.param.start == r.world.start - slot.range.start
            assert r.world.size == r.world_in_bucket.size == r.local.size == r.param.size
        return owned, covered, [u.size % 128 for u in group.layout.units]

    results = zs.LocalWorld(3).run(maps)
    assert sum(c for _, c, _ in results) == 137  # every parameter element owned exactly once
    assert all(all(m == 0 for m in mods) for _, _, mods in results)  # lcm(3, 128) = 384 ⊇ 128


def _cfg(**over):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
    }
    cfg.update(over)
    return cfg


def test_config_errors_are_raised_on_every_rank_before_any_state():
    def fn(comm, cfg):
        model = MLP([4, 3], seed=0)
        before = model.layers[0].weight.data.copy()
        try:
            initialize(model, cfg, comm=comm)
        except ConfigError as err:
            assert np.array_equal(model.layers[0].weight.data, before)
            return str(err)
        return None

    for cfg, needle in [
        (_cfg(zero_optimization={"stage": 5}), "zero_optimization.stage"),
        (_cfg(train_batch_size=7), "train_batch_size"),
        (_cfg(optimizer={"type": "Adam", "params": {"lr": "fast"}}), "optimizer.params.lr"),
        (_cfg(fp16={"enabled": True}, bf16={"enabled": True}), "bf16"),
        (_cfg(gradient_predivide_factor=0.0), "gradient_predivide_factor"),
        (
            _cfg(zero_optimization={"stage": 3, "stage3_max_live_parameters": -1}),
            "zero_optimization.stage3_max_live_parameters",
        ),
    ]:
        messages = zs.LocalWorld(3).run(fn, cfg)
        assert all(m is not None and needle in m for m in messages), (needle, messages)


def test_a_model_that_differs_across_ranks_is_named_on_every_rank():
    def fn(comm):
        model = MLP([4, 5 if comm.rank == 1 else 3, 2], seed=0)
        with pytest.raises(ValueError, match=r"differs across ranks.*layers\.0\.weight"):
            initialize(model, _cfg(), comm=comm)

    zs.LocalWorld(3).run(fn)


def test_misuse_of_the_verbs_gives_clear_errors():
    def fn(comm):
        a, *_ = initialize(MLP([4, 3], seed=0), _cfg(), comm=comm)
        b, *_ = initialize(MLP([4, 3], seed=0), _cfg(), comm=comm)
        x, y = np.ones((2, 4), np.float32), np.array([0, 1])
        with pytest.raises(RuntimeError, match=r"step\(\) was called without a backward"):
            a.step()
        loss_b = b(x, y)
        with pytest.raises(ValueError, match="another engine"):
            a.backward(loss_b)
        with pytest.raises(ValueError, match="elsewhere"):
            a.backward(0.5)
        first = a(x, y)
        a(x, y)
        with pytest.raises(ValueError, match="only the latest"):
            a.backward(first)

    zs.LocalWorld(2).run(fn)


def test_initialize_returns_loader_scheduler_and_steps_the_lr():
    from zerosim.data import make_classification

    def fn(comm):
        cfg = _cfg(
            scheduler={
                "type": "WarmupLR",
                "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"},
            }
        )
        engine, opt, loader, sched = initialize(
            MLP([4, 6, 3], seed=0),
            cfg,
            comm=comm,
            training_data=make_classification(64, 4, 3, seed=1),
        )
        lrs = []
        for step, (x, y) in enumerate(loader):
            engine.backward(engine(x, y))
            engine.step()
            lrs.append(engine.get_lr()[0])
            if step == 5:
                break
        return lrs, len(loader), engine.get_global_grad_norm() > 0, sched is engine.lr_scheduler

    lrs, length, normed, same = zs.LocalWorld(2).run(fn)[0]
    assert same and normed and length == 64 // (2 * 2)
    # DeepSpeed's WarmupLR: the first step() moves to iteration 0 (lr = warmup_min_lr = 0), then
    # linear: lr = 0.01 · it / 4 until it = 4
    assert lrs == pytest.approx([0.0, 0.0025, 0.005, 0.0075, 0.01, 0.01])


@pytest.mark.parametrize("stage, layout", STAGES)
def test_owned_segments_tile_every_parameter_once_across_ranks(stage, layout):
    def fn(comm):
        engine, *_ = initialize(
            build_mlp(),
            _cfg(
                zero_optimization={"stage": stage, "sub_group_size": 17, "reduce_bucket_size": 40},
                zerosim={"layout": layout},
            ),
            comm=comm,
        )
        strat = engine.strategy
        owned = [(s.name, s.param_range.start, s.param_range.stop) for s in strat.segments()]
        stepped = strat.segments("stepped")
        params = dict(engine.module.named_parameters())
        for seg in stepped:  # each segment views exactly that run of the parameter
            tile = strat.sharded_step.tiles[seg.group][seg.tile]
            got = tile.data[seg.offset : seg.offset + seg.size]
            want = params[seg.name].data.reshape(-1)[seg.param_range.start : seg.param_range.stop]
            assert np.array_equal(got, want)
        return owned, sum(s.size for s in stepped)

    results = zs.LocalWorld(3).run(fn)
    counts = {name: np.zeros(p.numel, int) for name, p in build_mlp().named_parameters()}
    for owned, _ in results:
        for name, a, b in owned:
            counts[name][a:b] += 1
    assert all((c == 1).all() for c in counts.values())
    stepped = [n for _, n in results]
    # stage 0 steps every element on every rank; the others each element on its owner only
    if stage == 0:
        assert stepped == [137] * 3
    else:
        assert sum(stepped) == 137  # (Megatron's small padded buckets may all fall on rank 0)


def build_mlp():
    return MLP([6, 9, 5, 4], seed=3)


def test_wall_clock_breakdown_times_each_phase_and_logs_it(caplog):
    import logging

    def fn(comm, breakdown):
        cfg = _cfg(wall_clock_breakdown=breakdown, steps_per_print=2)
        engine, *_ = initialize(MLP([4, 3], seed=0), cfg, comm=comm)
        before = dict(engine.wall_clock)
        for _ in range(2):
            engine.backward(engine(np.ones((2, 4), np.float32), np.array([0, 1])))
            engine.step()
        return before, engine.wall_clock

    with caplog.at_level(logging.INFO, logger="zerosim.engine"):
        before, after = zs.LocalWorld(1).run(fn, True)[0]
    assert before == {"forward": 0.0, "backward": 0.0, "step": 0.0}
    assert all(after[k] > 0 for k in before)
    assert any("time over the last 2 steps (ms): forward" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="zerosim.engine"):
        zs.LocalWorld(1).run(fn, False)
    assert not any("time over the last" in r.message for r in caplog.records)


def test_steps_per_print_null_never_logs_progress_but_the_timers_log_every_step(caplog):
    """DeepSpeed 0.19.8's default steps_per_print is None: no progress line; its timers (with
    wall_clock_breakdown) still log at every step."""
    import logging

    def fn(comm, breakdown):
        engine, *_ = initialize(
            MLP([4, 3], seed=0), _cfg(wall_clock_breakdown=breakdown), comm=comm
        )
        assert engine.config.steps_per_print is None
        for _ in range(3):
            engine.backward(engine(np.ones((2, 4), np.float32), np.array([0, 1])))
            engine.step()

    for breakdown, timed in ((False, 0), (True, 3)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="zerosim.engine"):
            zs.LocalWorld(1).run(fn, breakdown)
        messages = [r.message for r in caplog.records]
        assert not any(m.startswith("step ") for m in messages)
        assert sum("time over the last 1 steps" in m for m in messages) == timed


def _seeded_by_rank(comm, stage):
    """Each rank builds the model with its own seed; initialize starts all from rank 0's."""
    rank0 = {n: p.data.copy() for n, p in MLP([6, 5, 3], seed=0).named_parameters()}
    model = MLP([6, 5, 3], seed=comm.rank)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "zerosim": {"dtype": "float64"},
    }
    engine, *_ = initialize(model, cfg, comm=comm)
    start = engine.full_state_dict()
    init_bytes = comm.ledger.bytes_sent(op="broadcast", phase="init")
    x = np.random.default_rng(comm.rank).normal(size=(2, 6))
    engine.backward(engine(x, np.array([0, 2])))
    engine.step()
    after = engine.full_state_dict()
    return start, rank0, init_bytes, after


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_initialize_broadcasts_rank_0_weights_so_per_rank_seeds_do_not_matter(stage):
    results = zs.LocalWorld(3).run(_seeded_by_rank, stage)
    n_params = 6 * 5 + 5 + 5 * 3 + 3
    for start, rank0, init_bytes, after in results:
        for name, want in rank0.items():
            np.testing.assert_array_equal(start[name], want)  # rank 0's seed-0 weights
            np.testing.assert_array_equal(after[name], results[0][3][name])  # one model
        # a ring broadcast of S bytes: every rank but the last in the ring forwards S
        assert init_bytes in (0, n_params * 8)
    assert sum(res[2] for res in results) == 2 * n_params * 8
