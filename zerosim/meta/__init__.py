"""The dry run's shape-only arrays: ``MetaArray``, its namespace, and what they count.

``zerosim.meta`` is the backend ``"zerosim": {"backend": "meta"}`` selects: arrays with a shape,
a dtype and a memory layout but no values, so that the engine, the layers, the optimizer and the
stages run unchanged on a model of any size, counting every allocation (``Tracker``: live and
peak bytes per category) and every matrix product's FLOPs. docs/dryrun.md explains the choice.

    with zerosim.meta.tracking() as tracker:
        x = zerosim.meta.NAMESPACE.zeros((1024, 1024), dtype="float32")
        y = x @ x
    tracker.peak_total, tracker.matmul_flops        # 8 MiB, 2·1024³
"""

from zerosim.meta.array import MetaArray
from zerosim.meta.namespace import NAMESPACE, MetaNamespace
from zerosim.meta.tracker import CATEGORIES, Tracker, Values, current, tracking, values

__all__ = [
    "CATEGORIES",
    "NAMESPACE",
    "MetaArray",
    "MetaNamespace",
    "Tracker",
    "Values",
    "current",
    "tracking",
    "values",
]
