"""Sharded checkpoints of an engine: each rank saves what it owns; any world size and stage loads.

    path = save_checkpoint(engine, "ckpt")               # ckpt/global_step{N}/, ckpt/latest
    path, client_state = load_checkpoint(engine, "ckpt") # on any N, any stage, any layout

Both are collectives. Saving: every rank writes, for each parameter group, one ``.npy`` per kind
(``master`` and each optimizer state) holding its *owned* segments end to end
(``Strategy.segments("owned")``: every element of the model exactly once across ranks); rank 0
writes ``metadata.json`` (the segment tables, hyperparameters, per-group scalar state, scheduler,
RNG states, data position, a SHA-256 per file). All of it goes into a staging folder that rank 0
renames to the tag once every rank has finished, and then it replaces ``latest``; a save that
fails on any rank deletes the staging folder (the previous checkpoint stays as it was).

Loading is resharding by element ranges, blind to layouts: each rank, for every segment it
*steps* (``segments("stepped")``), copies the overlapping runs of the saved pieces out of the
memory-mapped files. A saved piece [a, b) of parameter n at file offset o and a stepped segment
[c, d) at shard offset q overlap on [max(a, c), min(b, d)); element e of the overlap is read at
o + e − a and written at q + e − c. Then ``strategy.gather()`` rebuilds the full parameters.
Everything is checked (files, sizes, checksums, model and optimizer fit) before anything changes,
and a failure on one rank is raised on every rank (``_agree``), so none waits forever.
``docs/checkpoints.md`` describes the format and how it differs from DeepSpeed's.
"""

from __future__ import annotations

import copy
import json
import logging
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from zerosim.backend import array_module, move_like, np_dtype, to_host
from zerosim.checkpoint.files import (
    FORMAT_VERSION,
    METADATA,
    CheckpointError,
    CheckpointNotFoundError,
    SavedIndex,
    check_tag,
    commit_tag_dir,
    discard_staging,
    from_json,
    npy_writer,
    open_shard,
    prepare_staging,
    read_metadata,
    read_objects,
    resolve_tag,
    shard_file,
    staging_dir,
    store_object,
    to_json,
    verify_share,
    write_atomic,
    write_latest,
    write_metadata,
)
from zerosim.comm.gather import gather_text
from zerosim.nn.state import state_entries
from zerosim.zero.partition import Range

log = logging.getLogger(__name__)

__all__ = ["CheckpointError", "CheckpointNotFoundError", "load_checkpoint", "save_checkpoint"]

_RAISED = (CheckpointNotFoundError, CheckpointError, FileNotFoundError, OSError, TypeError)


def _agree(comm: Any, fn: Any) -> Any:
    """Run ``fn`` on every rank; if it raised anywhere, raise on every rank (no rank hangs).

    One all-reduce of a flag; on failure the lowest failing rank broadcasts its message. A
    failing rank re-raises its own error; the others raise the same class with that message.
    """
    try:
        result, err = fn(), None
    except Exception as e:  # noqa: BLE001  (re-raised below, on every rank)
        result, err = None, e
    flag = np.array([0 if err is None else comm.size - comm.rank], dtype=np.int64)
    comm.all_reduce(flag, op="max")
    if flag[0] == 0:
        return result
    root = comm.size - int(flag[0])
    text = np.frombuffer(f"{type(err).__name__}: {err} ".encode(), dtype=np.uint8)
    code = next((i for i, c in enumerate(_RAISED) if isinstance(err, c)), len(_RAISED))
    head = np.array([code, text.size], dtype=np.int64)
    comm.broadcast(head, root=root)
    message = np.zeros(int(head[1]), dtype=np.uint8)
    if comm.rank == root:
        message[:] = text
    comm.broadcast(message, root=root)
    if err is not None:
        raise err
    cls = _RAISED[head[0]] if head[0] < len(_RAISED) else RuntimeError
    raise cls(f"rank {root} failed: {message.tobytes().decode().strip()}")


