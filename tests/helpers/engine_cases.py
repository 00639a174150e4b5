"""Engine runs shared by the LocalWorld tests and the mpirun worker, and their oracle.

The oracle is a plain single-process loop, written here without the engine: the same model,
zerosim's torch-like optimizer on the whole parameters, micro-batches of m·N samples (the union of
what the N ranks see at that micro-step), gradients scaled by 1/k, and torch's clipping rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

import zerosim as zs
from zerosim import optim
from zerosim.engine import initialize
from zerosim.nn import GPT, MLP


@dataclass(frozen=True)
class Case:
    model: str = "mlp"  # "mlp" | "gpt"
    stage: int = 2
    layout: str = "deepspeed"
    accumulation: int = 1
    clip: float = 0.0
    optimizer: str = "adam"  # "adam" | "sgd" | "lamb"
    dtype: str = "float64"
    steps: int = 20
    micro: int = 2
    overlap: bool = True
    bucket: int = 50
    collectives: str = "native"
    sub_group_size: int = 10**9
    persistence: int = 0  # stage 3: stage3_param_persistence_threshold
    reuse: int = 0  # stage 3: stage3_max_reuse_distance
    prefetch: int = 50_000_000  # stage 3: stage3_prefetch_bucket_size
    max_live: int = 10**9  # stage 3: stage3_max_live_parameters
    prescale: bool = False  # prescale_gradients
    predivide: float = 1.0  # gradient_predivide_factor
    schedule: str = "deepspeed"  # zerosim.schedule: "deepspeed" or "paper"
    backend: str = "numpy"  # zerosim.backend: "numpy" or "array_api_strict"

    def with_(self, **kw) -> Case:
        return replace(self, **kw)


def build_model(case: Case):
    if case.model == "mlp":
        return MLP([6, 9, 5, 4], seed=3, dtype=case.dtype)  # 54+9+45+5+20+4 = 137 parameters
    return GPT(vocab_size=13, block_size=5, n_layer=2, n_head=2, n_embd=6, seed=3, dtype=case.dtype)


def data(case: Case, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Every sample any rank will see: steps · k · N · m of them, in global order."""
    rng = np.random.default_rng(11)
    total = case.steps * case.accumulation * n * case.micro
    if case.model == "mlp":
        return rng.standard_normal((total, 6)), rng.integers(0, 4, total)
    x = rng.integers(0, 13, (total, 5))
    return x, np.roll(x, -1, axis=1)


def optimizer_section(case: Case) -> dict:
    if case.optimizer == "adam":
        return {"type": "Adam", "params": {"lr": 3e-2, "weight_decay": 0.01}}
    if case.optimizer == "lamb":
        return {"type": "Lamb", "params": {"lr": 2e-2, "weight_decay": 0.01}}
    return {"type": "SGD", "params": {"lr": 5e-2, "momentum": 0.9}}


def reference(case: Case, n: int, grad_factor: float = 1.0) -> dict[str, np.ndarray]:
    """The single-process run on the same global batches; ``grad_factor`` multiplies each
    step's gradient before clipping (N for ``gradient_allreduce_op: "sum"``)."""
    model = build_model(case)
    params = list(model.parameters())
    if case.optimizer == "adam":  # DeepSpeed's Adam section defaults to AdamW mode
        opt = optim.AdamW(params, lr=3e-2, weight_decay=0.01)
    elif case.optimizer == "lamb":
        opt = optim.Lamb(params, lr=2e-2, weight_decay=0.01)
    else:
        opt = optim.SGD(params, lr=5e-2, momentum=0.9)
    x, y = data(case, n)
    width = n * case.micro
    for s in range(case.steps):
        for j in range(case.accumulation):
            at = (s * case.accumulation + j) * width
            model(x[at : at + width], y[at : at + width])
            model.backward(grad_scale=1.0 / case.accumulation)
        for p in params:
            p.grad *= grad_factor
        if case.clip > 0:
            norm = math.sqrt(sum(float(np.vdot(p.grad, p.grad)) for p in params))
            coef = case.clip / (norm + 1e-6)
            if coef < 1:
                for p in params:
                    p.grad *= coef
        opt.step()
        opt.zero_grad()
    return {name: p.data.copy() for name, p in model.named_parameters()}


