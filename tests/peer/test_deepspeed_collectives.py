"""DeepSpeed 0.19.8's comms logger against zerosim's ledger: the collectives of each optimizer step.

The same config, model and data run on both sides (``runner.run_both``: DeepSpeed under
torchrun with ``"comms_logger": {"enabled": true, "prof_all": true}``, zerosim under mpirun with
its default ``zerosim.schedule``, "deepspeed"). For every rank and every optimizer step, per
collective kind, the calls and the message sizes are equal: stages 0-3, N = 2 and 3, fp32, bf16
and fp16, accumulation 1 and 2, reduce_bucket_size 37, 300 and the default, and both settings
of each switch that chooses the collectives (reduce_scatter, use_multi_rank_bucket_allreduce,
contiguous_gradients, overlap_comm, allgather_partitions with allgather_bucket_size,
compute_grad_norm, bf16.check_grad_overflow, gradient_clipping).

Message sizes are compared in DeepSpeed's convention: an all-gather logs its input (this rank's
shard), a reduce-scatter, all-reduce or reduce its whole buffer; zerosim's ledger records the
whole buffer of each, so its all-gather sizes are divided by N.

Not compared, and why:

- start-up: what each side sends before the first step (DeepSpeed's ``_broadcast_model``,
  zerosim's model/config fingerprint all-reduces and ``broadcast_model``): both drivers take
  their first snapshot after ``initialize``.
- zerosim's cross-rank argument checks (``zerosim.validate_collectives``) exchange outside the
  ledger; ``test_steps_hold_only_training_phases`` holds the ledger of a step to the phases of
  training.
- DeepSpeed stage 3's broadcasts: its parameter coordinator checks the module trace it records
  in the first micro-step with broadcasts (``assert_ints_same_as_other_ranks``, in the first
  two forwards); zerosim's ranks record the same trace and check nothing. Stage 3's broadcasts
  are compared nowhere.
Muon (MuonWithAuxAdam, with torch's AdamW as its Adam): one norm all-reduce per parameter
group (two) at stages 1-2 and per sub-group at stage 3; at stages 1-2 a split matrix's slices
all-reduced to its owners; at stage 3 the step's all-gathers of gradient and momentum chunks
(``all_gather_into_tensor``) and of each round's updates and momentums (``all_gather`` of
lists), both counted under all_gather.

Every optimizer step is compared, the first included. zerosim's stage 3 follows DeepSpeed's
coordinator (zerosim/zero/ds_coordinator.py): one coalesced all-gather per module fetch while it
records, then one per fetch and one per prefetch along the trace (prefetch bucket, live cap and
reuse distance as DeepSpeed applies them), and reduce-scatter buckets cut in DeepSpeed's hook
order. Persistent parameters (the cases that keep DeepSpeed's persistence threshold, under which
every parameter of these small models is) start partitioned, as in DeepSpeed: in the first step
they are gathered around every module's forward and backward while the trace is recorded (with
accumulation, the next micro-step gathers again those whose module's post-backward hook ran),
and from the step's end on they stay whole, refreshed by one all-gather each after every step.
"""

from __future__ import annotations

import pytest

deepspeed = pytest.importorskip("deepspeed", reason="the peer tests need DeepSpeed (test extra)")

from cases import make_case  # noqa: E402
from runner import deepspeed_step, zerosim_step  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

MLP = {"kind": "mlp", "sizes": [20, 37, 5]}  # Ψ = 967: 740, 37, 185, 5
GPT = {"kind": "gpt", "vocab": 11, "block": 8, "layers": 1, "heads": 2, "embd": 16}
ADAM = {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}}
SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
BF16 = {"bf16": {"enabled": True}}
FP16 = {"fp16": {"enabled": True, "initial_scale_power": 4}}  # no overflow in these steps
GATHERED = {"stage3_param_persistence_threshold": 0}
TRAINING_PHASES = {"forward", "backward", "step", "clip", "overflow", "muon"}
MUON = {
    "type": "Muon",
    "params": {"lr": 0.02, "adam_lr": 1e-3, "weight_decay": 0.01, "torch_adam": True},
}


