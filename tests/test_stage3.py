"""ZeRO stage 3 on LocalWorld: parity, volume, memory, prefetch, changing order, tied weights."""

import warnings

import numpy as np
import pytest
from engine_cases import Case, build_model, check_case, config, max_rel_error, stays_gathered

import zerosim as zs
from zerosim import optim
from zerosim.engine import initialize
from zerosim.nn import GPT, Linear, LossModel, MSELoss, ReLU

VARIANTS = [  # DeepSpeed's schedule unless named: coalesced fetches, prefetch without overlap
    dict(model="mlp"),
    dict(model="gpt", accumulation=3, clip=0.5, optimizer="sgd"),
    dict(model="gpt", overlap=False, schedule="paper"),  # no prefetch, no overlap: 3Ψ
    dict(model="gpt", prefetch=200, max_live=400, accumulation=3),
    dict(model="gpt", prefetch=200, max_live=400, accumulation=3, schedule="paper"),
    dict(model="mlp", persistence=10**6, clip=0.05),  # everything persistent
    dict(model="gpt", persistence=40, optimizer="sgd"),
    dict(model="mlp", reuse=10**9, accumulation=3),
]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_stage3_matches_single_process_run_in_float64(n):
    for i, variant in enumerate(VARIANTS):
        if n == 8 and i % 2:
            continue  # 8 threads per run: half the variants keep the suite fast
        zs.LocalWorld(n).run(check_case, Case(stage=3, steps=8 if n == 8 else 20, **variant))


@pytest.mark.parametrize("model, optimizer", [("gpt", "sgd"), ("mlp", "adam")])
def test_stage3_matches_single_process_run_in_float32(model, optimizer):
    case = Case(stage=3, dtype="float32", model=model, optimizer=optimizer, accumulation=3)
    zs.LocalWorld(3).run(check_case, case)


def test_stage3_sends_three_times_psi_per_step_split_by_phase():
    def fn(comm):
        return check_case(comm, Case(stage=3, steps=3, model="gpt", schedule="paper"))

    zs.LocalWorld(4).run(fn)  # check_case asserts forward (N-1)/N·Ψ, backward 2(N-1)/N·Ψ


def test_stage3_under_deepspeeds_schedule_sends_twice_psi_after_the_recording_step():
    """With DeepSpeed's defaults (prefetch and live cap above the model) every parameter stays
    gathered from forward to backward once the first micro-step has recorded the trace."""

    def fn(comm):
        case = Case(stage=3, steps=3, model="gpt", schedule="deepspeed")
        assert stays_gathered(case)
        return check_case(comm, case)

    zs.LocalWorld(4).run(fn)  # check_case asserts forward (N-1)/N·Ψ, backward (N-1)/N·Ψ


def _peak_gathered(comm, max_live, schedule="paper", reuse=10**9):
    """(peak gathered bytes, largest module's numel) of 3 steps of a 2-layer GPT."""
    model = GPT(13, 5, 2, 2, 6, seed=3, dtype="float64")
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_live_parameters": max_live,
            "stage3_max_reuse_distance": reuse,
            "stage3_prefetch_bucket_size": 10**6,
        },
        "zerosim": {"dtype": "float64", "schedule": schedule},
    }
    engine, *_ = initialize(model, cfg, comm=comm)
    x = np.random.default_rng(0).integers(0, 13, (2, 5))
    for _ in range(3):
        engine.backward(engine(x, np.roll(x, -1, 1)))
        engine.step()
    largest = max(sum(p.numel for p in m._parameters.values()) for m in model.modules())
    return engine.memory_report()["peak_gathered_params"], largest


