"""docs/engine.md's "Follow one gradient" walks equal the call stack recorded at the MPI call.

``tests/helpers/walk_worker.py`` runs stage 2 and stage 3 under both schedules, and stage 2 with
DeepSpeed's defaults (no ``zerosim`` key: the default path), on 2 ranks of a real ``mpirun`` with
mpi4py's communicator wrapped, and records zerosim's frames from ``Engine.backward`` down to the
first mpi4py call of a gradient reduction (and, at stage 3, of a parameter gather) during
backward; at stage 2 also down to the first in-place add into ``grad_shard`` (the landing). Each
walk in the doc, a numbered list under a ``<!-- walk: STAGE SCHEDULE KIND -->`` marker whose
items begin with ``path`` ``function``, must name exactly those frames in that order, the
model's own layers collapsed into one ``zerosim/nn/module.py`` ``Module.backward`` step.
"""

from __future__ import annotations

import json
import re

import pytest
from mpi_helpers import ROOT, run_mpi

DOC = ROOT / "docs" / "engine.md"
MARKER = re.compile(r"<!-- walk: (\d) (paper|deepspeed|default) (reduction|gather|landing) -->")
STEP = re.compile(r"^\d+\. (?:\*\(callback\)\* )?`(zerosim/[\w/]+\.py)` `([\w.<>]+)`")
MODEL = ("zerosim/nn/module.py", "Module.backward")


def doc_walks() -> dict[str, list[tuple[str, str]]]:
    """{"2 paper reduction": [(path, qualname), ...]} from the doc's marked lists."""
    walks: dict[str, list[tuple[str, str]]] = {}
    key = None
    for line in DOC.read_text().splitlines():
        marker = MARKER.search(line)
        if marker:
            key = " ".join(marker.groups())
            walks[key] = []
        elif key is not None and (step := STEP.match(line)):
            walks[key].append(step.groups())
        elif key is not None and walks[key] and not line.startswith("   ") and line.strip():
            key = None  # the list ended
    return walks


def collapsed(frames: list[list[str]]) -> list[tuple[str, str]]:
    """The recorded frames with each run of the model's own frames as one step."""
    out: list[tuple[str, str]] = []
    for path, name in frames:
        model = path.startswith("zerosim/nn/") and not path.endswith("grad_ready.py")
        step = MODEL if model else (path, name.replace(".<locals>.", "."))
        if not (model and out and out[-1] == MODEL):
            out.append(step)
    return out


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    out = tmp_path_factory.mktemp("walk") / "walk.json"
    proc = run_mpi(2, ["tests/helpers/walk_worker.py", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_doc_has_a_walk_for_each_stage_schedule_and_kind():
    kinds = {2: ("reduction", "landing"), 3: ("reduction", "gather")}
    chosen = [
        f"{stage} {schedule} {kind}"
        for stage in (2, 3)
        for schedule in ("paper", "deepspeed")
        for kind in kinds[stage]
    ]
    default = ["2 default reduction", "2 default landing"]  # what runs with no zerosim key
    assert sorted(doc_walks()) == sorted(chosen + default)


@pytest.mark.parametrize("key", sorted(doc_walks()))
def test_each_walk_in_the_doc_is_the_recorded_call_stack(recorded, key):
    stage, schedule, kind = key.split()
    frames = recorded[f"{stage} {schedule}"][kind]
    assert frames and isinstance(frames[0], list), f"no {kind} recorded: calls {frames}"
    assert doc_walks()[key] == collapsed(frames)