def _gather_json(comm: Any, obj: Any) -> list[Any]:
    """Every rank's JSON-able ``obj``, on every rank (``gather_text``: two all-gathers)."""
    return [json.loads(text) for text in gather_text(comm, json.dumps(obj))]


def _random_modules(module: Any) -> dict[str, Any]:
    """{module name: module} of the modules that draw from a numpy Generator (Dropout)."""
    return {
        name: m
        for name, m in module.named_modules()
        if isinstance(m.__dict__.get("rng"), np.random.Generator)
    }


def _engine_params(engine: Any) -> list[dict[str, Any]]:
    return [
        {"name": n, "shape": list(p.shape), "numel": int(p.numel), "group": g}
        for g, group in enumerate(engine.strategy.groups)
        for n, p in group.named_params
    ]


# -- save ---------------------------------------------------------------------------------------
# Muon's momentum lives with its matrices (zerosim/zero/muon.py), not in the optimizer's tiles:
# it is saved as one more kind of the Muon groups, by the same owned segments as the master, in
# the master's dtype (as DeepSpeed keeps optimizer state in fp32 checkpoints), and loaded into
# whatever this rank keeps of each matrix (stages 0-2: the whole matrix; stage 3: its chunk).
MUON_MOMENTUM = "muon_momentum"


def _muon(engine: Any) -> Any:
    return getattr(engine.strategy, "muon", None)


def save_checkpoint(
    engine: Any,
    save_dir: str | Path,
    tag: str | None = None,
    client_state: Any = None,
    loader: Any = None,
) -> Path:
    """Save ``engine`` under ``save_dir/tag`` (default tag ``global_step{N}``); a collective.

    ``client_state`` (anything; JSON when it can be, else pickle) comes back from
    ``load_checkpoint``. ``loader`` (default: ``engine.training_dataloader`` if present) has its
    ``state_dict()`` saved. Returns the tag directory.
    """
    comm = engine.comm
    loader = getattr(engine, "training_dataloader", None) if loader is None else loader
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    tag_dir = Path(save_dir) / tag
    with comm.phase("checkpoint"):
        _agree(comm, lambda: _check_save(engine, tag))
        crc = zlib.crc32(tag.encode())
        same = np.array([crc, -crc], dtype=np.int64)
        comm.all_reduce(same, op="max")
        if same[0] != -same[1]:
            raise ValueError(f"tag differs across ranks (this rank's is {tag!r}); pass one tag")
        stage = staging_dir(tag_dir)  # the files go here; one rename makes it the tag
        try:
            _agree(comm, lambda: prepare_staging(tag_dir) if comm.rank == 0 else None)
            manifest = _agree(comm, lambda: _write_rank_files(engine, stage))
            manifests = _gather_json(comm, manifest)
            if comm.rank == 0:
                body = lambda: _write_rank0_files(engine, stage, manifests, client_state, loader)  # noqa: E731
            else:
                body = lambda: _check_manifests(manifests)  # noqa: E731
            _agree(comm, body)
            _agree(comm, lambda: commit_tag_dir(tag_dir) if comm.rank == 0 else None)
        except Exception:
            # every rank has left the failed step (_agree), so no rank still writes: rank 0
            # deletes the unfinished save; the previous checkpoint and `latest` are untouched
            if comm.rank == 0:
                discard_staging(tag_dir)
            raise
        _agree(comm, lambda: write_latest(tag_dir) if comm.rank == 0 else None)
    if comm.rank == 0:  # one line for the job, not one per rank
        log.info("saved checkpoint %s", tag_dir)
    return tag_dir


def _check_save(engine: Any, tag: str) -> None:
    check_tag(tag)
    k = engine.gradient_accumulation_steps
    if engine.micro_steps % k:
        raise ValueError(
            f"save_checkpoint at micro-step {engine.micro_steps} is inside an accumulation "
            f"window of {k}; the accumulated gradients are not saved, so save at a boundary"
        )


