"""Loss scalers against DeepSpeed's rules, the overflow check, and the config → scaler mapping.

The expected tables below were worked out by hand from DeepSpeed 0.19.8's ``DynamicLossScaler``
rules (docs/mixed_precision.md writes them out); the property test re-derives them from a
different formulation: "grow on the good step that follows every ``window`` overflow-free steps
in a row". At the end, DeepSpeed's own scalers are the oracle on random overflow sequences.
"""

from __future__ import annotations

import json
import logging
import types

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zerosim.config import load_config
from zerosim.zero.loss_scaler import (
    DynamicLossScaler,
    LossScaleError,
    LossScaler,
    build_loss_scaler,
    has_inf_or_nan,
    overflow_flag,
    scaler_from_state_dict,
)

# --- update rule: hand-worked tables ------------------------------------------------------

# One row per step: "G" (no overflow) or "O" (overflow), then (scale, hysteresis) after it.
# Window 2: the scale doubles on the 3rd good step in a row (2 good steps, then one more).
WINDOW2_HYST2 = "GGGOOGGGOGOOGGG"
WINDOW2_HYST2_PLAIN = [
    (16, 2), (16, 2), (32, 2), (32, 1), (16, 1), (16, 1), (16, 1), (32, 2),
    (32, 1), (32, 1), (16, 1), (8, 1), (8, 1), (8, 1), (16, 2),
]  # fmt: skip
# Consecutive hysteresis refills on every good step: step 10's overflow is absorbed again.
WINDOW2_HYST2_CONSECUTIVE = [
    (16, 2), (16, 2), (32, 2), (32, 1), (16, 1), (16, 2), (16, 2), (32, 2),
    (32, 1), (32, 2), (32, 1), (16, 1), (16, 2), (16, 2), (32, 2),
]  # fmt: skip
# Window 3, hysteresis 1, init 4, min 1, no error at the minimum: steps 7-8 sit at 1.
WINDOW3_HYST1 = "GGGGOGOOOGGGG"
WINDOW3_HYST1_SCALES = [4, 4, 4, 8, 4, 4, 2, 1, 1, 1, 1, 1, 2]


def run(scaler: DynamicLossScaler, steps: str) -> list[tuple[float, int]]:
    out = []
    for step in steps:
        scaler.update_scale(step == "O")
        out.append((scaler.loss_scale, scaler.cur_hysteresis))
    return out


@pytest.mark.parametrize(
    "consecutive, expected",
    [(False, WINDOW2_HYST2_PLAIN), (True, WINDOW2_HYST2_CONSECUTIVE)],
)
def test_window_2_hysteresis_2_follows_deepspeed_table(consecutive, expected):
    scaler = DynamicLossScaler(
        16, scale_window=2, delayed_shift=2, consecutive_hysteresis=consecutive
    )
    assert run(scaler, WINDOW2_HYST2) == expected
    assert scaler.cur_iter == len(WINDOW2_HYST2)


def test_window_3_hysteresis_1_halves_at_once_and_holds_at_minimum():
    scaler = DynamicLossScaler(4, scale_window=3, delayed_shift=1, raise_error_at_min_scale=False)
    got = run(scaler, WINDOW3_HYST1)
    assert [scale for scale, _ in got] == WINDOW3_HYST1_SCALES
    assert all(hysteresis == 1 for _, hysteresis in got)


@pytest.mark.parametrize("consecutive", [False, True])
def test_window_1000_grows_on_the_clean_step_after_1000_clean_steps(consecutive):
    scaler = DynamicLossScaler(
        2.0**16, scale_window=1000, delayed_shift=2, consecutive_hysteresis=consecutive
    )
    assert run(scaler, "G" * 1000)[-1] == (2**16, 2)
    assert run(scaler, "G") == [(2**17, 2)]
    assert run(scaler, "O") == [(2**17, 1)]
    # Only growth refills a non-consecutive hysteresis; any clean step a consecutive one.
    assert run(scaler, "G" * 1000)[-1] == (2**17, 2 if consecutive else 1)
    assert run(scaler, "G") == [(2**18, 2)]
    assert run(scaler, "G" * 999)[-1] == (2**18, 2)
    assert run(scaler, "G") == [(2**19, 2)]  # 1000 more good steps: the next doubling
    assert run(scaler, "OO") == [(2**19, 1), (2**18, 1)]
    assert scaler.cur_iter == 1000 + 1 + 1 + 1000 + 1 + 999 + 1 + 2


