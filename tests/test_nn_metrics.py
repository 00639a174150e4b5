"""Composer's training metrics (``zerosim.nn.metrics``) against torch, and the kernels they are
on a GPU.

The values: ``torch.nn.functional.cross_entropy`` of the logits cast to float32 (what bf16
autocast runs for ``torch.nn.CrossEntropyLoss``: ``log_softmax`` is on its float32 list),
summed over the targets that are not -100, and exp of the mean for perplexity. The bytes:
torch's cast reads 2 and writes 4 bytes a bf16 logit, its log-softmax reads and writes 4.
"""

from __future__ import annotations

import math
from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from zerosim import meta, nn
from zerosim.comm import LocalWorld
from zerosim.dryrun.run import recipe, run_world
from zerosim.nn.metrics import METRICS

BF16 = ml_dtypes.bfloat16
TIMES = ("time_s", "algbw_GBps", "busbw_GBps")  # the wall clock's, not the calls'
rng = np.random.default_rng(7)


def logits_and_targets(shape, vocab):
    z = (rng.standard_normal((*shape, vocab)) * 3).astype(BF16)
    t = rng.integers(0, vocab, shape)
    t.flat[::5] = -100  # every fifth target ignored
    return z, t


def torch_sum(z, t):
    """Composer's update as torch runs it under bf16 autocast."""
    logits = torch.from_numpy(z.astype(np.float32)).to(torch.bfloat16)
    flat = logits.float().reshape(-1, z.shape[-1])
    return F.cross_entropy(flat, torch.from_numpy(t).reshape(-1), reduction="sum").item()


def test_cross_entropy_and_perplexity_over_micro_batches_match_torch():
    batches = [logits_and_targets((2, 6), 11), logits_and_targets((3, 4), 11)]
    ce, ppl = nn.LanguageCrossEntropy(), nn.LanguagePerplexity()
    for z, t in batches:
        ce.update(z, t)
        ppl.update(z, t)
    total = sum(torch_sum(z, t) for z, t in batches)
    counted = sum(int((t != -100).sum()) for _, t in batches)
    assert ce.total_items == ppl.total_items == counted
    assert float(ce.sum_loss) == pytest.approx(total, rel=1e-6)
    assert float(ce.compute()) == pytest.approx(total / counted, rel=1e-6)
    assert float(ppl.compute()) == pytest.approx(math.exp(total / counted), rel=1e-6)
    assert ce.compute().dtype == np.float32  # the sum's dtype, as torchmetrics' state


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_computed_over_ranks_it_is_the_metric_of_every_ranks_targets(ranks):
    """``compute(comm)``: torch's cross-entropy summed over every rank's micro-batches and
    divided by every rank's counted targets (not the mean of the ranks' means: the ranks count
    different numbers of targets here); each rank's own sums stay its own."""
    batches = [
        [logits_and_targets((2, 5 + r), 13), logits_and_targets((1, 3), 13)] for r in range(ranks)
    ]

    def rank(comm):
        ce, ppl = nn.LanguageCrossEntropy(), nn.LanguagePerplexity()
        for z, t in batches[comm.rank]:
            ce.update(z, t)
            ppl.update(z, t)
        own = float(ce.compute())
        return float(ce.compute(comm)), float(ppl.compute(comm)), own, float(ce.compute())

    total = sum(torch_sum(z, t) for b in batches for z, t in b)
    counted = sum(int((t != -100).sum()) for b in batches for _, t in b)
    for r, (ce, ppl, own, after) in enumerate(LocalWorld(ranks).run(rank)):
        assert ce == pytest.approx(total / counted, rel=1e-6)
        assert ppl == pytest.approx(math.exp(total / counted), rel=1e-6)
        mine = sum(torch_sum(z, t) for z, t in batches[r])
        assert (
            own
            == after
            == pytest.approx(mine / sum(int((t != -100).sum()) for _, t in batches[r]), rel=1e-6)
        )


def test_reset_forgets_every_update():
    metric = nn.LanguageCrossEntropy()
    z, t = logits_and_targets((2, 4), 7)
    metric.update(z, t)
    metric.reset()
    assert math.isnan(metric.compute())
    metric.update(z, t)
    assert float(metric.compute()) == pytest.approx(
        torch_sum(z, t) / int((t != -100).sum()), rel=1e-6
    )


def test_the_metric_of_a_models_kept_logits_is_its_loss():
    """A model that keeps its output (``keep_output``) hands a trainer the logits its loss was
    computed from: with no target ignored the metric's mean is that loss (computed apart)."""
    net = nn.Transformer("mpt-125m-tiny")
    net.keep_output = True
    x = rng.integers(0, net.vocab_size, (2, 8))
    loss = net(x, x)
    net.backward()
    metric = nn.LanguageCrossEntropy()
    with nn.no_grad():
        metric.update(net.output, x)
    assert net.output.shape == (2, 8, net.vocab_size)
    assert float(metric.compute()) == pytest.approx(float(loss), rel=1e-6)
    first = net.output
    net(x, x)
    assert net.output is not first  # the next forward's logits replace them


