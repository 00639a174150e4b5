"""PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``, torch 2.13 on gloo) as the oracle of
zerosim's FSDP2 schedule (``"zerosim": {"schedule": "fsdp2"}`` at stage 3).

The same case (cases.py: model, initial weights, data) runs on torch's side under torchrun
(fsdp2_driver.py: ``fully_shard`` on each transformer block, then the root, as a torch user
writes it) and on zerosim's under mpirun (zs_driver.py), one launch per side per N = 2 and 3.

First torch's side is held to what does not come from it:

- every collective it issues, in order, equals a closed form derived here from the model's
  shapes and FSDP2's rules (``expected_step``): per unit (each block, then the root) one
  all-gather of N · Σ ceil(dim0/N) · prod(rest) elements in param_dtype, one reduce-scatter of as
  many in reduce_dtype (ReduceOp.AVG: FSDP2 divides by N inside the collective on gloo for fp32
  and bf16), the root not resharded after forward, backward prefetch of the unit before, the
  clipping norm as one all-reduce of one float32 per parameter (DTensor's partial norms);
- ``CommDebugMode`` counts the same calls as the recorder (two witnesses of one step);
- in fp32 its losses, norms and weights equal one process of plain torch over the global batch
  (every rank's micro-batches, each loss divided by N · accumulation steps), so the sharding,
  the division and the accumulation are those of data parallelism;
- each rank's shard is rows [r·c, (r+1)·c) of dim 0 of the full weight, c = ceil(dim0/N).

Then zerosim's side equals torch's: losses, full weights and each rank's shard, gradient norms,
and every collective (kind, dtype, buffer bytes, order, group size, and the same calls in the same
group). Bounds, and why:

- fp32: both sides run the same arithmetic in another order (NumPy against torch's kernels, an
  MPI reduce-scatter against gloo's), so losses differ by float32 rounding: ``FP32_LOSS_RTOL`` =
  1e-6; weights after Adam to ``ATOL`` = 1e-5, as tests/peer/test_deepspeed_parity.py argues for
  its GPT (Adam's m/√v divides each element's rounding by its own small gradient), and the one
  component no loss can see (the attention key bias, unseen.py) within what Adam can move it;
  norms to 1e-5 relative (a sum of squares in another order).
- bf16 param_dtype with fp32 reduce_dtype (SGD, which does not normalise the update, so rounding
  stays rounding): both forwards run in bf16 and round different intermediates, so losses agree
  to a few bf16 ulps (``BF16_LOSS_RTOL`` = 3·2⁻⁸, the ulp of [0.5, 1) being 2⁻⁸), the fp32
  sharded weights to ``BF16_ATOL`` = 4 bf16 ulps of weights in [0.125, 0.25), 4·2⁻¹⁰, and the
  norm (of bf16 gradients) to ``BF16_LOSS_RTOL``.
- collectives: exactly.

The N = 4 cases oversubscribe this machine's cores and are left out of the default run:
``ZEROSIM_PEER_N4=1`` runs ``test_n4_*``. HSDP (``replicate`` 2 on a 2 × 2 mesh: the closed form
gains one all-reduce across replicas after each reduce-scatter) and ``reshard_after_forward`` 2
(after forward each block keeps a shard of a group of 2 ranks, and backward gathers it there:
2 · Σ ceil(dim0/2) · prod(rest) elements).
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the FSDP2 peer tests need torch (test extra)")

from cases import gas, micro_batch, model_of, twin_of  # noqa: E402
from runner import run_fsdp2_side, run_zerosim_side  # noqa: E402
from unseen import assert_weight_equal  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

FP32_LOSS_RTOL = 1e-6
ATOL = 1e-5
NORM_RTOL = 1e-5
BF16_LOSS_RTOL = 3 * 2.0**-8
BF16_ATOL = 4 * 2.0**-10
GPT = {"kind": "gpt", "vocab": 11, "block": 8, "layers": 2, "heads": 2, "embd": 16}
ADAM = {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}}
SGD = {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
# the interface's defaults (the zerosim.fsdp2 section), written here, not read from the driver
DEFAULTS = {
    "reshard_after_forward": True,
    "param_dtype": None,
    "reduce_dtype": None,
    "replicate": 1,
    "reshard_after_backward": True,
    "reduce_every_micro_batch": False,
}
BYTES = {"float32": 4, "bfloat16": 2}


def _case(name, fsdp2=None, optimizer=ADAM, steps=3, **top):
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": optimizer,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3},
        "zerosim": {"schedule": "fsdp2", "fsdp2": fsdp2 or {}},
        **top,
    }
    if optimizer["type"] == "SGD":
        config["zero_allow_untested_optimizer"] = True
    return {"name": name, "steps": steps, "model": GPT, "config": config}


BF16 = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}


def cases() -> list[dict]:
    return [
        _case("fp32"),
        _case("bf16_reduce_fp32", BF16, optimizer=SGD),
        # the bf16 gradients of the first micro-batch upcast to fp32, the second's added there
        _case("bf16_reduce_fp32_gas2", BF16, optimizer=SGD, gradient_accumulation_steps=2),
        _case("no_reshard_after_forward", {"reshard_after_forward": False}),
        _case("gas2", gradient_accumulation_steps=2),
        _case(
            "gas2_keep_gathered", {"reshard_after_backward": False}, gradient_accumulation_steps=2
        ),
        _case("clip", gradient_clipping=0.05),  # the norm is ~0.8: every step clips
        # torch's default: no set_requires_gradient_sync(False), every micro-batch reduces.
        # SGD: the two sides add the micro-batches' averaged rows in their own order, and Adam
        # turns a last-bit difference of a near-zero gradient into up to lr (1.3e-5 seen)
        _case("gas2_reduce_every", {"reduce_every_micro_batch": True}, optimizer=SGD,
              gradient_accumulation_steps=2),
    ]  # fmt: skip


def n4_cases() -> list[dict]:
    return [
        _case("hsdp_2x2", {"replicate": 2}),
        _case("hsdp_2x2_clip_gas2", {"replicate": 2}, gradient_clipping=0.05,
              gradient_accumulation_steps=2),
        _case("reshard_to_2", {"reshard_after_forward": 2}),
        _case("reshard_to_2_gas2_keep", {"reshard_after_forward": 2,
                                         "reshard_after_backward": False},
              gradient_accumulation_steps=2),
    ]  # fmt: skip


CASES = {c["name"]: c for c in cases() + n4_cases()}
NAMES = [c["name"] for c in cases()]
FP32_NAMES = [c["name"] for c in cases() if "bf16" not in c["name"]]


@pytest.fixture(scope="module", params=[2, 3], ids=["N2", "N3"])
def torch_runs(request, tmp_path_factory):
    """(N, {case: torch's results}): one torchrun launch per N for every case."""
    n = request.param
    return n, run_fsdp2_side(n, cases(), tmp_path_factory.mktemp(f"fsdp2_{n}"))


@pytest.fixture(scope="module")
def zerosim_runs(torch_runs, tmp_path_factory):
    """(N, {case: {"torch": ..., "zs": ...}}): zerosim's side of the same plan, one mpirun
    launch per N."""
    n, torch_results = torch_runs
    zs = run_zerosim_side(n, cases(), tmp_path_factory.mktemp(f"fsdp2_zs_{n}"))
    return n, {name: {"torch": torch_results[name], "zs": zs[name]} for name in torch_results}


# --- the closed form of torch's collectives, from the model's shapes -------------------------


def settings_of(case: dict) -> dict:
    return {**DEFAULTS, **case["config"]["zerosim"]["fsdp2"]}


def units_of(case: dict) -> dict[str, list[tuple[int, ...]]]:
    """{unit: its parameters' shapes}: "blocks.i" for each block's parameters, "root" for the
    rest (what ``fully_shard`` on each block, then on the model, leaves to each)."""
    units: dict[str, list[tuple[int, ...]]] = {"root": []}
    for name, value in model_of(case).state_dict().items():
        parts = name.split(".")
        unit = f"blocks.{parts[1]}" if parts[0] == "blocks" else "root"
        units.setdefault(unit, []).append(tuple(np.shape(value)))
    return units


def padded_numel(shapes: list[tuple[int, ...]], shard: int) -> int:
    """FSDP2's unit buffer: each parameter padded to ceil(dim0/shard) rows on each of the shard
    group's ranks, N · Σ ceil(dim0/N) · prod(rest)."""
    return shard * sum(math.ceil(s[0] / shard) * math.prod(s[1:]) for s in shapes)


def expected_step(case: dict, n: int, rank: int) -> list[dict]:
    """The collectives of one optimizer step on ``rank``, in order (module docstring)."""
    s = settings_of(case)
    replicate = int(s["replicate"])
    shard = n // replicate
    pdt = s["param_dtype"] or "float32"
    rdt = s["reduce_dtype"] or pdt
    shard_ranks = [rank // shard * shard + i for i in range(shard)]
    replica_ranks = [rank % shard + i * shard for i in range(replicate)]
    units = units_of(case)
    blocks = sorted((u for u in units if u != "root"), key=lambda u: int(u.split(".")[1]))
    numel = {u: padded_numel(shapes, shard) for u, shapes in units.items()}
    # the group a block is resharded to after forward: none (False, or an int 1), the shard
    # group (True, or its size), or that many consecutive ranks of it
    after_forward = s["reshard_after_forward"]
    after_forward = shard * after_forward if isinstance(after_forward, bool) else after_forward
    after_forward = 0 if after_forward == 1 else after_forward
    calls: list[dict] = []

    def gather(unit, size):
        group = [rank // size * size + i for i in range(size)]
        elements = padded_numel(units[unit], size)
        calls.append({"op": "all_gather", "dtype": pdt, "bytes": elements * BYTES[pdt],
                      "reduce": None, "ranks": group})  # fmt: skip

    def reduce(unit):
        calls.append({"op": "reduce_scatter", "dtype": rdt, "bytes": numel[unit] * BYTES[rdt],
                      "reduce": "avg", "ranks": shard_ranks})  # fmt: skip
        if replicate > 1:  # HSDP: the reduced shard averaged across the replicas
            calls.append({"op": "all_reduce", "dtype": rdt,
                          "bytes": numel[unit] // shard * BYTES[rdt], "reduce": "avg",
                          "ranks": replica_ranks})  # fmt: skip

    gathered: set[str] = set()
    for micro in range(gas(case)):
        last = micro == gas(case) - 1
        for unit in ["root", *blocks]:  # forward
            if unit not in gathered:
                gather(unit, shard)
                gathered.add(unit)
        if after_forward:  # the blocks; the root stays gathered for backward
            gathered -= set(blocks)
        for k in reversed(range(len(blocks))):  # backward, last block first
            for unit in blocks[k : k + 1] + blocks[max(k - 1, 0) : k]:  # itself, then prefetch
                if unit not in gathered:
                    gather(unit, after_forward)
                    gathered.add(unit)
            if last or s["reduce_every_micro_batch"]:
                reduce(blocks[k])
            if last or s["reshard_after_backward"]:
                gathered.discard(blocks[k])
        if last or s["reduce_every_micro_batch"]:
            reduce("root")
        if last or s["reshard_after_backward"]:
            gathered.discard("root")
    if case["config"]["gradient_clipping"] > 0:  # clip_grad_norm_: the parameters' partial norms
        parameters = sum(len(shapes) for shapes in units.values())
        calls.append({"op": "all_reduce", "dtype": "float32", "bytes": 4 * parameters,
                      "reduce": "sum", "ranks": shard_ranks})  # fmt: skip
    return calls


def check_torch_closed_form(n: int, results: dict, names: list[str]) -> None:
    for name in names:
        for r, rank in enumerate(results[name]["ranks"]):
            want = expected_step(CASES[name], n, r)
            for step, got in enumerate(rank["steps"]):
                assert got == want, f"{name} rank {r} step {step}"


def check_debug_counts(results: dict, names: list[str]) -> None:
    for name in names:
        for rank in results[name]["ranks"]:
            for calls, counted in zip(rank["steps"], rank["debug_counts"], strict=True):
                recorded: dict[str, int] = {}
                for call in calls:
                    recorded[call["op"]] = recorded.get(call["op"], 0) + 1
                assert recorded == counted, name


# --- torch's side on its own ------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_torch_collectives_equal_the_closed_form_from_the_shapes(torch_runs, name):
    n, results = torch_runs
    check_torch_closed_form(n, results, [name])


def test_the_recorder_sees_every_call_comm_debug_mode_counts(torch_runs):
    """Two witnesses of one step: the wrapped functions and torch's CommDebugMode (a dispatch
    mode over the c10d ops) count the same calls of each kind."""
    _, results = torch_runs
    check_debug_counts(results, NAMES)


def test_each_rank_holds_the_dim0_rows_of_its_shard(torch_runs):
    """FSDP2's Shard(0): rank r holds rows [r·c, (r+1)·c) of each parameter, c = ceil(dim0/N),
    fewer (or none) at the end; the padding is not in the local tensor."""
    n, results = torch_runs
    for name in NAMES:
        full, shards = results[name]["weights"], results[name]["shards"]
        for key, w in full.items():
            c = math.ceil(w.shape[0] / n)
            for r in range(n):
                np.testing.assert_array_equal(shards[r][key], w[r * c : (r + 1) * c], key)


def one_process_reference(case: dict, n: int) -> tuple[list[list[float]], list[float], dict]:
    """Plain torch, one process: every rank's micro-batches in one backward of Σ loss / (N·g),
    then the same clipping and optimizer. Returns per-rank losses, norms and the weights."""
    from fsdp2_driver import optimizer_of

    twin = twin_of(case, model_of(case))
    optimizer = optimizer_of(case["config"], twin.parameters())
    clip, g = case["config"]["gradient_clipping"], gas(case)
    losses: list[list[float]] = [[] for _ in range(n)]
    norms = []
    for step in range(case["steps"]):
        for micro in range(g):
            for r in range(n):
                x, y = micro_batch(case, step, micro, r)
                loss = twin(torch.tensor(x), torch.tensor(y))
                (loss / (n * g)).backward()
                losses[r].append(float(loss.detach()))
        grads = [p.grad for p in twin.parameters()]
        if clip > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(twin.parameters(), clip)))
        else:
            norms.append(float(torch.nn.utils.get_total_norm(grads)))
        optimizer.step()
        optimizer.zero_grad()
    weights = {k: v.detach().numpy().copy() for k, v in twin.named_parameters()}
    return losses, norms, weights


def check_one_process(n: int, results: dict, name: str) -> None:
    case = CASES[name]
    losses, norms, weights = one_process_reference(case, n)
    for r, rank in enumerate(results[name]["ranks"]):
        np.testing.assert_allclose(rank["losses"], losses[r], rtol=FP32_LOSS_RTOL)
        np.testing.assert_allclose(rank["norms"], norms, rtol=NORM_RTOL)
    for key, want in weights.items():
        assert_weight_equal(case, key, results[name]["weights"][key], want, ATOL)


@pytest.mark.parametrize("name", FP32_NAMES)
def test_torch_fsdp2_equals_one_process_torch_over_the_global_batch(torch_runs, name):
    """fp32: FSDP2's average over the ranks (ReduceOp.AVG on gloo), its accumulation without
    gradient sync, and its clipping over DTensors equal plain data parallelism."""
    n, results = torch_runs
    check_one_process(n, results, name)


# --- zerosim's side against torch's -----------------------------------------------------------


def check_losses_weights_shards(n: int, pair: dict, case: dict) -> None:
    bf16 = settings_of(case)["param_dtype"] == "bfloat16"
    rtol, atol = (BF16_LOSS_RTOL, BF16_ATOL) if bf16 else (FP32_LOSS_RTOL, ATOL)
    want_side, got_side = pair["torch"], pair["zs"]
    for r in range(n):
        want, got = want_side["ranks"][r]["losses"], got_side["ranks"][r]["losses"]
        assert len(got) == len(want), f"rank {r}: {len(got)} losses, torch {len(want)}"
        np.testing.assert_allclose(got, want, rtol=rtol, err_msg=f"rank {r}")
    assert sorted(got_side["weights"]) == sorted(want_side["weights"])
    for key, want in want_side["weights"].items():
        assert_weight_equal(case, key, got_side["weights"][key], want, atol)
    shard = n // int(settings_of(case)["replicate"])
    for r in range(n):
        shards = got_side["shards"][r]
        assert shards is not None, (
            f"rank {r}: zerosim wrote no shards (zs_driver.py saves "
            "engine.strategy.local_shards(), "
            "this rank's rows of each parameter, as torch's DTensor.to_local())"
        )
        for key, want in want_side["shards"][r].items():
            assert shards[key].shape == want.shape, f"{key} on rank {r}"
            c, i = math.ceil(got_side["weights"][key].shape[0] / shard), r % shard
            np.testing.assert_array_equal(shards[key], got_side["weights"][key][i * c : i * c + c])


def check_collectives(n: int, pair: dict, name: str) -> None:
    """Kind, dtype, buffer bytes and group size of every call in order; and one zerosim group
    for each group of torch's, the same calls in it."""
    for r in range(n):
        torch_steps = pair["torch"]["ranks"][r]["steps"]
        zs_steps = pair["zs"]["ranks"][r]["calls"]
        assert len(zs_steps) == len(torch_steps), f"{name} rank {r}: optimizer steps"
        groups: dict[tuple[int, ...], str] = {}
        for step, (want, got) in enumerate(zip(torch_steps, zs_steps, strict=True)):
            short = [(c["op"], c["dtype"], c["bytes"], len(c["ranks"])) for c in want]
            mine = [(c["op"], c["dtype"], c["bytes"], c["peers"]) for c in got]
            assert mine == short, f"{name} rank {r} step {step}"
            for w, g in zip(want, got, strict=True):
                named = groups.setdefault(tuple(w["ranks"]), g["group"])
                assert named == g["group"], f"{name} rank {r} step {step}: {w} in {g['group']}"
        assert len(set(groups.values())) == len(groups), f"{name}: torch's groups {groups}"


@pytest.mark.parametrize("name", NAMES)
def test_losses_weights_and_shards_equal_torchs(zerosim_runs, name):
    n, results = zerosim_runs
    check_losses_weights_shards(n, results[name], CASES[name])


@pytest.mark.parametrize("name", NAMES)
def test_gradient_norms_equal_torchs(zerosim_runs, name):
    """With clipping, the norm ``clip_grad_norm_`` returns. Without, training takes no norm on
    torch's side (and so no all-reduce: the collectives test holds zerosim to that too), so
    zerosim may report none (None); a norm it does report is torch's."""
    n, results = zerosim_runs
    rtol = BF16_LOSS_RTOL if "bf16" in name else NORM_RTOL
    clipping = CASES[name]["config"]["gradient_clipping"] > 0
    for r in range(n):
        want, got = results[name]["torch"]["ranks"][r]["norms"], results[name]["zs"]["ranks"][r]
        if not clipping and all(norm is None for norm in got["norms"]):
            continue
        np.testing.assert_allclose(got["norms"], want, rtol=rtol, err_msg=f"rank {r}")


@pytest.mark.parametrize("name", NAMES)
def test_collectives_equal_torchs_call_for_call(zerosim_runs, name):
    n, results = zerosim_runs
    check_collectives(n, results[name], name)


# --- N = 4: HSDP and resharding to 2 ranks (opt-in: oversubscribes this machine) -------------

N4 = pytest.mark.skipif(
    os.environ.get("ZEROSIM_PEER_N4") != "1",
    reason="the N = 4 cases oversubscribe this machine: ZEROSIM_PEER_N4=1 runs them (module doc)",
)


@pytest.fixture(scope="module")
def n4_runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("fsdp2_n4")
    torch_side = run_fsdp2_side(4, n4_cases(), work)
    try:
        zs = run_zerosim_side(4, n4_cases(), work)
    except RuntimeError as error:  # torch's side is still checked below
        zs = error
    return torch_side, zs


@N4
def test_n4_torch_collectives_equal_the_closed_form(n4_runs):
    torch_side, _ = n4_runs
    names = [c["name"] for c in n4_cases()]
    check_torch_closed_form(4, torch_side, names)
    check_debug_counts(torch_side, names)


@N4
@pytest.mark.parametrize("name", [c["name"] for c in n4_cases()])
def test_n4_torch_equals_one_process_torch_over_the_global_batch(n4_runs, name):
    """HSDP's reduce-scatter and all-reduce across replicas, and resharding to 2 ranks, are
    still data parallelism over the 4 ranks' batches."""
    torch_side, _ = n4_runs
    check_one_process(4, torch_side, name)


@N4
@pytest.mark.parametrize("name", [c["name"] for c in n4_cases()])
def test_n4_equals_torchs(n4_runs, name):
    torch_side, zs = n4_runs
    if isinstance(zs, RuntimeError):
        raise zs
    pair = {"torch": torch_side[name], "zs": zs[name]}
    check_losses_weights_shards(4, pair, CASES[name])
    check_collectives(4, pair, name)
