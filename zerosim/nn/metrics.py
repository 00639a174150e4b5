"""Training metrics as Composer's trainer keeps them: updated after every micro-batch's
backward, from the logits that micro-batch's forward returned, without gradient.

    metric = LanguageCrossEntropy()
    loss = model(x, y); model.backward()
    with no_grad():
        metric.update(model.output, y)      # model.keep_output = True keeps the logits
    metric.compute()                        # mean cross-entropy over the targets counted
    metric.compute(comm)                    # ... over every rank's targets (torchmetrics' sync)
    metric.reset()                          # Composer: at the start of every batch

Why a ZeRO library has them: they are part of what a published run's GPUs did. MosaicML's
llm-foundry trains MPT with ``train_metrics = [LanguageCrossEntropy(), LanguagePerplexity()]``
(``ComposerMPTCausalLM``, ``llmfoundry/models/mpt/modeling_mpt.py`` at commit ef350d9e6), and
Composer 0.15's ``Trainer._train_microbatch`` calls ``_eval_train_metrics`` after ``backward``
on every micro-batch. Each metric's ``update`` is ``torch.nn.CrossEntropyLoss(ignore_index=-100,
reduction='sum')`` of the logits under the run's bf16 autocast (``composer/metrics/nlp.py``,
v0.15.0): autocast computes ``log_softmax`` in float32, so the bf16 logits are cast to float32
(one kernel), their log-softmax written (one kernel) and the targets' entries summed
(``nll_loss``). ``LanguagePerplexity`` is the same update; only ``compute`` differs (the
exponential of the mean). That is 2 + 4 bytes (the cast) and 4 + 4 (the log-softmax) per
logit for each metric, 28 bytes a logit for the two: over MPT's vocabulary of 50,368, 1.4 MB
a token, about 1 µs on an A100, a third of the time a 125M model's products take a token.

The arithmetic is torch's: the log-softmax in float32 from the max-shifted values, the sum of
the targets' negative log-probabilities in float32 (``tests/test_nn_metrics.py`` holds it to
``torch.nn.functional.cross_entropy``).
"""

from __future__ import annotations

from typing import Any

from zerosim.backend import np_dtype, xp_of
from zerosim.nn.functional import log_softmax, reduce, reshape, upcast


class LanguageCrossEntropy:
    """Composer's ``LanguageCrossEntropy``: Σ −log softmax(z_i)[t_i] over the targets that are
    not ``ignore_index``, and their number; ``compute`` is the mean. The sums stay arrays on the
    logits' device (no copy to the host per micro-batch, as torchmetrics keeps its states)."""

    def __init__(self, ignore_index: int = -100) -> None:
        self.ignore_index = int(ignore_index)
        self.sum_loss: Any = None  # 0-d arrays from the first update on
        self.total_items: Any = None

    def update(self, logits: Any, target: Any) -> None:
        """Add one micro-batch: ``logits`` (..., C) in any float dtype, ``target`` of the
        logits' leading shape, integers."""
        if logits.ndim < 2 or tuple(target.shape) != tuple(logits.shape[:-1]):
            raise ValueError(
                f"{type(self).__name__}.update expects logits (..., C) and targets of their "
                f"leading shape; got logits {tuple(logits.shape)}, target {tuple(target.shape)}"
            )
        if np_dtype(target.dtype).kind not in "iu":
            raise TypeError(
                f"{type(self).__name__}.update: target must be integers; got {target.dtype}"
            )
        xp = xp_of(logits)
        z = upcast(reshape(logits, (-1, logits.shape[-1])))  # autocast: bf16 → float32
        t = reshape(target, (-1,))
        valid = t != self.ignore_index
        picked = xp.take_along_axis(log_softmax(z), xp.where(valid, t, 0)[:, None], axis=1)
        losses = -reduce("sum", picked[:, 0] * xp.astype(valid, z.dtype))  # nll_loss, summed
        count = xp.count_nonzero(valid)
        if self.sum_loss is None:
            self.sum_loss, self.total_items = losses, count
        else:
            self.sum_loss, self.total_items = self.sum_loss + losses, self.total_items + count

    def reset(self) -> None:
        """Forget every update (Composer resets its train metrics at the start of each batch)."""
        self.sum_loss = self.total_items = None

    def compute(self, comm: Any = None) -> Any:
        """The mean, in the sum's dtype (float32); NaN before any target was counted.

        With ``comm`` (every rank of it calls this alike, after an update): the mean over every
        rank's targets, each state summed over the ranks as torchmetrics 0.11 syncs a 0-d state
        with ``dist_reduce_fx='sum'`` (``gather_all_tensors``: a barrier, then an all-gather of
        the one value, then the sum), in the order Composer adds them (``sum_loss``,
        ``total_items``). This rank's own sums stay as they were (torchmetrics unsyncs them)."""
        if self.sum_loss is None:
            return float("nan")
        xp = xp_of(self.sum_loss)
        sum_loss, total_items = self.sum_loss, self.total_items
        if comm is not None:
            sum_loss, total_items = (_sum_over_ranks(comm, s) for s in (sum_loss, total_items))
        return sum_loss / xp.astype(total_items, sum_loss.dtype)


class LanguagePerplexity(LanguageCrossEntropy):
    """Composer's ``LanguagePerplexity``: the same update; ``compute`` is exp(mean)."""

    def compute(self, comm: Any = None) -> Any:
        mean = super().compute(comm)
        return mean if self.sum_loss is None else xp_of(mean).exp(mean)


def _sum_over_ranks(comm: Any, state: Any) -> Any:
    """torchmetrics' sync of a 0-d state: a barrier, every rank's value gathered, summed."""
    xp = xp_of(state)
    every = xp.empty((comm.size,), dtype=state.dtype)
    with comm.phase("metrics"):
        comm.barrier()
        comm.all_gather(every, reshape(state, (1,)))
    return reduce("sum", every)


def step_metrics(metrics: list, comm: Any) -> dict[str, Any]:
    """What Composer logs at the end of a batch: each metric computed over every rank of
    ``comm`` (``Trainer._compute_and_log_metrics``), by its class name."""
    return {type(m).__name__: m.compute(comm) for m in metrics}


# The metrics a trainer may name, by Composer's class names
METRICS = {"LanguageCrossEntropy": LanguageCrossEntropy, "LanguagePerplexity": LanguagePerplexity}