def test_default_dynamic_scaler_is_the_fp16_sections():
    scaler = DynamicLossScaler()
    assert (scaler.loss_scale, scaler.scale_factor, scaler.scale_window) == (2.0**16, 2.0, 1000)
    assert (scaler.min_scale, scaler.delayed_shift, scaler.cur_hysteresis) == (1.0, 2, 2)
    assert not scaler.consecutive_hysteresis and scaler.raise_error_at_min_scale
    scaler.update_scale(True)  # hysteresis 2: the first overflow only uses it up
    assert (scaler.loss_scale, scaler.cur_hysteresis) == (2.0**16, 1)
    scaler.update_scale(True)
    assert scaler.loss_scale == 2.0**15


def test_scale_factor_other_than_two_divides_and_clamps_to_minimum():
    scaler = DynamicLossScaler(
        100.0,
        scale_factor=10.0,
        scale_window=1,
        min_scale=3.0,
        delayed_shift=1,
        raise_error_at_min_scale=False,
    )
    assert [s for s, _ in run(scaler, "OOOGG")] == [10.0, 3.0, 3.0, 3.0, 30.0]


def test_static_scale_never_changes():
    scaler = LossScaler(128.0)
    for overflow in [True, False] * 600:
        scaler.update_scale(overflow)
    assert scaler.loss_scale == 128.0 and not scaler.dynamic


# --- property: the table rules restated as "clean steps in a row" ------------------------


def reference_scales(steps, init, window, min_scale, hysteresis, consecutive):
    scale, budget, clean_in_a_row, out = float(init), hysteresis, 0, []
    for overflow in steps:
        if overflow:
            clean_in_a_row = 0
            if budget > 1:
                budget -= 1
            else:
                scale = max(scale / 2, min_scale)
        else:
            clean_in_a_row += 1
            if consecutive:
                budget = hysteresis
            if clean_in_a_row > 1 and (clean_in_a_row - 1) % window == 0:
                budget, scale = hysteresis, scale * 2
        out.append((scale, budget))
    return out


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(st.booleans(), max_size=60),
    window=st.integers(1, 5),
    hysteresis=st.integers(1, 3),
    consecutive=st.booleans(),
    power=st.integers(0, 6),
)
def test_dynamic_scaler_matches_clean_run_formulation(
    steps, window, hysteresis, consecutive, power
):
    scaler = DynamicLossScaler(
        2.0**power,
        scale_window=window,
        min_scale=0.5,
        delayed_shift=hysteresis,
        consecutive_hysteresis=consecutive,
        raise_error_at_min_scale=False,
    )
    got = run(scaler, "".join("O" if o else "G" for o in steps))
    assert got == reference_scales(steps, 2.0**power, window, 0.5, hysteresis, consecutive)


# --- the minimum -------------------------------------------------------------------------


def test_overflow_at_minimum_raises_with_scale_minimum_and_advice():
    scaler = DynamicLossScaler(4, scale_window=3, delayed_shift=1)
    run(scaler, WINDOW3_HYST1[:8])
    assert scaler.loss_scale == 1.0
    with pytest.raises(LossScaleError, match=r"1\.0 == min_loss_scale 1\.0") as caught:
        scaler.update_scale(True)
    assert isinstance(caught.value, RuntimeError)
    assert "learning rate" in str(caught.value) and "bf16" in str(caught.value)
    assert (scaler.loss_scale, scaler.cur_iter) == (1.0, 8)  # nothing moved


def test_hysteresis_delays_the_minimum_error():
    scaler = DynamicLossScaler(1.0, delayed_shift=3)
    assert run(scaler, "OO") == [(1.0, 2), (1.0, 1)]
    with pytest.raises(LossScaleError):
        scaler.update_scale(True)


# --- state_dict --------------------------------------------------------------------------


@pytest.mark.parametrize("consecutive", [False, True])
def test_state_dict_round_trip_mid_sequence_continues_the_table(consecutive):
    expected = WINDOW2_HYST2_CONSECUTIVE if consecutive else WINDOW2_HYST2_PLAIN
    scaler = DynamicLossScaler(
        16, scale_window=2, delayed_shift=2, consecutive_hysteresis=consecutive
    )
    run(scaler, WINDOW2_HYST2[:7])
    state = json.loads(json.dumps(scaler.state_dict()))
    rebuilt = scaler_from_state_dict(state)
    reloaded = DynamicLossScaler()  # different settings: the checkpoint's win
    reloaded.load_state_dict(state)
    for restored in (rebuilt, reloaded):
        assert type(restored) is DynamicLossScaler
        assert run(restored, WINDOW2_HYST2[7:]) == expected[7:]