def _group_state(opt: Any, g: int, tiles: list[Any]) -> tuple[bool, list[str], dict[str, Any]]:
    """(has state, array state keys, scalars) of one group; scalars must agree across tiles."""
    states = [opt.state.get(t) for t in tiles]
    have = [bool(st) for st in states]
    if not any(have):
        return False, [], {}
    if not all(have):
        raise CheckpointError(f"param group {g}: optimizer state exists for some tiles only")
    keys = list(opt.state_keys(opt.param_groups[g]))
    scalar_sets = [{k: v for k, v in st.items() if k not in keys} for st in states]
    if any(s != scalar_sets[0] for s in scalar_sets):
        raise CheckpointError(f"param group {g}: scalar optimizer state differs between tiles")
    return True, keys, to_json(scalar_sets[0])


def _array(opt: Any, tile: Any, kind: str) -> Any:
    """A tile's master weights (``kind == "master"``) or one of its optimizer state arrays."""
    return tile.data if kind == "master" else opt.state[tile][kind]


def _write_rank_files(engine: Any, tag_dir: Path) -> dict[str, Any]:
    """Every rank: its owned segments of each group, one .npy per kind; returns its manifest."""
    strategy, opt, rank = engine.strategy, engine.optimizer, engine.comm.rank
    by_group: list[list[Any]] = [[] for _ in strategy.sharded_step.tiles]
    for s in strategy.segments("owned"):
        by_group[s.group].append(s)
    manifest: dict[str, Any] = {"segments": [], "groups": [], "files": {}, "dtype": None}
    for g, segs in enumerate(by_group):
        tiles = strategy.sharded_step.tiles[g]
        has, keys, scalars = _group_state(opt, g, tiles)
        muon = _muon(engine) is not None and g in _muon(engine).groups
        manifest["groups"].append(None if not tiles else [has, keys, scalars, muon])
        table, at = [], 0
        for s in segs:
            table.append([s.name, s.param_range.start, s.param_range.stop, at])
            at += s.size
        manifest["segments"].append(table)
        if not segs:
            continue
        muon = _muon(engine)
        with_momentum = muon is not None and g in muon.groups
        master_dtype = None
        for kind in ["master", *keys, *([MUON_MOMENTUM] if with_momentum else [])]:
            if kind == MUON_MOMENTUM:  # in the master's dtype
                xp = array_module(tiles[0].data)
                pieces = [
                    xp.astype(muon.read_momentum(s.name, *s.param_range), master_dtype)
                    for s in segs
                ]
            else:
                pieces = [
                    _array(opt, tiles[s.tile], kind)[s.offset : s.offset + s.size] for s in segs
                ]
            name = shard_file(rank, g, kind)
            dtype = np_dtype(pieces[0].dtype)
            master_dtype = master_dtype or dtype
            manifest["dtype"] = manifest["dtype"] or dtype.name
            manifest["files"][name] = write_atomic(tag_dir / name, npy_writer(pieces, dtype))
    manifest["rng"] = {
        name: to_json(m.rng.bit_generator.state)
        for name, m in _random_modules(engine.module).items()
    }
    return manifest


