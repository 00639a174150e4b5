"""Fuzzed DeepSpeed configs through initialize and one step: train, or ConfigError on every rank."""

import warnings

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zerosim as zs
from zerosim.engine import initialize
from zerosim.errors import ConfigError
from zerosim.nn import MLP

ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 10**9),
    st.floats(-1, 1e9),
    st.just(float("nan")),
    st.text(max_size=6),
    st.lists(st.integers(0, 3), max_size=3),
)
VALID = {  # each key's values that should train, by key path
    "train_micro_batch_size_per_gpu": st.integers(1, 3),
    "gradient_accumulation_steps": st.integers(1, 3),
    "gradient_clipping": st.sampled_from([0.0, 0.5, 1.0]),
    "optimizer.type": st.sampled_from(["Adam", "AdamW", "SGD", "Lion", "Adagrad", "adam", "RAdam"]),
    "optimizer.params.lr": st.floats(1e-4, 0.1),
    "zero_optimization.stage": st.integers(0, 3),
    "zero_optimization.overlap_comm": st.booleans(),
    "zero_optimization.reduce_bucket_size": st.integers(1, 200),
    "zero_optimization.sub_group_size": st.integers(1, 50),
    "zero_optimization.stage3_param_persistence_threshold": st.integers(0, 100),
    "zero_optimization.stage3_max_live_parameters": st.integers(0, 500),
    "zero_optimization.stage3_prefetch_bucket_size": st.integers(0, 500),
    "fp16.enabled": st.booleans(),
    "fp16.initial_scale_power": st.integers(4, 12),
    "bf16.enabled": st.booleans(),
    "zerosim.dtype": st.sampled_from(["float32", "float64"]),
    "zerosim.layout": st.sampled_from(["deepspeed", "megatron"]),
    "zerosim.collectives": st.sampled_from(["native", "ring"]),
}
BAD_PATHS = [
    *VALID,
    "train_batch_size",
    "optimizer",
    "optimizer.params",
    "optimizer.params.momentum",
    "optimizer.params.betas",
    "zero_optimization",
    "zero_optimization.offload_optimizer",
    "zero_optimization.offload_param",
    "zero_optimization.zero_quantized_weights",
    "zerosim",
    "zerosim.backend",
    "surprise",
    "zero_optimization.surprise",
]


def _put(cfg: dict, path: str, value) -> None:
    *parents, leaf = path.split(".")
    for key in parents:
        if not isinstance(cfg.get(key), dict):
            cfg[key] = {}
        cfg = cfg[key]
    cfg[leaf] = value


@st.composite
def configs(draw):
    """A config drawn key by key from values that should train, then 0-2 keys set to anything."""
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
    }
    for path in draw(st.lists(st.sampled_from(sorted(VALID)), max_size=8, unique=True)):
        _put(cfg, path, draw(VALID[path]))
    for path in draw(st.lists(st.sampled_from(BAD_PATHS), max_size=2, unique=True)):
        _put(cfg, path, draw(ANY))
    return cfg


CONFIG = configs()


def _attempt(comm, cfg):
    model = MLP([4, 5, 3], seed=0)
    before = {n: p.data.copy() for n, p in model.named_parameters()}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # unknown keys warn; that is tested elsewhere
            engine, *_ = initialize(model, cfg, comm=comm)
    except ConfigError as err:
        unchanged = all(np.array_equal(p.data, before[n]) for n, p in model.named_parameters())
        return "config-error", unchanged, str(err)
    micro = engine.config.train_micro_batch_size_per_gpu
    if micro * engine.gradient_accumulation_steps > 64:
        # accepted, as DeepSpeed accepts it, but too large to train here (10**9 micro-steps or a
        # 10**9-sample micro-batch): every rank must still have decided alike
        return "accepted-too-large-to-train", True, ""
    x = np.ones((micro, 4), np.float32)
    y = np.arange(micro) % 3
    for _ in range(engine.gradient_accumulation_steps):
        engine.backward(engine(x, y))
        engine.step()
    return "trained", engine.global_steps == 1, ""


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=CONFIG)
def test_every_fuzzed_config_trains_or_raises_config_error_on_every_rank(cfg):
    results = zs.LocalWorld(2, timeout=20).run(_attempt, cfg)
    kinds = {kind for kind, _, _ in results}
    assert len(kinds) == 1, results  # every rank decided the same way
    assert all(ok for _, ok, _ in results), results  # trained one step / nothing was changed
    if kinds == {"config-error"}:
        assert all(msg and msg == results[0][2] for _, _, msg in results)