def test_static_state_round_trip_and_kind_mismatch_is_rejected():
    state = LossScaler(64.0).state_dict()
    assert scaler_from_state_dict(state).loss_scale == 64.0
    with pytest.raises(ValueError, match="'static'"):
        DynamicLossScaler().load_state_dict(state)
    with pytest.raises(ValueError, match="must be one of"):
        scaler_from_state_dict({"type": "adaptive"})


def test_incomplete_state_leaves_scaler_untouched():
    scaler = DynamicLossScaler(8.0)
    state = DynamicLossScaler(2.0).state_dict()
    del state["cur_hysteresis"]
    with pytest.raises(ValueError, match="cur_hysteresis"):
        scaler.load_state_dict(state)
    state = {**DynamicLossScaler(2.0).state_dict(), "scale_window": 0}
    with pytest.raises(ValueError, match="scale_window"):
        scaler.load_state_dict(state)
    assert scaler.loss_scale == 8.0


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"init_scale": 0}, "init_scale"),
        ({"init_scale": float("inf")}, "init_scale"),
        ({"scale_factor": 1.0}, "scale_factor"),
        ({"scale_window": 0}, "scale_window"),
        ({"scale_window": True}, "scale_window"),
        ({"min_scale": -1}, "min_scale"),
        ({"delayed_shift": 0}, "delayed_shift"),
    ],
)
def test_bad_scaler_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DynamicLossScaler(**kwargs)


# --- overflow check ----------------------------------------------------------------------

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("size, where", [(1, 0), (10, 0), (10, 5), (10, 9), (1000, 999)])
@pytest.mark.parametrize("block_size", [3, 1 << 20])
def test_has_inf_or_nan_finds_one_bad_element_anywhere(dtype, bad, size, where, block_size):
    x = np.linspace(-2, 2, size).astype(dtype)
    assert not has_inf_or_nan(x, block_size)
    x[where] = bad
    assert has_inf_or_nan(x, block_size)
    assert has_inf_or_nan(x.reshape(-1, 1), block_size)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_largest_finite_values_are_not_an_overflow(dtype):
    x = np.full(4096, ml_dtypes.finfo(dtype).max, dtype=dtype)
    x[::2] *= -1
    x[1] = ml_dtypes.finfo(dtype).max
    assert not has_inf_or_nan(x, block_size=100)
    if np.dtype(dtype) == np.float16:  # what a same-dtype sum check would get wrong
        with np.errstate(over="ignore"):
            assert np.isinf(np.sum(np.abs(x), dtype=np.float16))


def test_strided_view_checks_only_its_own_elements():
    base = np.zeros((6, 8), dtype=np.float16)
    base[2, 3] = np.inf  # an odd column: outside the view
    view = base[:, ::2]
    assert not has_inf_or_nan(view, block_size=4)
    base[5, 6] = np.nan
    assert has_inf_or_nan(view, block_size=4)
    assert has_inf_or_nan(view.T, block_size=4)


def test_scalar_and_empty_arrays():
    assert has_inf_or_nan(np.array(np.nan, dtype=ml_dtypes.bfloat16))
    assert not has_inf_or_nan(np.array(1.0, dtype=np.float32))
    assert not has_inf_or_nan(np.zeros((0, 5), dtype=np.float16))


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    size=st.integers(1, 300),
    dtype=st.sampled_from(DTYPES),
    block_size=st.integers(1, 64),
)
def test_has_inf_or_nan_equals_any_bad_position(data, size, dtype, block_size):
    positions = data.draw(st.lists(st.integers(0, size - 1), max_size=3))
    values = data.draw(st.lists(st.sampled_from([np.inf, -np.inf, np.nan]), min_size=3))
    x = np.arange(size, dtype=np.float32).astype(dtype)
    for position, value in zip(positions, values, strict=False):
        x[position] = value
    assert has_inf_or_nan(x, block_size) == bool(positions)