def config(case: Case) -> dict:
    scaled = case.prescale or case.predivide != 1.0  # DeepSpeed's ZeRO-2/3: all-reduce path only
    return {
        "train_micro_batch_size_per_gpu": case.micro,
        "gradient_accumulation_steps": case.accumulation,
        "gradient_clipping": case.clip,
        "prescale_gradients": case.prescale,
        "gradient_predivide_factor": case.predivide,
        "steps_per_print": 10**6,
        "optimizer": optimizer_section(case),
        "zero_allow_untested_optimizer": case.optimizer in ("sgd", "lamb"),  # DeepSpeed's rule
        "zero_optimization": {
            "stage": case.stage,
            **({"reduce_scatter": False} if scaled and case.stage >= 2 else {}),
            "reduce_bucket_size": case.bucket,
            "overlap_comm": case.overlap,
            "sub_group_size": case.sub_group_size,
            **(
                {
                    "stage3_param_persistence_threshold": case.persistence,
                    "stage3_max_reuse_distance": case.reuse,
                    "stage3_prefetch_bucket_size": case.prefetch,
                    "stage3_max_live_parameters": case.max_live,
                }
                if case.stage == 3
                else {}
            ),
        },
        "zerosim": {
            "dtype": case.dtype,
            "layout": case.layout,
            "collectives": case.collectives,
            "schedule": case.schedule,
            "backend": case.backend,
        },
    }


def optimizer_step(engine, comm, case: Case, x, y, step: int) -> None:
    """Optimizer step ``step`` of ``case``: this rank's micro-batches of the global batch."""
    width = comm.size * case.micro
    for j in range(case.accumulation):
        at = (step * case.accumulation + j) * width + comm.rank * case.micro
        loss = engine(x[at : at + case.micro], y[at : at + case.micro])
        engine.backward(loss)
        engine.step()


def train(comm, case: Case) -> dict:
    """Train on this rank's micro-batches; return what the checks need."""
    model = build_model(case)
    engine, *_ = initialize(model, config(case), comm=comm)
    x, y = data(case, comm.size)
    steps_bytes, norm_bytes = [], []
    for s in range(case.steps):
        comm.ledger.reset()
        optimizer_step(engine, comm, case, x, y, s)
        led = comm.ledger
        steps_bytes.append(
            {ph: led.bytes_sent(phase=ph) for ph in ("forward", "backward", "step", "clip")}
        )
        norm_bytes.append(led.bytes_sent(phase="lamb_norms"))
    return {
        "params": engine.full_state_dict(),
        "memory": engine.memory_report(),
        "bytes": steps_bytes,
        "lamb_norm_bytes": norm_bytes,  # LAMB's partial-norm all-reduce (zerosim/zero/lamb.py)
        "padded": engine.strategy.padded_numel,
        "persistent": getattr(engine.strategy, "persistent_padded_numel", lambda: 0)(),
        "shard": engine.strategy.shard_numel,
        "global_steps": engine.global_steps,
    }


def max_rel_error(got: dict, want: dict) -> float:
    scale = max(float(np.abs(w).max()) for w in want.values())
    return max(float(np.abs(got[k] - want[k]).max()) for k in want) / scale


def tolerance(case: Case) -> float:
    return 1e-10 if case.dtype == "float64" else 1e-5


def stays_gathered(case: Case) -> bool | None:
    """Stage 3: whether every gathered parameter stays gathered from forward to backward (no
    backward all-gather after the first micro-step, which records the trace).

    The paper's schedule keeps a parameter when ``stage3_max_reuse_distance`` > 0. DeepSpeed's
    coordinator (schedule "deepspeed", zerosim/zero/ds_coordinator.py) also keeps every
    parameter a prefetch took a later use of: when its prefetch bucket and its live cap both
    hold the whole model, the first fetch of a micro-step prefetches everything and nothing is
    gathered again. None: DeepSpeed's schedule with smaller limits, whose calls depend on the
    trace (tests/peer/test_deepspeed_collectives.py holds them to DeepSpeed's own)."""
    if case.reuse > 0:
        return True
    if case.schedule == "paper":
        return False
    numel = sum(p.numel for _, p in build_model(case).named_parameters())
    if case.prefetch >= numel and case.max_live >= numel:
        return True
    return False if case.prefetch == 0 else None


