"""zerosim's reproduction of DeepSpeed's memory estimators against DeepSpeed's own functions
(numbers and printed tables) on a grid; the side-by-side with the exact model."""

import itertools
import logging

import pytest

from zerosim.analysis import estimators as est

GIB = 2**30


def _gib_rows(rows):
    return [(f"{r.cpu_bytes / GIB:.2f}", f"{r.gpu_bytes / GIB:.2f}") for r in rows]


def _deepspeed_estimators():
    """DeepSpeed's own estimator functions (the oracle of every number below)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is the oracle (pip install -e '.[test]')")
    from deepspeed.runtime.zero import stage3, stage_1_and_2

    return stage_1_and_2, stage3


# (total params, largest layer, GPUs per node, nodes, buffer factor): published model sizes
# (DeepSpeed's docs table: 2851M / 32M; t5-small: 60,506,624 / 32128·512), odd counts that
# truncate, and node counts that do not divide evenly.
GRID = [
    (psi, layer, gpus, nodes, factor)
    for psi, layer in ((2851e6, 32e6), (60_506_624, 32128 * 512), (1e9, 1e8), (1001, 7), (7, 0))
    for gpus in (1, 3, 8)
    for nodes in (1, 2, 5)
    for factor in (1.0, 1.5)
]


@pytest.mark.parametrize("psi, layer, gpus, nodes, factor", GRID)
def test_estimators_equal_deepspeeds_functions(psi, layer, gpus, nodes, factor):
    zero2, zero3 = _deepspeed_estimators()
    for offload in (True, False):
        args = (psi, gpus, nodes, offload, factor)
        ours = est.estimate_zero2_model_states_mem_needs(*args)
        assert ours == zero2.estimate_zero2_model_states_mem_needs(*args)
    for offload, offload_params, zero_init in itertools.product([True, False], repeat=3):
        args = (psi, layer, gpus, nodes, offload, offload_params, zero_init, factor)
        ours = est.estimate_zero3_model_states_mem_needs(*args)
        theirs = zero3.estimate_zero3_model_states_mem_needs(*args)
        assert ours == theirs and [type(v) for v in ours[:2]] == [int, int]


@pytest.mark.parametrize("psi, layer, gpus, nodes, factor", GRID[::4])
def test_all_cold_tables_print_deepspeeds_lines(psi, layer, gpus, nodes, factor, capsys):
    """The rows of DeepSpeed's printed tables (its header aside), byte for byte, once its
    str-enum spelling ('OffloadDeviceEnum.cpu' for 'cpu ') is normalised."""
    zero2, zero3 = _deepspeed_estimators()
    tables = [
        (
            est.estimate_zero2_model_states_mem_needs_all_cold(psi, gpus, nodes, factor),
            lambda: zero2.estimate_zero2_model_states_mem_needs_all_cold(psi, gpus, nodes, factor),
        ),
        (
            est.estimate_zero3_model_states_mem_needs_all_cold(psi, layer, gpus, nodes, factor),
            lambda: zero3.estimate_zero3_model_states_mem_needs_all_cold(
                psi, layer, gpus, nodes, factor
            ),
        ),
    ]
    for rows, deepspeed_table in tables:
        capsys.readouterr()
        deepspeed_table()
        printed = capsys.readouterr().out.replace("OffloadDeviceEnum.cpu", "cpu ").splitlines()
        assert est.format_estimates(rows).splitlines() == printed[3:]


def test_zero2_cold_uses_the_current_code_not_the_old_docs():
    rows = est.estimate_zero2_model_states_mem_needs_all_cold(2851e6, 8, 1)
    # No offload: the current code's 2Ψ + int(18Ψ/8) = 11.28 GiB; DeepSpeed's docs still print
    # 15.93 GiB, the older 4Ψ + 16Ψ/N.
    assert _gib_rows(rows)[1] == ("127.45", "11.28")


def test_zero2_truncates_like_deepspeed():
    # Ψ = 1001, N = 4: 18·1001/4 = 4504.5 → 4504; gpu = 2002 + 4504
    assert est.estimate_zero2_model_states_mem_needs(1001, 4, 1, False)[1] == 6506


def test_buffer_factor_scales_only_the_cpu_side():
    base = est.estimate_zero3_model_states_mem_needs(1e9, 1e8, 8, 1, True, False, True, 1.0)
    more = est.estimate_zero3_model_states_mem_needs(1e9, 1e8, 8, 1, True, False, True, 2.0)
    assert more[0] == 2 * base[0] == 32_000_000_000
    assert more[1] == base[1]


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize(
    "cpu_offload, offload_params", [(False, False), (True, False), (True, True)]
)
@pytest.mark.parametrize("zero_init", [True, False])
def test_comparison_terms_add_up_to_deepspeeds_estimate(
    stage, cpu_offload, offload_params, zero_init
):
    for c in est.compare_with_exact(
        2851e6, 32e6, 8, 2, stage, cpu_offload, offload_params, zero_init
    ):
        assert c.exact + sum(t.bytes for t in c.terms) == pytest.approx(c.deepspeed, abs=1e-3)


def test_comparison_names_the_18_vs_16_bytes_and_the_largest_layer():
    gpu, cpu = est.compare_with_exact(2851e6, 32e6, 8, 1, stage=3)
    terms = {t.name: t.bytes for t in gpu.terms}
    assert gpu.exact == 16 * 2851e6 / 8  # the paper's 16Ψ/N
    assert terms["largest layer"] == 128e6
    assert terms["fp32 gradients"] == pytest.approx(2 * 2851e6 / 8)
    assert (
        cpu.exact == 0
        and cpu.deepspeed
        == est.estimate_zero3_model_states_mem_needs(2851e6, 32e6, 8, 1, False, False)[0]
    )
    text = est.format_comparison([gpu, cpu])
    assert "6.09 GiB" in text and "5.31 GiB" in text


def test_all_cold_logs_the_table(caplog):
    with caplog.at_level(logging.INFO, logger="zerosim.analysis.estimators"):
        est.estimate_zero2_model_states_mem_needs_all_cold(2851e6, 8, 1)
    assert "127.45GB |   5.31GB | offload_optimizer=cpu" in caplog.text


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"num_gpus_per_node": 0}, "num_gpus_per_node"),
        ({"num_nodes": 1.5}, "num_nodes"),
        ({"total_params": -1}, "total_params"),
        ({"additional_buffer_factor": 0}, "additional_buffer_factor"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, word):
    args = {"total_params": 1e9, **kwargs}
    with pytest.raises(ValueError, match=word):
        est.estimate_zero2_model_states_mem_needs(**args)


def test_compare_rejects_stage_1():
    with pytest.raises(ValueError, match="stage"):
        est.compare_with_exact(1e9, stage=1)