def test_overflow_flag_is_one_if_any_slice_overflowed():
    clean = np.ones(7, dtype=np.float16)
    dirty = np.ones(7, dtype=ml_dtypes.bfloat16)
    dirty[3] = np.inf
    assert overflow_flag([clean, None, clean]) == 0.0
    assert overflow_flag([clean, None, dirty]) == 1.0
    assert overflow_flag([]) == 0.0
    assert isinstance(overflow_flag([dirty]), float)


# --- config → scaler ---------------------------------------------------------------------


def scaler_for(fp16: dict | None, stage: int, **extra):
    config = {"train_batch_size": 8, "zero_optimization": {"stage": stage}, **extra}
    if fp16 is not None:
        config["fp16"] = {"enabled": True, **fp16}
    return build_loss_scaler(load_config(config, 1).loss_scaler())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fp16_enabled_alone_gives_deepspeeds_scaler_at_stages_1_to_3(stage):
    scaler = scaler_for({}, stage)
    assert type(scaler) is DynamicLossScaler
    assert (scaler.loss_scale, scaler.scale_window, scaler.min_scale) == (2.0**16, 1000, 1.0)
    assert (scaler.delayed_shift, scaler.consecutive_hysteresis) == (2, False)
    assert scaler.raise_error_at_min_scale
    assert run(scaler, "OO") == [(2**16, 1), (2**15, 1)]  # hysteresis 2


def test_fp16_at_stage_0_has_no_hysteresis_and_no_error_at_the_minimum():
    """DeepSpeed's FP16_Optimizer: every overflow halves, floored at min_loss_scale."""
    scaler = scaler_for({"hysteresis": 3, "initial_scale_power": 2, "min_loss_scale": 2}, 0)
    assert (scaler.loss_scale, scaler.delayed_shift, scaler.min_scale) == (4.0, 1, 2.0)
    assert [scale for scale, _ in run(scaler, "OOOO")] == [2.0, 2.0, 2.0, 2.0]


def test_one_dynamic_key_keeps_the_other_defaults():
    scaler = scaler_for({"loss_scale_window": 2}, 2)
    assert (scaler.loss_scale, scaler.delayed_shift, scaler.min_scale) == (2.0**16, 2, 1.0)
    assert run(scaler, "OGGG") == [(2**16, 1), (2**16, 1), (2**16, 1), (2**17, 2)]


def test_all_dynamic_keys_are_passed_through():
    fp16 = {
        "initial_scale_power": 8,
        "loss_scale_window": 50,
        "hysteresis": 3,
        "consecutive_hysteresis": True,
        "min_loss_scale": 2,
    }
    scaler = scaler_for(fp16, 3)
    assert (scaler.loss_scale, scaler.scale_window, scaler.min_scale) == (256.0, 50, 2.0)
    assert (scaler.delayed_shift, scaler.consecutive_hysteresis) == (3, True)


@pytest.mark.parametrize("stage", [0, 2])
def test_static_fp16_scale_and_no_fp16_give_fixed_scalers(stage):
    static = scaler_for({"loss_scale": 128}, stage)
    assert type(static) is LossScaler and static.loss_scale == 128.0
    assert scaler_for(None, stage).loss_scale == 1.0
    bf16 = scaler_for(None, stage, bf16={"enabled": True})
    assert type(bf16) is LossScaler and bf16.loss_scale == 1.0


def test_build_loss_scaler_rejects_other_objects():
    with pytest.raises(TypeError, match="LossScaleSettings"):
        build_loss_scaler({"dynamic": True})


# --- DeepSpeed's own scalers as the oracle -------------------------------------------------


def _deepspeed_fp16(monkeypatch):
    """DeepSpeed's loss-scaler module, its rank query answered without a process group."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is the oracle (pip install -e '.[test]')")
    import deepspeed.comm
    from deepspeed.runtime.fp16 import loss_scaler

    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *args, **kwargs: 0)
    return loss_scaler


class _Lines(logging.Handler):
    """The messages a logger emits, for comparing log lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _drive(scaler, overflows):
    """(scale, hysteresis, skipped so far) after each step, and the step that raised, if any."""
    trace, skipped = [], 0
    for step, overflow in enumerate(overflows):
        try:
            scaler.update_scale(overflow)
        except Exception:  # DeepSpeed: Exception; zerosim: LossScaleError
            return trace, step
        skipped += overflow
        trace.append((scaler.cur_scale, scaler.cur_hysteresis, skipped))
    return trace, None