def expected_step_bytes(case: Case, n: int, padded: int, persistent: int = 0) -> int:
    """Bytes one rank sends per optimizer step (forward + backward + step phases).

    stages 0, 1, megatron: 2(N−1)/N·Ψ_pad·b whatever k (reduction only at the boundary);
    stage 2: (k+1)(N−1)/N·Ψ_pad·b (a reduce-scatter every micro-step, one all-gather);
    stage 3 without reuse: 3k(N−1)/N·Ψ_pad·b, less 2k(N−1)/N·Ψ_persist·b for persistent
    parameters (never gathered around modules), plus (N−1)/N·Ψ_persist·b after the step.
    """
    b = np.dtype(case.dtype).itemsize
    volume = (n - 1) * padded // n * b
    if case.stage == 2:
        return (case.accumulation + 1) * volume
    if case.stage == 3:
        persist = (n - 1) * persistent // n * b
        if stays_gathered(case):  # every parameter stays gathered from forward to backward
            return 2 * case.accumulation * volume - case.accumulation * persist + persist
        return 3 * case.accumulation * volume - 2 * case.accumulation * persist + persist
    return 2 * volume


def gradient_order(case: Case) -> list[int]:
    """Parameter indices in the order backward finishes their gradients (a property of the
    model: modules last to first, each module's parameters in its ``grad_ready_order``)."""
    from zerosim.nn import GradReadyTracker

    model = build_model(case)
    index = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
    order: list[int] = []
    GradReadyTracker(model, lambda p: order.append(index[id(p)]))
    x, y = data(case, 1)
    model(x[: case.micro], y[: case.micro])
    model.backward()
    return order


def formula_bytes(case: Case, n: int, rank: int, persistent: int, padded: int) -> dict:
    """{phase: bytes ``rank`` sends} in one optimizer step, from ``zerosim.analysis`` with Ψ and
    its padding derived from the model's shapes (``shapes_padded``, not the engine's buffers):
    the paper's schedule pads to N (stage 3: each parameter), DeepSpeed's reduces in its buckets;
    Megatron's layout (its own buckets, in either schedule) moves its padded buckets."""
    from zerosim.analysis import boundary_messages, clip_bytes, norm_messages, step_bytes

    numels = [p.numel for _, p in build_model(case).named_parameters()]
    b = np.dtype(case.dtype).itemsize
    k = case.accumulation
    if case.stage == 3:
        out = step_bytes(3, n, padded, b, k, persistent, not stays_gathered(case))
    elif case.layout == "megatron":
        out = step_bytes(1, n, padded, b, k)
    elif case.schedule == "paper":
        out = step_bytes(case.stage, n, padded, b, k)
    else:
        scaled = case.prescale or case.predivide != 1.0  # config(): reduce_scatter false
        out = step_bytes(
            case.stage,
            n,
            0,
            b,
            k,
            schedule="deepspeed",
            numels=numels,
            rank=rank,
            order=gradient_order(case),
            reduce_bucket_size=case.bucket,
            reduce_scatter=not (scaled and case.stage >= 2),
            overlap_comm=case.overlap,
        )
    checks = boundary_messages(
        case.stage,
        schedule=case.schedule,
        clip=case.clip,
        float64=case.dtype == "float64",
    )
    groups = norm_messages(  # DeepSpeed's ZeRO: a norm all-reduce per (sub-)group
        case.stage,
        [numels],
        n,
        schedule=case.schedule,
        sub_group_size=case.sub_group_size,
    )
    out["clip"] = groups * clip_bytes(n, rank, checks["clip"]) if "clip" in checks else 0
    return out


