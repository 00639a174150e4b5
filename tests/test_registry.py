"""The strategy registry (zerosim/zero/registry.py): which class runs each (stage, schedule,
layout), and that the paper's stage files hold the paper's schedule only."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import zerosim.zero as zero
from zerosim.comm import LocalWorld
from zerosim.engine import initialize
from zerosim.nn import MLP
from zerosim.zero.registry import STRATEGIES, ZEROPP, strategy_class

PAPER = {0: zero.Stage0, 1: zero.Stage1, 2: zero.Stage2, 3: zero.Stage3}
DEEPSPEED = {
    0: zero.Stage0DeepSpeed,
    1: zero.Stage1DeepSpeed,
    2: zero.Stage2DeepSpeed,
    3: zero.Stage3DeepSpeed,
}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_schedule_has_its_own_class_and_deepspeeds_extends_the_papers(stage):
    paper = strategy_class(stage, "paper", "deepspeed")
    deepspeed = strategy_class(stage, "deepspeed", "deepspeed")
    assert (paper, deepspeed) == (PAPER[stage], DEEPSPEED[stage])
    assert issubclass(deepspeed, paper) and deepspeed is not paper
    assert paper.stage == deepspeed.stage == stage


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeeds_schedule_is_the_papers_stage_given_other_parts(stage):
    """DeepSpeed's class overrides no method of the paper's stage: it names other parts (a
    reducer; at stage 3 a fetcher too) and its boundary rule, so no inherited method reads state
    it never built."""
    from zerosim.zero.fetcher import ParamFetcher
    from zerosim.zero.reducer import GradReducer

    paper, deepspeed = PAPER[stage], DEEPSPEED[stage]
    assert methods_added(deepspeed, paper) == []
    assert issubclass(deepspeed.reducer_cls, GradReducer)
    assert deepspeed.reducer_cls is not paper.reducer_cls
    if stage == 3:
        assert issubclass(deepspeed.fetcher_cls, ParamFetcher)
        assert deepspeed.fetcher_cls is not paper.fetcher_cls


def methods_added(variant: type, stage: type) -> list[str]:
    """The methods and properties ``variant`` or a class between it and ``stage`` in its method
    resolution order (a mixin) defines: what it changes of the stage other than its parts."""
    mro = variant.__mro__
    return [
        f"{cls.__name__}.{name}"
        for cls in mro[: mro.index(stage)]
        for name, value in vars(cls).items()
        if inspect.isfunction(value) or isinstance(value, property)
    ]


def test_a_method_defined_on_a_variant_or_its_mixin_is_seen():
    class Mixin:
        @property
        def padded(self):
            return 0

    class Variant(Mixin, zero.Stage2):
        def after_backward(self, boundary):
            pass

    assert methods_added(Variant, zero.Stage2) == ["Variant.after_backward", "Mixin.padded"]


# ZeRO++'s class keeps its constructor for one keyword, ``quantization_block_size`` (the engine
# passes ``zerosim.quantization_block_size`` to it alone; its fetcher and reducer read it);
# FSDP2's for its config keywords (``reshard_after_forward``, ``param_dtype``, ``reduce_dtype``,
# ``reshard_after_backward``, ``replicate``, ``blocks``: the engine passes ``zerosim.fsdp2``'s to
# it alone; HSDP's ``replicate`` splits the communicator before the stage is built on it)
KEYWORD_ONLY = {"Stage3ZeroPP.__init__", "Stage3FSDP2.__init__"}


def test_every_registered_class_is_the_papers_stage_given_parts():
    """Every entry of the registry is one of the paper's stages with parts named as class
    attributes: no method of the stage is replaced by it or by a mixin it adds."""
    for cls in [*STRATEGIES.values(), *ZEROPP.values()]:
        added = set(methods_added(cls, PAPER[cls.stage])) - KEYWORD_ONLY
        assert not added, (cls.__name__, sorted(added))


def test_deepspeeds_stages_1_and_2_are_given_deepspeeds_layout_and_the_papers_the_papers():
    from zerosim.zero.layouts import DeepSpeedLayout, FlatLayout

    for stage in (0, 1, 2):
        assert PAPER[stage].layout_cls is FlatLayout
    assert DEEPSPEED[0].layout_cls is FlatLayout  # DeepSpeed's stage 0 has no flat buffers
    assert DEEPSPEED[1].layout_cls is DEEPSPEED[2].layout_cls is DeepSpeedLayout


@pytest.mark.parametrize("schedule", ["paper", "deepspeed"])
def test_megatrons_layout_is_the_papers_stage_1_given_megatrons_layout_part(schedule):
    """Megatron's distributed optimizer overrides no method of stage 1: its buckets, gradient
    buffers, fp32 gradient shard and range maps are its layout part's."""
    from zerosim.zero.layouts import MegatronLayout

    cls = strategy_class(1, schedule, "megatron")
    assert issubclass(cls, zero.Stage1Megatron) and issubclass(zero.Stage1Megatron, zero.Stage1)
    assert not issubclass(cls, zero.Stage1DeepSpeed)
    assert methods_added(cls, zero.Stage1) == []
    assert cls.layout_cls is MegatronLayout
    assert cls.reducer_cls is zero.Stage1.reducer_cls  # the paper's reduce-scatter of each unit