SEQUENCES = [
    # (seed, overflow probability, window, hysteresis, consecutive, power, min scale, raise)
    (seed, p, window, hysteresis, consecutive, power, min_scale, raises)
    for seed, (p, window, hysteresis, consecutive, power, min_scale, raises) in enumerate(
        [
            (0.05, 1, 1, False, 16, 1, True),
            (0.05, 3, 2, False, 16, 1, True),
            (0.2, 3, 2, True, 8, 1, True),
            (0.3, 2, 3, False, 4, 1, False),
            (0.3, 2, 3, True, 4, 1, False),
            (0.5, 5, 1, False, 6, 2, True),
            (0.5, 5, 2, True, 6, 2, False),
            (0.01, 50, 2, False, 16, 1, True),
            (0.6, 1, 4, True, 3, 1, True),
            (0.1, 7, 1, True, 12, 4, False),
        ]
        * 3
    )
]


@pytest.mark.parametrize(
    "seed, p, window, hysteresis, consecutive, power, floor, raises", SEQUENCES
)
def test_dynamic_scaler_equals_deepspeeds_on_random_overflows(
    monkeypatch, seed, p, window, hysteresis, consecutive, power, floor, raises
):
    """Scale, hysteresis, skipped steps, the step that raises at the minimum scale, and the log
    lines (DeepSpeed's, without its '[deepspeed]' and 'Rank 0' prefixes), over 3,000 steps."""
    loss_scaler = _deepspeed_fp16(monkeypatch)
    from deepspeed.utils import logger as ds_logger

    overflows = list(np.random.default_rng(seed).random(3000) < p)
    settings_ = dict(
        init_scale=2.0**power,
        scale_window=window,
        min_scale=floor,
        delayed_shift=hysteresis,
        consecutive_hysteresis=consecutive,
        raise_error_at_min_scale=raises,
    )
    ours_log, theirs_log = _Lines(), _Lines()
    zs_logger = logging.getLogger("zerosim.zero.loss_scaler")
    levels = zs_logger.level, ds_logger.level
    for logger, handler in ((zs_logger, ours_log), (ds_logger, theirs_log)):
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
    try:
        ours = _drive(DynamicLossScaler(**settings_), overflows)
        theirs = _drive(loss_scaler.DynamicLossScaler(**settings_), overflows)
    finally:
        for logger, handler, level in zip(
            (zs_logger, ds_logger), (ours_log, theirs_log), levels, strict=True
        ):
            logger.removeHandler(handler)
            logger.setLevel(level)
    assert ours == theirs
    assert any(o for o in overflows[: len(ours[0])])  # the sequence exercised the overflow path
    ds_lines = [
        line.replace("[deepspeed] ", "").replace("Rank 0 ", "") for line in theirs_log.lines
    ]
    assert ours_log.lines == ds_lines and ds_lines


@pytest.mark.parametrize(
    "fp16",
    [
        {},
        {"hysteresis": 3, "consecutive_hysteresis": True},
        {"initial_scale_power": 5, "loss_scale_window": 4, "min_loss_scale": 2},
    ],
)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_config_builds_the_scaler_deepspeed_builds_at_each_stage(monkeypatch, fp16, stage):
    """The fp16 section → scaler mapping against DeepSpeed's: at stages 1-3 the
    DynamicLossScaler ``CreateLossScaler`` builds from ``dynamic_loss_scale_args()``, at stage 0
    ``FP16_Optimizer._update_scale`` on the ``LossScaleConfig`` the engine builds."""
    loss_scaler = _deepspeed_fp16(monkeypatch)
    import torch
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    section = DeepSpeedFP16Config(enabled=True, **fp16)
    overflows = list(np.random.default_rng(stage).random(2000) < 0.3)
    ours = scaler_for(fp16, stage)
    if stage > 0:
        theirs = loss_scaler.CreateLossScaler(
            torch.half, 0, True, section.dynamic_loss_scale_args()
        )
        assert _drive(ours, overflows) == _drive(theirs, overflows)
        return
    state = loss_scaler.LossScaleConfig(
        torch.half, True, 0, section.dynamic_loss_scale_args(),
        initial_dynamic_scale=section.initial_dynamic_scale(),
    )  # fmt: skip
    optimizer = types.SimpleNamespace(loss_scale_config=state, verbose=False)
    for step, overflow in enumerate(overflows):
        ours.update_scale(overflow)
        FP16_Optimizer._update_scale(optimizer, overflow)
        assert ours.loss_scale == state.cur_scale, step