@pytest.mark.filterwarnings("ignore:zero_optimization.stage3_max_live_parameters")
def test_deepspeeds_live_cap_bounds_prefetch_and_not_reuse():
    """DeepSpeed's coordinator checks stage3_max_live_parameters only before a prefetch: with
    a cap of 0 and no reuse it gathers one module at a time; with reuse it keeps the whole
    model from forward to backward whatever the cap."""
    total = sum(p.numel for p in GPT(13, 5, 2, 2, 6, seed=3).parameters())
    peak, largest = zs.LocalWorld(2).run(_peak_gathered, 0, "deepspeed", 0)[0]
    assert peak == largest * 8
    peak, _ = zs.LocalWorld(2).run(_peak_gathered, 0, "deepspeed", 10**9)[0]
    assert peak == total * 8


def test_peak_gathered_parameters_stay_under_the_live_cap_plus_one_module():
    """The paper's schedule: prefetch and reuse both stop at the cap."""
    fn = _peak_gathered
    for cap in (0, 100, 300):
        peak, largest = zs.LocalWorld(2).run(fn, cap)[0]
        assert peak <= (cap + largest) * 8, (cap, peak, largest)
    unlimited, _ = zs.LocalWorld(2).run(fn, 10**9)[0]
    capped, _ = zs.LocalWorld(2).run(fn, 0)[0]
    assert capped < unlimited


def _initialize_small_gpt(comm, max_live, schedule):
    """A 2-layer GPT whose largest module, blocks.0.mlp.c_fc, has 168 parameters (6·24 weights
    and 24 biases), under stage 3 with this live cap."""
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "stage3_max_live_parameters": max_live},
        "zerosim": {"schedule": schedule},
    }
    initialize(GPT(13, 5, 2, 2, 6, seed=3), cfg, comm=comm)


def _live_cap_warnings(max_live, schedule):
    """The live-cap warnings of initializing on 2 ranks (caught here, not in the rank threads:
    ``catch_warnings`` swaps process-wide state)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zs.LocalWorld(2).run(_initialize_small_gpt, max_live, schedule)
    return [str(w.message) for w in caught if "stage3_max_live_parameters" in str(w.message)]


def test_a_live_cap_below_the_largest_module_warns_once_under_deepspeeds_schedule():
    """Under it DeepSpeed's prefetch budget, min(max_live - live, prefetch bucket), is negative
    while that module is gathered: the engine names the cap, the module and its size, once (on
    rank 0); at the module's size, or under the paper's schedule, it says nothing."""
    [message] = _live_cap_warnings(167, "deepspeed")
    assert "stage3_max_live_parameters=167 " in message
    assert "168 parameters of module 'blocks.0.mlp.c_fc'" in message
    assert _live_cap_warnings(168, "deepspeed") == []
    assert _live_cap_warnings(0, "paper") == []


class Swapper(LossModel):
    """Two layers whose order alternates between forwards: A then B, then B then A."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        rng = np.random.default_rng(seed)
        self.a = Linear(4, 4, rng=rng, dtype="float64")
        self.b = Linear(4, 4, rng=rng, dtype="float64")
        self.act = ReLU()
        self.loss_fn = MSELoss()
        self.calls = 0

    def _output(self, x):
        self.order = (self.a, self.b) if self.calls % 2 == 0 else (self.b, self.a)
        self.calls += 1
        self.save_for_backward(self.order)
        return self.order[1](self.act(self.order[0](x)))

    def _output_backward(self, grad):
        first, second = self.pop_saved()[0]
        return first.backward(self.act.backward(second.backward(grad)))


def test_a_model_whose_module_order_changes_between_steps_trains_correctly():
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((6 * 8, 4)), rng.standard_normal((6 * 8, 4))

    def run(comm):
        model = Swapper()
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
            "zero_allow_untested_optimizer": True,
            "gradient_clipping": 0.0,  # the reference below does not clip
            "zero_optimization": {
                "stage": 3,
                "stage3_param_persistence_threshold": 0,
                "stage3_prefetch_bucket_size": 10,
                "stage3_max_reuse_distance": 10**9,
            },
            "zerosim": {"dtype": "float64"},
        }
        engine, *_ = initialize(model, cfg, comm=comm)
        for s in range(8):
            at = s * 2 * comm.size + 2 * comm.rank
            engine.backward(engine(x[at : at + 2], y[at : at + 2]))
            engine.step()
        return engine.full_state_dict()

    ref = Swapper()
    opt = optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for s in range(8):
        ref(x[s * 6 : s * 6 + 6], y[s * 6 : s * 6 + 6])
        ref.backward()
        opt.step()
        opt.zero_grad()
    want = {n: p.data for n, p in ref.named_parameters()}
    for got in zs.LocalWorld(3).run(run):
        assert max_rel_error(got, want) < 1e-12


