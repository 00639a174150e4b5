"""Memory formulas: ZeRO Table 1, Megatron's table, exact per-category bytes, offload."""

from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest

from zerosim.analysis import memory as mem

# Table 1 of Rajbhandari et al. 2020 (arXiv:1910.02054), as printed: per-device GB for
# (P_os, P_os+g, P_os+g+p) at N_d = 1, 4, 16, 64, 256, 1024.
PAPER_TABLE1 = {
    "7.5B": [
        ("120", "120", "120"),
        ("52.5", "41.3", "30"),
        ("35.6", "21.6", "7.5"),
        ("31.4", "16.6", "1.88"),
        ("30.4", "15.4", "0.47"),
        ("30.1", "15.1", "0.12"),
    ],
    "128B": [
        ("2048", "2048", "2048"),
        ("896", "704", "512"),
        ("608", "368", "128"),
        ("536", "284", "32"),
        ("518", "263", "8"),
        ("513", "257", "2"),
    ],
    "1T": [
        ("16000", "16000", "16000"),
        ("7000", "5500", "4000"),
        ("4750", "2875", "1000"),
        ("4187", "2218", "250"),
        ("4046", "2054", "62.5"),
        ("4011", "2013", "15.6"),
    ],
}
DP = (1, 4, 16, 64, 256, 1024)

# Megatron-LM docs, distributed optimizer: bytes/param non-distributed, distributed = a + b/d.
PAPER_MEGATRON = {
    ("fp16", "fp16"): (20, 4, 16),
    ("bf16", "fp32"): (18, 6, 12),
    ("fp32", "fp32"): (16, 8, 8),
}


def _cells():
    rows = {(r.model, r.dp_degree): r for r in mem.table1()}
    for model, printed_rows in PAPER_TABLE1.items():
        for n, printed in zip(DP, printed_rows, strict=True):
            r = rows[(model, n)]
            for value, text in zip((r.p_os, r.p_os_g, r.p_os_g_p), printed, strict=True):
                yield model, n, value, text


def test_table1_reproduces_all_54_printed_numbers():
    cells = list(_cells())
    assert len(cells) == 54
    wrong = [
        (m, n, mem.format_paper_gb(v), t) for m, n, v, t in cells if mem.format_paper_gb(v) != t
    ]
    assert wrong == []


def test_paper_gb_of_an_exact_byte_count_keeps_every_digit():
    """A byte count over 10^9 as a Fraction: truncated exactly, past a float's 16 digits and
    past Decimal's 28 (which raised InvalidOperation)."""
    assert mem.format_paper_gb(Fraction(16 * 123456789012345678, 10**9)) == "1975308624"
    assert mem.format_paper_gb(Fraction(10**40 + 999_999_999, 10**9)) == "1" + "0" * 31
    assert mem.format_paper_gb(Fraction(41_250_000_000, 10**9)) == "41.3"


def test_table1_values_lie_in_the_printed_rounding_interval():
    # ≥ 100 GB the paper truncates (4187.5 → 4187); below it rounds to the last printed digit.
    for model, n, value, text in _cells():
        printed = Decimal(text)
        exact = Decimal(repr(value))
        if printed >= 100:
            assert printed <= exact < printed + 1, (model, n, text, value)
        else:
            half_unit = Decimal(1).scaleb(printed.as_tuple().exponent) / 2
            assert abs(exact - printed) <= half_unit, (model, n, text, value)


def test_table1_baseline_is_16_psi_and_equals_the_nd1_row():
    for r in mem.table1():
        assert r.baseline == pytest.approx(16 * r.num_params / 1e9, rel=1e-15)
    first = next(r for r in mem.table1() if r.model == "7.5B" and r.dp_degree == 1)
    assert first.baseline == first.p_os == first.p_os_g == first.p_os_g_p == 120