def _case(name, stage, zero=None, model=MLP, optimizer=ADAM, **top):
    return make_case(name, stage, model, optimizer, 2, zero, **top)


def cases() -> list[dict]:
    out = [
        _case("s0", 0),  # gradient_clipping 1.0 by default: DeepSpeed's 4-byte norm all-reduce
        _case("s0_noclip_gas2", 0, gradient_clipping=0.0, gradient_accumulation_steps=2),
        _case("s0_bf16", 0, optimizer=SGD, **BF16),
        _case("s0_fp16_bucket37", 0, {"reduce_bucket_size": 37}, optimizer=SGD, **FP16),
        _case("s0_muon", 0, optimizer=MUON),  # one all-reduce over both groups' gradients
    ]
    for stage in (1, 2):
        s = f"s{stage}"
        out += [
            _case(s, stage),
            _case(f"{s}_bf16_gas2", stage, optimizer=SGD, gradient_accumulation_steps=2, **BF16),
            _case(f"{s}_fp16", stage, optimizer=SGD, **FP16),
            _case(f"{s}_bucket300", stage, {"reduce_bucket_size": 300}),
            _case(f"{s}_bucket37", stage, {"reduce_bucket_size": 37}),
            _case(
                f"{s}_bucket300_reduce",
                stage,
                {"reduce_bucket_size": 300, "use_multi_rank_bucket_allreduce": False},
            ),
            _case(
                f"{s}_bucket37_reduce_overlap",
                stage,
                {
                    "reduce_bucket_size": 37,
                    "use_multi_rank_bucket_allreduce": False,
                    "overlap_comm": True,
                },
            ),
            _case(  # parameter i laid out in list i mod N: each owner's slices change
                f"{s}_gpt_round_robin_reduce",
                stage,
                {
                    "round_robin_gradients": True,
                    "reduce_bucket_size": 300,
                    "use_multi_rank_bucket_allreduce": False,
                },
                model=GPT,
            ),
            _case(
                f"{s}_bucket300_no_reduce_scatter",
                stage,
                {"reduce_bucket_size": 300, "reduce_scatter": False},
            ),
            _case(
                f"{s}_bucket300_not_contiguous",
                stage,
                {"reduce_bucket_size": 300, "contiguous_gradients": False},
            ),
            _case(
                f"{s}_allgather_switches",
                stage,
                {"allgather_partitions": False, "allgather_bucket_size": 100},
            ),
            _case(
                f"{s}_no_norm",
                stage,
                {"compute_grad_norm": False},
                gradient_clipping=0.0,
            ),
            _case(
                f"{s}_bf16_no_overflow_check",
                stage,
                optimizer=SGD,
                bf16={"enabled": True, "check_grad_overflow": False},
            ),
            _case(
                f"{s}_gpt_bucket500_overlap",
                stage,
                {"reduce_bucket_size": 500, "overlap_comm": True},
                model=GPT,
            ),
            # Muon: two groups (two norm all-reduces); split matrices all-reduced to their owners
            _case(f"{s}_muon", stage, optimizer=MUON),
            _case(
                f"{s}_gpt_muon_bucket300_reduce",
                stage,
                {"reduce_bucket_size": 300, "use_multi_rank_bucket_allreduce": False},
                model=GPT,
                optimizer=MUON,
            ),
            _case(
                f"{s}_muon_bucket37_reduce_overlap",
                stage,
                {
                    "reduce_bucket_size": 37,
                    "use_multi_rank_bucket_allreduce": False,
                    "overlap_comm": True,
                },
                optimizer=MUON,
            ),
        ]
    # Stage 3 last: its zero.Init replaces torch.nn.functional.linear with DeepSpeed's
    # memory-efficient linear for the rest of the process ("This will persist unless manually
    # reset"), whose backward finishes a Linear's weight before its bias; the stage 1-2 engines
    # run after it in the same launch would fill their gradient buckets in that other order.
    return out + [
        _case("s3", 3),
        _case("s3_bf16_gas2", 3, optimizer=SGD, gradient_accumulation_steps=2, **BF16),
        _case("s3_fp16", 3, optimizer=SGD, **FP16),
        # gathered parameters: every parameter partitioned, fetched by the coordinator
        _case("s3_gathered", 3, GATHERED),
        _case("s3_gathered_bucket300", 3, {**GATHERED, "reduce_bucket_size": 300}),
        _case(  # all-reduces of the unpadded bucket (the 740-element weight alone: coalesced RS)
            "s3_gathered_bucket300_no_reduce_scatter",
            3,
            {**GATHERED, "reduce_bucket_size": 300, "reduce_scatter": False},
        ),
        _case(
            "s3_gathered_no_reduce_scatter_not_contiguous",
            3,
            {**GATHERED, "reduce_scatter": False, "contiguous_gradients": False},
        ),
        _case(
            "s3_gpt_gathered_overlap_bucket300",
            3,
            {**GATHERED, "overlap_comm": True, "reduce_bucket_size": 300},
            model=GPT,
        ),
        _case(
            "s3_gpt_gathered_prefetch100_reuse200",
            3,
            {**GATHERED, "stage3_prefetch_bucket_size": 100, "stage3_max_reuse_distance": 200},
            model=GPT,
        ),
        _case(
            "s3_gpt_gathered_live300", 3, {**GATHERED, "stage3_max_live_parameters": 300}, model=GPT
        ),
        # Muon (reduce_scatter false, DeepSpeed's rule): the step's sub-group loop
        _case("s3_muon", 3, {"reduce_scatter": False}, optimizer=MUON),
        _case(
            "s3_gpt_muon_gathered_bucket300",
            3,
            {**GATHERED, "reduce_scatter": False, "reduce_bucket_size": 300},
            model=GPT,
            optimizer=MUON,
        ),
        _case(  # sub-groups: the loop restarts at each, and each has its norm all-reduce
            "s3_gpt_muon_sub_group200",
            3,
            {"reduce_scatter": False, "sub_group_size": 200},
            model=GPT,
            optimizer=MUON,
        ),
        _case(
            "s3_gpt_gathered_live0_reuse0_gas2",
            3,
            {**GATHERED, "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0},
            model=GPT,
            gradient_accumulation_steps=2,
        ),
    ]


@pytest.fixture
def runs(peer_runs):
    """(N, {case name: results}) of this module's cases (conftest.py's ``peer_runs``: one
    launch per side and world size for every peer module)."""
    n, results = peer_runs
    return n, results[__name__]


@pytest.mark.parametrize("name", [c["name"] for c in cases()])
def test_each_steps_collectives_equal_deepspeeds(runs, name):
    n, results = runs
    case = next(c for c in cases() if c["name"] == name)
    stage = case["config"]["zero_optimization"]["stage"]
    ds, zs = results[name]["ds"], results[name]["zs"]
    for r in range(n):
        want = [deepspeed_step(s, stage) for s in ds["ranks"][r]["steps"]]
        got = [zerosim_step(s, n) for s in zs["ranks"][r]["steps"]]
        assert len(got) == len(want) == case["steps"]
        for k in range(case["steps"]):
            assert got[k] == want[k], f"rank {r}, step {k}"


def test_steps_hold_only_training_phases(runs):
    """Nothing but training's own collectives in a step's ledger: zerosim's cross-rank argument
    checks (validate_collectives, on by default) are not among them."""
    n, results = runs
    for name, r in results.items():
        for rank in range(n):
            for k, phases in enumerate(r["zs"]["ranks"][rank]["phases"]):
                assert set(phases) <= TRAINING_PHASES, (name, rank, k, phases)
