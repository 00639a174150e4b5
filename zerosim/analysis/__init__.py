"""Closed-form models to set beside measured runs: memory, DeepSpeed's estimators, time.

Pure functions, no communicator. ``memory``: per-rank model-state bytes of ZeRO stages 0–3 and
Megatron's distributed optimizer (ZeRO paper Table 1, Megatron's table). ``estimators``:
DeepSpeed's ``estimate_zero{2,3}_model_states_mem_needs`` and how they differ from the exact model.
``timing``: the α-β model of collectives, flat and two-level, compute time and step time.
Formulas and sources are in each module's docstring and in docs/formulas.md.
"""

from zerosim.analysis.estimators import (
    Comparison,
    Difference,
    EstimateRow,
    compare_with_exact,
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    format_comparison,
    format_estimates,
)
from zerosim.analysis.memory import (
    CATEGORIES,
    MegatronRow,
    ModelStateMemory,
    Table1Row,
    bucket_pool_bytes,
    format_paper_gb,
    full_precision_model_states,
    megatron_model_states,
    megatron_table,
    table1,
    table1_markdown,
    zero_model_states,
    zero_paper_bytes,
)
from zerosim.analysis.timing import (
    AlphaBetaFit,
    Cluster,
    alpha_beta_coefficients,
    collective_time,
    compute_time,
    fit_alpha_beta,
    ring_all_gather_time,
    ring_all_reduce_time,
    ring_reduce_scatter_time,
    step_time,
    transformer_training_flops,
)
from zerosim.analysis.volume import (
    clip_bytes,
    collective_schedule,
    quantized_nbytes,
    ring_split,
    step_bytes,
    zeropp_step_bytes,
)

__all__ = [
    "bucket_pool_bytes",
    "collective_schedule",
    "CATEGORIES",
    "AlphaBetaFit",
    "Cluster",
    "Comparison",
    "Difference",
    "EstimateRow",
    "MegatronRow",
    "ModelStateMemory",
    "Table1Row",
    "alpha_beta_coefficients",
    "collective_time",
    "compare_with_exact",
    "compute_time",
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "fit_alpha_beta",
    "format_comparison",
    "format_estimates",
    "format_paper_gb",
    "full_precision_model_states",
    "megatron_model_states",
    "megatron_table",
    "ring_all_gather_time",
    "ring_all_reduce_time",
    "ring_reduce_scatter_time",
    "step_time",
    "table1",
    "table1_markdown",
    "transformer_training_flops",
    "zero_model_states",
    "zero_paper_bytes",
    "clip_bytes",
    "quantized_nbytes",
    "ring_split",
    "step_bytes",
    "zeropp_step_bytes",
]