def test_table1_in_docs_matches_the_code():
    docs = Path(__file__).resolve().parents[1] / "docs" / "formulas.md"
    assert mem.table1_markdown() in docs.read_text()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_mixed_precision_adam_categories_sum_to_the_paper_formula(stage, n):
    psi = 24 * 1000  # divisible by every n: padded Ψ
    expected = {
        0: 16 * psi,
        1: 4 * psi + 12 * psi // n,
        2: 2 * psi + 14 * psi // n,
        3: 16 * psi // n,
    }[stage]
    m = mem.zero_model_states(psi, n, stage)
    assert m.total == expected
    assert mem.zero_paper_bytes(psi, n, stage) == expected
    assert isinstance(m.total, int)


def test_stage2_categories_by_hand():
    m = mem.zero_model_states(1000, 4, 2)
    # 16-bit params whole, 16-bit grads / 4, fp32 master / 4, Adam m and v fp32 / 4.
    assert m.as_dict() == {
        "params": 2000,
        "grads": 500,
        "master_params": 1000,
        "master_grads": 0,
        "optimizer_states": 2000,
        "total": 5500,
    }


@pytest.mark.parametrize("dtype_bytes", [4, 8])
@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_full_precision_training_has_no_master_copy(dtype_bytes, k, n):
    psi, b = 12 * 7, dtype_bytes
    expected = {
        0: (1 + 1 + k) * psi * b,
        1: 2 * psi * b + k * psi * b // n,
        2: psi * b + (1 + k) * psi * b // n,
        3: (2 + k) * psi * b // n,
    }
    for stage, total in expected.items():
        m = mem.full_precision_model_states(psi, n, stage, dtype_bytes=b, num_states=k)
        assert m.total == total
        assert m.master_params == 0


def test_unpadded_psi_gives_the_exact_fraction():
    m = mem.zero_model_states(10, 3, 3)
    assert m.params == pytest.approx(20 / 3, rel=1e-15)
    assert m.total == pytest.approx(160 / 3, rel=1e-15)


def test_optimizer_offload_moves_master_and_states_off_the_device():
    m = mem.zero_model_states(800, 8, 2, offload_optimizer="cpu")
    assert m.split() == {"device": 1600 + 200, "host": 400 + 800, "nvme": 0}
    nv = mem.zero_model_states(800, 8, 3, offload_optimizer="nvme", offload_param="cpu")
    assert nv.split() == {"device": 200, "host": 200, "nvme": 1200}
    assert nv.total == sum(nv.split().values()) == 16 * 800 // 8


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"stage": 4}, "stage"),
        ({"stage": 2, "offload_param": "cpu"}, "offload_param"),
        ({"stage": 0, "offload_optimizer": "cpu"}, "offload_optimizer"),
        ({"stage": 1, "offload_optimizer": "gpu"}, "offload_optimizer"),
        ({"stage": 1, "dp_degree": 0}, "dp_degree"),
        ({"stage": 1, "num_params": -5}, "num_params"),
        ({"stage": 1, "num_params": 2.5}, "num_params"),
        ({"stage": 1, "num_states": -1}, "num_states"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, word):
    args = {"num_params": 100, "dp_degree": 4, **kwargs}
    with pytest.raises(ValueError, match=word):
        mem.zero_model_states(**args)


def test_megatron_table_matches_megatron_docs():
    table = {
        (r.param_dtype, r.grad_dtype): (r.non_distributed, r.replicated, r.sharded)
        for r in mem.megatron_table()
    }
    assert table == PAPER_MEGATRON


@pytest.mark.parametrize("d", [1, 2, 3, 4, 8])
def test_megatron_per_rank_bytes_follow_a_plus_b_over_d(d):
    psi = 24 * 100
    sizes = {("fp16", "fp16"): (2, 2), ("bf16", "fp32"): (2, 4), ("fp32", "fp32"): (4, 4)}
    for key, (_, a, b) in PAPER_MEGATRON.items():
        p_bytes, g_bytes = sizes[key]
        m = mem.megatron_model_states(psi, d, param_bytes=p_bytes, grad_bytes=g_bytes)
        assert m.total == a * psi + b * psi // d
        assert m.params + m.grads == a * psi  # replicated part
    assert mem.megatron_model_states(psi, 1).total == 20 * psi
