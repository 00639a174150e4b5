"""DeepSpeed's IPG buckets (stages 1-2, the "deepspeed" schedule): the collectives each bucket
issues, checked against messages DeepSpeed 0.19.8's comms logger printed for the same buckets."""

from __future__ import annotations

import numpy as np
import pytest

from zerosim.comm import LocalWorld
from zerosim.engine import initialize
from zerosim.nn import MLP, GradReadyTracker
from zerosim.zero.ipg import BucketGradient, bucket_pieces, merge_slices, plan_bucket

# MLP [20, 37, 5]: w1 740, b1 37, w2 185, b2 5 laid at 0, 740, 777, 962; Ψ = 967. N = 3 pads
# to a multiple of 2N: 972, P = 324.
STARTS = [0, 740, 777, 962]
NUMELS = [740, 37, 185, 5]
P3 = [324]


def entries(indices):
    return [BucketGradient(0, STARTS[i], NUMELS[i]) for i in indices]


def sizes(plan):
    return [(r.op, r.root, r.numel) for r in plan]


def test_pieces_cut_each_parameter_at_the_partition_boundaries_and_merge_one_owners_runs():
    pieces = bucket_pieces(entries([3, 2, 1]), P3)  # b2, w2, b1: all inside partition 2
    assert [(p.owner, p.size) for p in pieces] == [(2, 5), (2, 185), (2, 37)]
    assert [(s.owner, s.size) for s in merge_slices(pieces)] == [(2, 227)]
    w1 = bucket_pieces(entries([0]), P3)
    assert [(p.owner, p.bucket_start, p.size, p.flat_start) for p in w1] == [
        (0, 0, 324, 0),
        (1, 324, 324, 324),
        (2, 648, 92, 648),
    ]


def test_buckets_of_300_match_deepspeeds_messages():
    """DeepSpeed 0.19.8, stage 2, N = 3, reduce_bucket_size 300 logged all_reduce 908 B once,
    1296 B twice and 368 B once per step (227, 324, 324, 92 elements); with
    use_multi_rank_bucket_allreduce false the same sizes as reduces, to ranks 2, 0, 1, 2."""
    plans = [plan_bucket(entries(b), P3, 300) for b in ([3, 2, 1], [0])]
    assert [sizes(p) for p in plans] == [
        [("all_reduce", None, 227)],
        [("all_reduce", None, 324), ("all_reduce", None, 324), ("all_reduce", None, 92)],
    ]
    reduce = [plan_bucket(entries(b), P3, 300, use_multi_rank_bucket_allreduce=False) for b in
              ([3, 2, 1], [0])]  # fmt: skip
    assert [sizes(p) for p in reduce] == [
        [("reduce", 2, 227)],
        [("reduce", 0, 324), ("reduce", 1, 324), ("reduce", 2, 92)],
    ]


@pytest.mark.parametrize(
    "switches",
    [dict(reduce_scatter=False), dict(contiguous_gradients=False)],
    ids=["reduce_scatter=false", "contiguous_gradients=false"],
)
def test_without_reduce_scatter_or_contiguous_gradients_a_bucket_is_one_all_reduce(switches):
    assert sizes(plan_bucket(entries([0]), P3, 300, **switches)) == [("all_reduce", None, 740)]


def test_a_reduce_gathers_one_owners_scattered_slices_in_bucket_order():
    """Partitions of 4 over [5, 6, 5] elements at 0, 5, 11 (N = 4, Ψ_pad 16), reduced last
    first: owner runs 2:1, 3:4 | 1:3, 2:3 | 0:4, 1:1; owner 2's slices sit at 0 and 8."""
    es = [BucketGradient(0, 11, 5), BucketGradient(0, 5, 6), BucketGradient(0, 0, 5)]
    plan = plan_bucket(es, [4], 100, use_multi_rank_bucket_allreduce=False)
    assert [(r.root, [s.size for s in r.slices]) for r in plan] == [
        (2, [1, 3]),
        (3, [4]),
        (1, [3, 1]),
        (0, [4]),
    ]
    assert [s.bucket_start for s in plan[0].slices] == [0, 8]


def test_a_linear_reports_its_bias_before_its_weight_as_torchs_autograd_does():
    model = MLP([4, 3, 2], seed=0)
    names = {id(p): n for n, p in model.named_parameters()}
    order = []
    GradReadyTracker(model, lambda p: order.append(names[id(p)]))
    model(np.ones((2, 4), np.float32), np.array([0, 1]))
    model.backward()
    assert order == ["layers.2.bias", "layers.2.weight", "layers.0.bias", "layers.0.weight"]


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("multi_rank", [True, False])
def test_every_rank_holds_the_reduced_mean_of_what_it_owns(stage, overlap, multi_rank):
    """Small buckets (cut inside the first layer), reduces or all-reduces: each owned gradient
    element equals the mean over ranks of the local gradients."""

    def fn(comm):
        cfg = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
            "zero_allow_untested_optimizer": True,
            "gradient_clipping": 0.0,
            "zero_optimization": {
                "stage": stage,
                "reduce_bucket_size": 100,
                "overlap_comm": overlap,
                "use_multi_rank_bucket_allreduce": multi_rank,
            },
            "zerosim": {"dtype": "float64"},
        }
        model = MLP([20, 37, 5], seed=1, dtype="float64")
        local = MLP([20, 37, 5], seed=1, dtype="float64")
        engine, *_ = initialize(model, cfg, comm=comm)
        rng = np.random.default_rng(comm.rank)
        x, y = rng.standard_normal((2, 20)), rng.integers(0, 5, 2)
        local(x, y)
        local.backward()
        mine = np.concatenate([p.grad.reshape(-1) for _, p in local.named_parameters()])
        every = np.empty(comm.size * mine.size)
        comm.all_gather(every, mine)
        mean = every.reshape(comm.size, -1).mean(axis=0)
        engine.backward(engine(x, y))
        (g,) = engine.strategy.groups
        (own,) = g.owned
        got = engine.strategy.grad_view(g, own)
        want = np.zeros(g.layout.padded_numel)
        want[: mean.size] = mean
        return float(np.abs(got - want[own.start : own.stop]).max())

    assert max(LocalWorld(3).run(fn)) < 1e-15