def _check_manifests(manifests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merge the ranks' per-group (has state, keys, scalars); ranks must agree."""
    groups = []
    for g in range(len(manifests[0]["groups"])):
        seen = [m["groups"][g] for m in manifests if m["groups"][g] is not None]
        if any(s != seen[0] for s in seen):
            raise CheckpointError(f"param group {g}: optimizer state differs across ranks")
        has, keys, scalars, muon = seen[0] if seen else (False, [], {}, False)
        groups.append({"has_state": has, "state_keys": keys, "scalars": scalars})
        if muon:  # the group's Muon momentum is saved too (files of kind MUON_MOMENTUM)
            groups[-1][MUON_MOMENTUM] = True
    return groups


def _write_rank0_files(
    engine: Any, tag_dir: Path, manifests: list[dict], client_state: Any, loader: Any
) -> None:
    strategy, opt = engine.strategy, engine.optimizer
    groups = _check_manifests(manifests)
    files: dict[str, Any] = {}
    for m in manifests:
        files.update(m["files"])
    for g, group in enumerate(groups):
        hyper = {k: v for k, v in opt.param_groups[g].items() if k != "params"}
        group.update(hyper=to_json(hyper), params=[n for n, _ in strategy.groups[g].named_params])
    buffers = {
        key: to_host(m._buffers[attr])
        for key, (m, attr, is_param) in state_entries(engine.module).items()
        if not is_param
    }
    if buffers:
        files["buffers.npz"] = write_atomic(
            tag_dir / "buffers.npz", lambda f: np.savez(f, **buffers)
        )
    scaler = getattr(engine, "loss_scaler", None)
    objects = {
        "lr_scheduler": store_object(tag_dir, "lr_scheduler", _state(engine.lr_scheduler), files),
        "lr_scheduler_class": type(engine.lr_scheduler).__name__ if engine.lr_scheduler else None,
        "loss_scaler": store_object(tag_dir, "loss_scaler", _state(scaler), files),
        "data_loader": store_object(tag_dir, "data_loader", _state(loader), files),
        "client_state": store_object(tag_dir, "client_state", client_state, files, inline=False),
    }
    body = {
        "format_version": FORMAT_VERSION,
        "stage": strategy.stage,
        "layout": strategy.layout_kind,
        "world_size": engine.comm.size,
        "dtype": next((m["dtype"] for m in manifests if m["dtype"]), strategy.dtype.name),
        "padded_numel": int(strategy.padded_numel),
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "optimizer": type(opt).__name__,
        "params": _engine_params(engine),
        "groups": groups,
        "ranks": [{"segments": m["segments"], "rng": m["rng"]} for m in manifests],
        "buffers": "buffers.npz" if buffers else None,
        "objects": objects,
        "files": files,
    }
    write_metadata(tag_dir, body)


def _state(obj: Any) -> Any:
    return None if obj is None or not hasattr(obj, "state_dict") else obj.state_dict()


# -- load ---------------------------------------------------------------------------------------
class Read(NamedTuple):
    """Copy ``size`` elements from a rank's file at ``src`` into a stepped segment at ``dst``."""

    segment: int  # index into segments("stepped")
    dst: int  # element offset inside the segment
    rank: int
    group: int
    src: int  # element offset inside the saved file
    size: int


def plan_reads(segments: list[Any], index: SavedIndex) -> list[Read]:
    """What a loading rank reads: only the runs overlapping the segments it steps."""
    plan = []
    for i, s in enumerate(segments):
        for part, rank, group, src in index.overlaps(s.name, s.param_range):
            plan.append(Read(i, part.start - s.param_range.start, rank, group, src, part.size))
    return plan


def load_checkpoint(
    engine: Any,
    load_dir: str | Path,
    tag: str | None = None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    loader: Any = None,
) -> tuple[Path, Any]:
    """Load a checkpoint saved at any world size, stage and layout; a collective.

    ``tag`` defaults to the one ``load_dir/latest`` names. With ``load_optimizer_states=False``
    only the weights (and counters, buffers, RNG, data position) are loaded; with
    ``load_lr_scheduler_states=False`` the scheduler is left alone. Returns
    ``(tag directory, client_state)``.
    """
    comm = engine.comm
    loader = getattr(engine, "training_dataloader", None) if loader is None else loader
    with comm.phase("checkpoint"):
        flags = (load_optimizer_states, load_lr_scheduler_states)
        tag_dir, meta = _agree(comm, lambda: _read_and_check(engine, load_dir, tag, flags, loader))
        _agree(comm, lambda: verify_share(tag_dir, meta, comm.rank, comm.size))
        objects = _agree(comm, lambda: read_objects(tag_dir, meta))
        _agree(comm, lambda: _apply(engine, tag_dir, meta, objects, flags, loader))
        engine.strategy.sharded_step.params_from_master()  # a separate master leads
        engine.strategy.gather()
    log.info("loaded checkpoint %s (saved by %d ranks)", tag_dir, meta["world_size"])
    return tag_dir, objects["client_state"]


def _read_and_check(
    engine: Any, load_dir: Any, tag: Any, flags: tuple[bool, bool], loader: Any
) -> tuple[Path, dict]:
    """Metadata, every file present with its size, and the engine fits the checkpoint."""
    tag_dir = resolve_tag(load_dir, tag)
    meta = read_metadata(tag_dir)
    where = tag_dir / METADATA
    _check_files(tag_dir, meta)
    mine = {p["name"]: p for p in _engine_params(engine)}
    saved = {p["name"]: p for p in meta["params"]}
    diffs = sorted(set(mine) ^ set(saved))
    diffs += sorted(n for n in set(mine) & set(saved) if mine[n] != saved[n])
    if diffs:
        raise CheckpointError(
            f"{where}: the model does not match the checkpoint; parameters missing, extra, of "
            f"another shape or in another param group: {diffs}"
        )
    SavedIndex(meta).check_tiling(meta, where)
    load_opt, load_sched = flags
    if load_opt:
        _check_optimizer(engine.optimizer, meta, where)
        muon = _muon(engine)
        for g in muon.groups if muon is not None else []:
            if not meta["groups"][g].get(MUON_MOMENTUM):
                raise CheckpointError(
                    f"{where}: param group {g} uses Muon, and the checkpoint holds no Muon "
                    "momentum for it (pass load_optimizer_states=False to load weights only)"
                )
    rng = meta["ranks"][engine.comm.rank % meta["world_size"]]["rng"]
    here = sorted(_random_modules(engine.module))
    if sorted(rng) != here:
        raise CheckpointError(
            f"{where}: random modules {sorted(rng)} were saved; this model has {here}"
        )
    saved_cls, sched = meta["objects"]["lr_scheduler_class"], engine.lr_scheduler
    if load_sched and sched is not None and saved_cls not in (None, type(sched).__name__):
        raise CheckpointError(
            f"{where}: saved with scheduler {saved_cls}; this engine's is {type(sched).__name__} "
            "(pass load_lr_scheduler_states=False to skip it)"
        )
    state = meta["objects"]["data_loader"]
    if loader is not None and state is not None and "json" in state:
        try:  # validates on a copy: changes nothing
            copy.copy(loader).load_state_dict(from_json(state["json"]))
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{where}: the saved data position does not fit: {err}") from err
    return tag_dir, meta


def _check_files(tag_dir: Path, meta: dict) -> None:
    """Every file the metadata lists is there, with the size it records."""
    missing = sorted(n for n in meta["files"] if not (tag_dir / n).is_file())
    ranks = sorted({int(n[4:9]) for n in missing if n.startswith("rank")})
    if missing:
        which = f"rank(s) {ranks} " if ranks else ""
        raise CheckpointNotFoundError(f"{tag_dir}: files of {which}are missing: {missing}")
    for name, entry in meta["files"].items():
        size = (tag_dir / name).stat().st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"{tag_dir / name}: {size} bytes, the metadata records {entry['bytes']} "
                "(truncated or replaced)"
            )