def expected_memory(case: Case, n: int, padded: int, states: int) -> dict:
    """Model-state bytes per rank from zerosim.analysis (the parameter is its own master)."""
    b = np.dtype(case.dtype).itemsize
    return zs_analysis_memory(padded, n, case.stage, b, states)


def zs_analysis_memory(padded, n, stage, b, states):
    from zerosim.analysis import full_precision_model_states

    m = full_precision_model_states(padded, n, stage, dtype_bytes=b, num_states=states)
    return {"params": m.params, "grads": m.grads, "optimizer_states": m.optimizer_states}


def shapes_padded(case: Case, n: int) -> tuple[int, int]:
    """(Ψ_pad, Ψ_persist) from the model's shapes and the config, not the engine's buffers:
    stage 3 pads each parameter to a multiple of N and keeps whole those of at most
    ``stage3_param_persistence_threshold`` elements; DeepSpeed 0.19.8's stages 1-2 pad the flat
    buffer to a multiple of 2N (its ``nccl_start_alignment_factor`` of 2), the paper's schedule
    and stage 0 to N; Megatron-LM's distributed optimizer lays the parameters last to first,
    closes a bucket at the first parameter boundary at or past ``reduce_bucket_size`` elements
    and pads each bucket to a multiple of lcm(N, 128)."""
    numels = [p.numel for _, p in build_model(case).named_parameters()]
    if case.stage == 3:
        padded = [-(-m // n) * n for m in numels]
        persist = sum(pad for m, pad in zip(numels, padded, strict=True) if m <= case.persistence)
        return sum(padded), persist
    if case.layout == "megatron":
        align, total, run = math.lcm(n, 128), 0, 0
        for i, m in enumerate(reversed(numels)):
            run += m
            if run >= case.bucket or i == len(numels) - 1:
                total, run = total + -(-run // align) * align, 0
        return total, 0
    multiple = 2 * n if case.schedule == "deepspeed" and case.stage in (1, 2) else n
    return -(-sum(numels) // multiple) * multiple, 0


def check_case(comm, case: Case, out: dict | None = None) -> float:
    """Train under ``comm`` (or take ``out``, a ``train`` result) and assert parity, bytes and
    memory; return the relative error."""
    out = train(comm, case) if out is None else out
    n = comm.size
    padded, persistent = shapes_padded(case, n)
    assert out["persistent"] == persistent, (case, n, out["persistent"], persistent)
    assert out["padded"] == padded, (case, n, out["padded"], padded)
    err = max_rel_error(out["params"], reference(case, n))
    assert err <= tolerance(case), (case, n, err)
    per_phase = formula_bytes(case, n, comm.rank, persistent, padded)
    want = sum(per_phase[p] for p in ("forward", "backward", "step"))
    # DeepSpeed's trace decides the gathers; with reduce_scatter off (prescale or predivide),
    # its bucket sizes decide which buckets are all-reduced: both are held to DeepSpeed's own
    # log by tests/peer/test_deepspeed_collectives.py
    scaled = case.prescale or case.predivide != 1.0
    ds3 = case.stage == 3 and case.schedule == "deepspeed"
    if ds3 and scaled:
        check_memory(case, n, out)
        return err
    if case.stage == 3 and stays_gathered(case) is None:
        # what DeepSpeed's coordinator gathers again lies between gathering nothing again in
        # backward and gathering everything again (after the recording micro-step)
        low, high = (_stage3_total(case, n, persistent, regather) for regather in (False, True))
        for step, phases in enumerate(out["bytes"]):
            got = phases["forward"] + phases["backward"] + phases["step"]
            extra = _recording_bytes(case, n, out) if step == 0 else 0
            assert low <= got <= high + extra, (case, n, step, low, got, high, extra)
        check_memory(case, n, out)
        return err
    if case.schedule == "paper" or case.stage == 3 or case.layout == "megatron":
        assert want == expected_step_bytes(case, n, padded, persistent)
    regather = not (case.stage == 3 and stays_gathered(case))
    for step, phases in enumerate(out["bytes"]):
        got = phases["forward"] + phases["backward"] + phases["step"]
        assert phases["clip"] == per_phase["clip"], (case, n, phases, per_phase)
        if not regather and step == 0:  # the first micro-step records the trace: no reuse yet
            once = _recording_bytes(case, n, out)
            assert got == want + once, (case, n, phases, want, once)
            continue
        assert got == want, (case, n, step, phases, want)
        assert phases == per_phase, (case, n, phases, per_phase)
    check_memory(case, n, out)
    return err


def _recording_bytes(case: Case, n: int, out: dict) -> int:
    """Stage 3: what the first micro-step, which records the trace, gathers beyond a step that
    reuses: every partitioned parameter again for backward, and under DeepSpeed's schedule the
    persistent parameters both ways as well."""
    b = np.dtype(case.dtype).itemsize
    padded, persistent = shapes_padded(case, n)
    once = (n - 1) * (padded - persistent) // n * b
    if case.schedule == "deepspeed":
        once += 2 * (n - 1) * persistent // n * b
    return once


def _stage3_total(case: Case, n: int, persistent: int, regather: bool) -> int:
    """Stage 3's bytes per optimizer step (forward + backward + step) from zerosim.analysis,
    with Ψ padded per parameter from the model's shapes, gathering again for backward or not."""
    from zerosim.analysis import step_bytes

    numels = [p.numel for _, p in build_model(case).named_parameters()]
    padded = sum(-(-m // n) * n for m in numels)
    b = np.dtype(case.dtype).itemsize
    out = step_bytes(3, n, padded, b, case.accumulation, persistent, regather)
    return sum(out[p] for p in ("forward", "backward", "step"))


def check_memory(case: Case, n: int, out: dict) -> None:
    """The model-state bytes each rank holds, and the number of optimizer steps taken."""
    mem = out["memory"]
    states = 2 if case.optimizer in ("adam", "lamb") else 1
    padded, persistent = shapes_padded(case, n)
    want_mem = expected_memory(case, n, padded, states)
    got_states = sum(v for k, v in mem.items() if k.startswith("optimizer_state."))
    if case.stage == 3:  # persistent parameters are whole on every rank, reported apart
        assert mem["persistent_params"] == persistent * np.dtype(case.dtype).itemsize
    assert (mem["params"], mem["grads"], got_states) == (
        want_mem["params"],
        want_mem["grads"],
        want_mem["optimizer_states"],
    ), (case, n, mem, want_mem)
    assert out["global_steps"] == case.steps


__all__ = ["Case", "check_case", "train", "reference", "zs"]


def train_on(comm, case: Case, extra: dict | None = None, save_to: str | None = None) -> dict:
    """Train ``case`` (its config merged with ``extra``) on this rank's micro-batches; with
    ``save_to``, save a checkpoint halfway, train on, then load it back into a new engine and
    train the second half again (so the result includes a save/load round trip). Returns the
    full parameters (host arrays), the ledger's bytes, the crossings per step, and where the
    parameters live."""
    from zerosim.backend import crossings

    cfg = config(case)
    for key, value in (extra or {}).items():
        section = cfg.setdefault(key, {})
        if isinstance(value, dict) and isinstance(section, dict):
            section.update(value)
        else:
            cfg[key] = value
    x, y = data(case, comm.size)

    def run(engine, steps):
        before = crossings().as_dict()
        for s in steps:
            optimizer_step(engine, comm, case, x, y, s)
        after = crossings().as_dict()
        return {k: after[k] - before[k] for k in after}

    comm.ledger.reset()
    engine, *_ = initialize(build_model(case), cfg, comm=comm)
    devices = {str(getattr(p.data, "device", "cpu")) for p in engine.module.parameters()}
    half = case.steps // 2 if save_to else case.steps
    moved = run(engine, range(half))
    if save_to:
        engine.save_checkpoint(save_to, tag="half")
        run(engine, range(half, case.steps))  # trained on, then thrown away
        engine, *_ = initialize(build_model(case), cfg, comm=comm)
        engine.load_checkpoint(save_to, tag="half")
        run(engine, range(half, case.steps))
    return {
        "params": engine.full_state_dict(),
        "bytes": comm.ledger.bytes_sent(),
        "crossings": moved,
        "devices": devices,
        "steps": half,
    }