@pytest.mark.parametrize("schedule", ["paper", "deepspeed"])
def test_zeropp_extends_the_papers_stage_3_under_either_schedule(schedule):
    cls = strategy_class(3, schedule, "deepspeed", zeropp=True)
    assert issubclass(cls, zero.Stage3ZeroPP) and issubclass(zero.Stage3ZeroPP, zero.Stage3)
    assert not issubclass(cls, zero.Stage3DeepSpeed)
    assert strategy_class(2, schedule, "deepspeed", zeropp=True) is strategy_class(2, schedule)


def test_deepspeeds_schedule_alone_sends_one_norm_message_per_group():
    from zerosim.zero.ds_schedule import DeepSpeedNormGroups

    ds = {strategy_class(3, "deepspeed"), strategy_class(3, "deepspeed", zeropp=True)}
    paper = {strategy_class(3, "paper"), strategy_class(3, "paper", zeropp=True)}
    assert all(issubclass(cls, DeepSpeedNormGroups) for cls in ds)
    assert not any(issubclass(cls, DeepSpeedNormGroups) for cls in paper)


def test_every_registered_class_runs_the_stage_it_is_keyed_by():
    assert {key[0] for key in STRATEGIES} == {0, 1, 2, 3}
    for (stage, _, _), cls in STRATEGIES.items():
        assert cls.stage == stage


@pytest.mark.parametrize(
    "stage, schedule, layout",
    [(4, "paper", "deepspeed"), (2, "ring", "deepspeed"), (2, "paper", "megatron")],
)
def test_an_unknown_combination_is_named_in_the_error(stage, schedule, layout):
    with pytest.raises(ValueError) as err:
        strategy_class(stage, schedule, layout)
    for value in (repr(stage), repr(schedule), repr(layout)):
        assert value in str(err.value)


@pytest.mark.parametrize("schedule", ["paper", "deepspeed"])
def test_the_engine_builds_the_registered_class(schedule):
    def build(comm):
        engine, *_ = initialize(
            MLP([6, 9, 4], seed=3),
            {
                "train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                "zero_allow_untested_optimizer": True,
                "zero_optimization": {"stage": 2},
                "zerosim": {"schedule": schedule},
            },
            comm=comm,
        )
        assert not hasattr(engine.strategy, "schedule")  # the class is the schedule
        return type(engine.strategy)

    want = zero.Stage2 if schedule == "paper" else zero.Stage2DeepSpeed
    assert LocalWorld(2).run(build) == [want, want]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_papers_stage_file_never_reads_the_schedule(stage):
    """No ``self.schedule`` and no ``schedule ==`` in stage0-3.py: DeepSpeed's variant is a
    subclass in a file of its own."""
    path = Path(zero.__file__).parent / f"stage{stage}.py"
    tree = ast.parse(path.read_text())
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert not {"schedule", "layout_kind"} & names


def schedule_names_compared(source: str) -> list[str]:
    """Each comparison with the string "paper" or "deepspeed"'s schedule meaning: a name or
    attribute called ``schedule`` (or the string "paper") on either side of ``==``/``!=``/``in``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        named = any(
            (isinstance(x, ast.Name) and x.id == "schedule")
            or (isinstance(x, ast.Attribute) and x.attr == "schedule")
            or (isinstance(x, ast.Constant) and x.value == "paper")
            for x in sides
        )
        if named:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_of_zero_but_the_registry_turns_a_schedule_name_into_code():
    """The boundary checks are each class's ``boundary_rule``; no table keyed by the name."""
    folder = Path(zero.__file__).parent
    for path in sorted(folder.glob("*.py")):
        if path.name == "registry.py":
            continue
        assert not schedule_names_compared(path.read_text()), path.name


def test_a_schedule_comparison_is_found():
    assert schedule_names_compared("if schedule == 'paper':\n    pass\n")
    assert schedule_names_compared("x = self.schedule != s")
    assert not schedule_names_compared("if stage == 3:\n    pass\n")