def _check_optimizer(opt: Any, meta: dict, where: Path) -> None:
    """The saved optimizer is this engine's, keeping the same states in every param group."""
    if meta["optimizer"] != type(opt).__name__:
        raise CheckpointError(
            f"{where}: saved with optimizer {meta['optimizer']}; this engine's is "
            f"{type(opt).__name__} (pass load_optimizer_states=False to load weights only)"
        )
    for g, group in enumerate(meta["groups"]):
        want = list(opt.state_keys({**opt.param_groups[g], **from_json(group["hyper"])}))
        if group["has_state"] and group["state_keys"] != want:
            raise CheckpointError(
                f"{where}: param group {g} saved states {group['state_keys']}; "
                f"{type(opt).__name__} with these settings keeps {want}"
            )


def _apply(
    engine: Any, tag_dir: Path, meta: dict, objects: dict, flags: tuple[bool, bool], loader: Any
) -> None:
    """Copy everything in (nothing has been changed before this point)."""
    strategy, opt, (load_opt, load_sched) = engine.strategy, engine.optimizer, flags
    segments = strategy.segments("stepped")
    plan = plan_reads(segments, SavedIndex(meta))
    cache: dict = {}

    def fill(kind: str) -> None:
        for r in plan:
            s = segments[r.segment]
            if kind != "master" and kind not in meta["groups"][s.group]["state_keys"]:
                continue
            dst = _array(opt, strategy.sharded_step.tiles[s.group][s.tile], kind)
            src = open_shard(tag_dir, cache, r.rank, r.group, kind)[r.src : r.src + r.size]
            at = s.offset + r.dst
            dst[at : at + r.size] = move_like(src, dst)  # host file -> device: counted

    fill("master")
    if load_opt:
        for g, (group, saved) in enumerate(zip(opt.param_groups, meta["groups"], strict=True)):
            group.update(from_json(saved["hyper"]))
            for tile in strategy.sharded_step.tiles[g]:
                old = opt.state.pop(tile, None) or {}
                if not saved["has_state"]:
                    continue
                xp = array_module(tile.data)
                state = {
                    k: old[k]
                    if k in old and old[k].shape == tile.data.shape
                    else xp.zeros_like(tile.data)
                    for k in saved["state_keys"]
                }
                state.update(from_json(saved["scalars"]))
                opt.state[tile] = state
        for kind in sorted({k for g in meta["groups"] for k in g["state_keys"]}):
            fill(kind)
        _load_muon_momentum(engine, tag_dir, meta, cache)
    if "buffers" in objects:
        engine.module.load_state_dict(objects["buffers"], strict=False)
    rng = meta["ranks"][engine.comm.rank % meta["world_size"]]["rng"]
    for name, m in _random_modules(engine.module).items():
        m.rng.bit_generator.state = from_json(rng[name])
    if load_sched and engine.lr_scheduler is not None and objects["lr_scheduler"] is not None:
        engine.lr_scheduler.load_state_dict(objects["lr_scheduler"])
    scaler = getattr(engine, "loss_scaler", None)
    if scaler is not None and objects["loss_scaler"] is not None:
        scaler.load_state_dict(objects["loss_scaler"])
    if loader is not None and objects["data_loader"] is not None:
        loader.load_state_dict(objects["data_loader"])
    engine.global_steps = meta["global_steps"]  # saves happen at boundaries: micro = k · global
    engine.micro_steps = meta["global_steps"] * engine.gradient_accumulation_steps
    engine.comm.ledger.step = engine.global_steps


def _load_muon_momentum(engine: Any, tag_dir: Path, meta: dict, cache: dict) -> None:
    """Every element of Muon momentum this rank keeps, read from the pieces that saved it."""
    muon = _muon(engine)
    if muon is None:
        return
    index = SavedIndex(meta)
    for m, start, stop in muon.held():
        for part, rank, group, src in index.overlaps(m.name, Range(start, stop)):
            values = open_shard(tag_dir, cache, rank, group, MUON_MOMENTUM)[src : src + part.size]
            like = muon.read_momentum(m.name, part.start, part.stop)
            values = move_like(np.asarray(values, dtype=np_dtype(like.dtype)), like)
            muon.write_momentum(m.name, part.start, values)