def test_a_model_keeps_no_output_unless_asked():
    net = nn.Transformer("mpt-125m-tiny")
    x = rng.integers(0, net.vocab_size, (1, 4))
    net(x, x)
    assert net.output is None


def test_the_update_leaves_the_logits_as_they_were():
    z, t = logits_and_targets((3, 5), 7)
    before = z.copy()
    nn.LanguageCrossEntropy().update(z, t)
    assert np.array_equal(z.view(np.uint16), before.view(np.uint16))


@pytest.mark.parametrize("name", sorted(METRICS))
def test_nothing_counted_is_nan(name):
    assert math.isnan(METRICS[name]().compute())


def test_a_recipe_naming_an_unknown_metric_is_refused_naming_the_allowed():
    with pytest.raises(ValueError, match=r"\['Accuracy'\] are not metrics; allowed: \['Lang"):
        replace(recipe("mpt-125m-tiny"), metrics=("LanguagePerplexity", "Accuracy"))


@pytest.mark.parametrize(
    "logits, target, match",
    [
        (np.zeros(5, np.float32), np.zeros((), np.int64), r"logits \(\.\.\., C\).*\(5,\)"),
        (np.zeros((2, 3, 5), np.float32), np.zeros((2, 4), np.int64), r"target \(2, 4\)"),
        (np.zeros((2, 5), np.float32), np.zeros(2, np.float32), "integers; got float32"),
    ],
)
def test_bad_input_is_refused_naming_it(logits, target, match):
    error = TypeError if "integers" in match else ValueError
    with pytest.raises(error, match=match):
        nn.LanguagePerplexity().update(logits, target)


def test_on_a_gpu_an_update_is_torchs_cast_and_log_softmax_kernels():
    """Under the "torch" backend: the cast of the (R, V) bf16 logits reads 2 and writes 4 bytes
    each, the log-softmax one kernel reading and writing 4; what is left reads a row's entry."""
    rows, vocab = 12, 40
    kernels = []
    with meta.tracking(backend="torch") as tracker:
        z = meta.NAMESPACE.zeros((rows, vocab), "bfloat16")
        t = meta.NAMESPACE.zeros((rows,), np.int64)
        tracker.listeners.append(
            lambda kind, n, name: kernels.append((name, n)) if kind == "op" else None
        )
        with nn.no_grad():
            nn.LanguageCrossEntropy().update(z, t)
    assert kernels[0] == ("astype", rows * vocab * (2 + 4))
    assert ("log_softmax", rows * vocab * (4 + 4)) in kernels
    rest = [n for name, n in kernels[1:] if name != "log_softmax"]
    assert sum(rest) < rows * vocab  # the targets' entries and the sums: a row's worth each


def test_a_dry_runs_metrics_are_two_kernels_a_micro_batch_and_their_sync():
    """A bf16 MPT at stage 3 on 2 ranks, 3 micro-batches of 2 × 64 tokens over a vocabulary of
    128: with Composer's two metrics each micro-batch adds a cast and a log-softmax per metric,
    at least 28 bytes a logit in all (2 + 4 and 4 + 4 per metric), the same FLOPs and the same
    collectives but the metrics' sync after each step (torchmetrics: per metric and state, a
    barrier and an all-gather of one value: 4 of each a step, two float32 and two int64
    gathers), and a peak higher by the kept bf16 logits (2 bytes each) and a few scalars; the
    step starts with the last step's logits still held (Composer's ``state.outputs``)."""
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 3,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
    }
    base = recipe("mpt-125m-tiny")
    logits = 2 * base.desc.seq * base.desc.vocab
    runs = {}
    for metrics in ((), tuple(METRICS)):
        (_, run), *_ = run_world(replace(base, metrics=metrics), 2, cfg, backend="torch")[0]
        runs[metrics] = run
    plain, measured = runs[()], runs[tuple(METRICS)]
    assert measured.tracker["ops"]["log_softmax"] == 2 * 3
    assert "log_softmax" not in plain.tracker["ops"]
    added = measured.tracker["op_bytes"] - plain.tracker["op_bytes"]
    assert 3 * logits * 28 <= added < 3 * logits * 29
    assert measured.step_flops == plain.step_flops
    calls = [{k: v for k, v in c.items() if k not in TIMES} for c in measured.comm.ledger.summary()]
    assert [c for c in calls if c["phase"] != "metrics"] == [
        {k: v for k, v in c.items() if k not in TIMES} for c in plain.comm.ledger.summary()
    ]
    steps = measured.last_step + 1  # ledger steps from 0
    synced = sorted((c["op"], c["dtype"], c["calls"], c["elements"]) for c in calls
                    if c["phase"] == "metrics")  # fmt: skip
    assert synced == [
        ("all_gather", "float32", 2 * steps, 2 * 2 * steps),
        ("all_gather", "int64", 2 * steps, 2 * 2 * steps),
        ("barrier", "uint8", 4 * steps, 0),
    ]
    raised = measured.tracker["peak_bytes"] - plain.tracker["peak_bytes"]
    assert logits * 2 <= raised < logits * 2 + 1024
    held = measured.step_start_bytes - plain.step_start_bytes
    assert logits * 2 <= held < logits * 2 + 1024