def test_tied_embedding_and_head_gather_twice_and_accumulate_one_gradient():
    def run(comm):
        model = GPT(13, 5, 1, 2, 6, tie_weights=True, seed=3, dtype="float64")
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "zerosim": {"dtype": "float64"},
        }
        engine, *_ = initialize(model, cfg, comm=comm)
        data = np.random.default_rng(1).integers(0, 13, (5 * 3 * 2, 5))
        for s in range(5):
            at = (s * comm.size + comm.rank) * 2
            xb = data[at : at + 2]
            engine.backward(engine(xb, np.roll(xb, -1, 1)))
            engine.step()
        return engine.full_state_dict()

    ref = GPT(13, 5, 1, 2, 6, tie_weights=True, seed=3, dtype="float64")
    opt = optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)  # DeepSpeed fills in 0.0
    data = np.random.default_rng(1).integers(0, 13, (5 * 3 * 2, 5))
    for s in range(5):
        xb = data[s * 6 : s * 6 + 6]
        ref(xb, np.roll(xb, -1, 1))
        ref.backward()
        opt.step()
        opt.zero_grad()
    want = {n: p.data for n, p in ref.named_parameters()}
    assert "lm_head.weight" not in want  # tied: one parameter, one name
    for got in zs.LocalWorld(3).run(run):
        assert max_rel_error(got, want) < 1e-12


def test_parameters_are_really_partitioned_between_steps():
    def run(comm):
        model = GPT(13, 5, 1, 2, 6, seed=3)
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        }
        engine, *_ = initialize(model, cfg, comm=comm)
        x = np.zeros((2, 5), dtype=np.int64)
        engine.backward(engine(x, x))
        engine.step()
        sizes = {n: p.data.size for n, p in model.named_parameters()}
        held = engine.memory_report()["params"]
        return sizes, held, [p.numel for p in model.parameters()]

    for sizes, held, numels in zs.LocalWorld(4).run(run):
        assert set(sizes.values()) == {0}  # every parameter released
        # float32 chunks of ceil(numel / 4) elements of every parameter, nothing more
        assert held == 4 * sum(-(-n // 4) for n in numels) < 4 * sum(numels)


def _local_shards(comm, case: Case) -> dict:
    engine, *_ = initialize(build_model(case), config(case), comm=comm)
    return engine.strategy.local_shards()


@pytest.mark.parametrize("schedule", ["paper", "fsdp2"])
def test_local_shards_are_each_ranks_own_slice_of_every_parameter(schedule):
    """Before any step, rank r's local shard of a parameter is its slice of the model as built:
    under FSDP2 rows [r·c, (r+1)·c) with c = ceil(dim0 / N) (torch.chunk's cut, ``to_local()``),
    under the paper's partition elements [r·c, (r+1)·c) with c = ceil(numel / N)."""
    n, case = 3, Case(stage=3, model="gpt", schedule=schedule)
    shards = zs.LocalWorld(n).run(_local_shards, case)
    for name, p in build_model(case).named_parameters():
        for r in range(n):
            if schedule == "fsdp2":
                c = -(-p.shape[0] // n)
                want = p.data[r * c : (r + 1) * c]
                assert shards[r][name].shape == want.shape, (name, r)
            else:
                c = -(-p.data.size // n)
                want = p.data.reshape(-1)[r * c : (r + 1) * c]
            np.testing.assert_array_equal(shards[r][name].reshape(-1), want.reshape(-1))
