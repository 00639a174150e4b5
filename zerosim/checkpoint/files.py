"""Checkpoint files: crash-safe writes, SHA-256 checksums, the metadata file, consolidation.

A checkpoint is a directory ``save_dir/tag/`` of plain ``.npy`` files (one per rank, parameter
group and kind: ``master`` or an optimizer state name, each the concatenation of the rank's owned
segments) and one ``metadata.json``; ``save_dir/latest`` names the newest tag. Everything reads
with numpy alone (``docs/checkpoints.md`` describes every field). ``.npy`` rather than ``.npz``
because ``np.load(path, mmap_mode="r")`` memory-maps a ``.npy``: a loading rank touches only the
byte ranges it copies, whatever world size wrote the file.

Every file is written to a temporary name, flushed, fsynced, renamed over the final name and its
directory fsynced (``write_atomic``), so a file either holds its complete new contents or does not
exist. Its SHA-256 and size, computed while writing, go into the metadata; ``verify_file`` checks
them before anything is loaded. A save writes its tag into a staging folder ``.tag.saving`` that
becomes ``tag`` by one rename once every file is written (``commit_tag_dir``), so ``save_dir/tag``
only ever holds a complete checkpoint, and a failed save deletes its staging folder
(``discard_staging``). This module does no communication: ``zerosim.checkpoint`` drives it on
every rank, and ``consolidate`` runs in one process.
"""

from __future__ import annotations

import bisect
import errno
import hashlib
import json
import os
import pickle
import shutil
import threading
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from zerosim.backend import to_host
from zerosim.zero.partition import Range

FORMAT_VERSION = 1
METADATA = "metadata.json"
LATEST = "latest"
_CHUNK = 1 << 16  # bytes read at a time when hashing
# np.load parses each .npy header with ast.literal_eval, and CPython before 3.11.8 keeps the
# parser's recursion depth in shared state (gh-106905): LocalWorld's ranks, threads of one
# process, raised SystemError reading headers at once. One header at a time.
NPY_HEADER_LOCK = threading.Lock()


class CheckpointError(ValueError):
    """A checkpoint is corrupted, incomplete, or does not fit the engine that loads it."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A file the checkpoint needs does not exist."""


def shard_file(rank: int, group: int, kind: str) -> str:
    """File name of one rank's ``kind`` (``master`` or an optimizer state) of one group."""
    return f"rank{rank:05d}.group{group}.{kind}.npy"


# -- crash-safe writing --------------------------------------------------------------------------
def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (a no-op where directories cannot be fsynced)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as err:  # some filesystems refuse fsync on a directory
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


class _HashingFile:
    """A write-only file wrapper that hashes and counts what goes through it."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw, self.sha, self.size = raw, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        self.size += view.nbytes
        return self.raw.write(view)

    def flush(self) -> None:
        self.raw.flush()


def write_atomic(path: Path, write: Callable[[Any], None]) -> dict[str, Any]:
    """``write(f)`` into a temporary file, fsync, rename to ``path``, fsync the directory.

    Returns ``{"sha256": hex digest, "bytes": size}`` of what was written.
    """
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as raw:
            f = _HashingFile(raw)
            write(f)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.errno is not None and err.filename is None:
            # write() and fsync() do not say which file a full disk (ENOSPC) or a file size
            # limit (EFBIG) stopped: name it (OSError(errno, …) keeps the errno's subclass)
            raise OSError(err.errno, f"{err.strerror} (writing)", str(path)) from err
        raise
    fsync_dir(path.parent)
    return {"sha256": f.sha.hexdigest(), "bytes": f.size}


def npz_member(zf: zipfile.ZipFile, key: str, arr: np.ndarray) -> None:
    """Stream one array into an open ``.npz`` (a zip of ``.npy`` members) as ``key``."""
    with zf.open(key + ".npy", "w", force_zip64=True) as f:
        np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(arr))
        f.write(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def write_npz_streamed(path: Path, items: Iterator[tuple[str, np.ndarray]]) -> Path:
    """Write ``(key, array)`` pairs to one ``.npz`` crash-safely, one array at a time, so peak
    memory is the largest array, never the sum."""

    def write(f: Any) -> None:
        with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as zf:
            for key, arr in items:
                npz_member(zf, key, arr)

    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, write)
    return path


def load_16bit_model(path: str | Path) -> dict[str, np.ndarray]:
    """{name: array} of a file written by ``engine.save_16bit_model``. The ``.npy`` format has
    no bfloat16, so such arrays are stored as their 2-byte patterns (numpy reads them as
    ``void16``); they come back here as ``ml_dtypes.bfloat16``."""
    from zerosim.backend import DTYPES

    with NPY_HEADER_LOCK, np.load(path) as f:
        return {
            k: f[k].view(DTYPES["bfloat16"]) if f[k].dtype == np.dtype("V2") else f[k]
            for k in f.files
        }


def npy_writer(pieces: list[Any], dtype: np.dtype) -> Callable[[Any], None]:
    """A writer of one 1-D ``.npy`` holding ``pieces`` end to end, streamed piece by piece."""
    total = sum(int(p.size) for p in pieces)

    def write(f: Any) -> None:
        header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False}
        np.lib.format.write_array_header_1_0(f, {**header, "shape": (total,)})
        for p in pieces:
            f.write(np.ascontiguousarray(to_host(p), dtype=dtype).reshape(-1).view(np.uint8))

    return write


def write_json(path: Path, obj: Any) -> dict[str, Any]:
    return write_atomic(path, lambda f: f.write(json.dumps(obj, indent=1).encode()))


# -- reading and checking ------------------------------------------------------------------------
def sha256_file(path: Path) -> str:
    """SHA-256 of a file, read in chunks into one reused buffer (constant memory)."""
    sha, buf = hashlib.sha256(), bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            sha.update(view[:n])
    return sha.hexdigest()


def verify_file(path: Path, entry: dict[str, Any]) -> None:
    """Raise naming ``path`` unless it exists with the recorded size and SHA-256."""
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path}: missing (the metadata lists it)")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointError(
            f"{path}: {size} bytes, the metadata records {entry['bytes']} (truncated or replaced)"
        )
    if sha256_file(path) != entry["sha256"]:
        raise CheckpointError(f"{path}: SHA-256 differs from the metadata's (corrupted)")


def _body_digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_metadata(tag_dir: Path, body: dict[str, Any]) -> None:
    """``metadata.json``: the body plus the SHA-256 of its canonical JSON form."""
    write_json(tag_dir / METADATA, {**body, "metadata_sha256": _body_digest(body)})


def read_metadata(tag_dir: Path) -> dict[str, Any]:
    """Parse and check ``metadata.json``; errors name the file."""
    path = tag_dir / METADATA
    _require_folder(tag_dir, "checkpoint tag folder")
    if not path.is_file():
        raise CheckpointNotFoundError(
            f"{path}: missing; the save of this tag did not finish (or this is not a zerosim "
            f"checkpoint)"
        )
    try:
        body = json.loads(path.read_text())
        digest = body.pop("metadata_sha256")
    except (ValueError, KeyError, AttributeError, TypeError) as err:
        raise CheckpointError(f"{path}: not a valid metadata file ({err})") from err
    if digest != _body_digest(body):
        raise CheckpointError(f"{path}: SHA-256 of its contents differs from the recorded one")
    if body.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format_version {body.get('format_version')!r}; this zerosim reads "
            f"{FORMAT_VERSION}"
        )
    return body


def resolve_tag(load_dir: str | Path, tag: str | None) -> Path:
    """The tag directory: ``load_dir/tag``, or the tag named by ``load_dir/latest``."""
    load_dir = Path(load_dir)
    if tag is not None:
        return load_dir / check_tag(tag)
    latest = load_dir / LATEST
    _require_folder(load_dir, "checkpoint folder")
    if not latest.is_file():
        raise CheckpointNotFoundError(
            f"{latest}: missing, so {load_dir} names no checkpoint to load; save one there "
            "first, or name a tag folder (tag= / --tag)"
        )
    why = "it must hold the name of a tag folder (save_checkpoint writes it; a copy or an edit "
    why += "can damage it)"
    try:
        text = latest.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{latest}: cannot be read as text ({err}); {why}") from err
    try:
        name = check_tag(text.strip())
    except ValueError as err:
        raise CheckpointError(f"{latest}: holds {text!r}; {why}") from err
    tag_dir = load_dir / name
    if tag_dir.exists() and not tag_dir.is_dir():
        raise CheckpointError(f"{latest} names {name!r}, but {tag_dir} is a file, not a tag folder")
    if not tag_dir.is_dir():
        aside = replaced_dir(tag_dir)
        hint = f"; its previous contents are in {aside}" if aside.is_dir() else ""
        raise CheckpointNotFoundError(f"{latest} names {name!r}, but {tag_dir} is missing{hint}")
    return tag_dir


def _require_folder(path: Path, what: str) -> None:
    """Raise unless ``path`` is a folder: "no such" when nothing is there, "is a file" when a
    file is."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path}: is a file, not a {what}")
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path}: no such {what}")


def check_tag(tag: Any) -> str:
    """A tag must be a plain directory name."""
    if not isinstance(tag, str) or tag in ("", ".", "..") or "/" in tag or "\\" in tag:
        raise ValueError(f"tag must be a non-empty directory name without '/', got {tag!r}")
    return tag


# -- the tag directory and the small objects in it ---------------------------------------------
def staging_dir(tag_dir: Path) -> Path:
    """Where a save of ``tag_dir`` writes before its one rename into place: ``.tag.saving``."""
    return tag_dir.with_name(f".{tag_dir.name}.saving")


def replaced_dir(tag_dir: Path) -> Path:
    """``.tag.replaced``: where an older save of the tag waits while a new one takes its name."""
    return tag_dir.with_name(f".{tag_dir.name}.replaced")


def prepare_staging(tag_dir: Path) -> Path:
    """Rank 0: an empty staging folder for a save of ``tag_dir``; returns it.

    Removes what killed saves left in ``save_dir`` (staging folders, ``.latest.tmp*`` files, and
    an older save set aside whose replacement completed). One job saves into a folder at a time.
    """
    save_dir = tag_dir.parent
    if tag_dir.exists() and not tag_dir.is_dir():
        raise FileExistsError(errno.EEXIST, "exists and is not a checkpoint folder", str(tag_dir))
    save_dir.mkdir(parents=True, exist_ok=True)
    for stale in save_dir.glob(".*"):
        if stale.name.startswith(f".{LATEST}.tmp"):
            stale.unlink(missing_ok=True)
        elif stale.is_dir() and stale.name.endswith(".saving"):
            shutil.rmtree(stale)
        elif stale.is_dir() and stale.name.endswith(".replaced"):
            if (save_dir / stale.name[1 : -len(".replaced")]).is_dir():
                shutil.rmtree(stale)  # else it holds the only copy of its tag: keep it
    stage = staging_dir(tag_dir)
    stage.mkdir()
    return stage


def commit_tag_dir(tag_dir: Path) -> None:
    """Rank 0, once every file of the save is durable: the staging folder becomes ``tag_dir``.

    An older save of the tag is renamed aside first and deleted only after the new one is in
    place; if the second rename fails, the older save is put back.
    """
    stage, old = staging_dir(tag_dir), replaced_dir(tag_dir)
    moved = tag_dir.is_dir()
    if moved:
        os.replace(tag_dir, old)
    try:
        os.replace(stage, tag_dir)
    except BaseException:
        if moved:
            os.replace(old, tag_dir)
        raise
    fsync_dir(tag_dir.parent)
    if moved:
        shutil.rmtree(old, ignore_errors=True)


def discard_staging(tag_dir: Path) -> None:
    """Rank 0, after a save failed on any rank: delete its staging folder, and nothing else."""
    shutil.rmtree(staging_dir(tag_dir), ignore_errors=True)


def write_latest(tag_dir: Path) -> None:
    write_atomic(tag_dir.parent / LATEST, lambda f: f.write(tag_dir.name.encode()))


def store_object(tag_dir: Path, key: str, obj: Any, files: dict, inline: bool = True) -> Any:
    """Metadata entry for an object: inline JSON, a JSON file, or (not JSON-able) a pickle."""
    if obj is None:
        return None
    try:
        encoded = to_json(obj)
    except TypeError:
        name = f"{key}.pkl"
        files[name] = write_atomic(tag_dir / name, lambda f: pickle.dump(obj, f, protocol=4))
        return {"pickle": name}
    if inline:
        return {"json": encoded}
    files[f"{key}.json"] = write_json(tag_dir / f"{key}.json", encoded)
    return {"json_file": f"{key}.json"}


def verify_share(tag_dir: Path, meta: dict, rank: int, size: int) -> None:
    """Each rank checks the SHA-256 of every size-th file: each file is read once in all."""
    for i, name in enumerate(sorted(meta["files"])):
        if i % size == rank:
            verify_file(tag_dir / name, meta["files"][name])


def read_objects(tag_dir: Path, meta: dict) -> dict[str, Any]:
    """The small objects (scheduler, loss scaler, loader, client state), read before applying."""
    out = {}
    for key, entry in meta["objects"].items():
        if entry is None or isinstance(entry, str):
            out[key] = entry
        elif "json" in entry:
            out[key] = from_json(entry["json"])
        elif "json_file" in entry:
            out[key] = from_json(json.loads((tag_dir / entry["json_file"]).read_text()))
        else:
            with open(tag_dir / entry["pickle"], "rb") as f:
                out[key] = pickle.load(f)  # checksum-verified; see docs on trusting pickles
    if meta["buffers"] is not None:
        with NPY_HEADER_LOCK, np.load(tag_dir / meta["buffers"]) as z:
            out["buffers"] = {k: z[k] for k in z.files}
    return out


# -- tagged JSON: tuples survive the round trip; anything else unusual is refused -----------------
def to_json(obj: Any) -> Any:
    """Plain JSON for dict/list/str/int/float/bool/None; tuples, arrays tagged; else TypeError."""
    if obj is None or type(obj) in (str, int, float, bool):
        return obj
    if isinstance(obj, np.generic) and obj.ndim == 0 and obj.dtype.kind in "biuf":
        return obj.item()
    if isinstance(obj, np.ndarray) and obj.dtype.kind in "biuf":
        return {"__ndarray__": obj.tolist(), "dtype": obj.dtype.str}
    if type(obj) is tuple:
        return {"__tuple__": [to_json(v) for v in obj]}
    if type(obj) is list:
        return [to_json(v) for v in obj]
    if (
        type(obj) is dict
        and all(type(k) is str for k in obj)
        and not {"__tuple__", "__ndarray__"} & set(obj)
    ):
        return {k: to_json(v) for k, v in obj.items()}
    raise TypeError(f"{type(obj).__name__} is not JSON-representable")


def from_json(obj: Any) -> Any:
    if isinstance(obj, list):
        return [from_json(v) for v in obj]
    if isinstance(obj, dict):
        if set(obj) == {"__tuple__"}:
            return tuple(from_json(v) for v in obj["__tuple__"])
        if set(obj) == {"__ndarray__", "dtype"}:
            return np.array(obj["__ndarray__"], dtype=np.dtype(obj["dtype"]))
        return {k: from_json(v) for k, v in obj.items()}
    return obj


# -- where saved elements are ---------------------------------------------------------------------
class SavedIndex:
    """For each parameter, the saved pieces sorted by start: (start, stop, rank, group, offset).

    ``offset`` is the element index of the piece in ``shard_file(rank, group, kind)``.
    """

    def __init__(self, meta: dict[str, Any]) -> None:
        self.pieces: dict[str, list[tuple[int, int, int, int, int]]] = {
            p["name"]: [] for p in meta["params"]
        }
        for rank, entry in enumerate(meta["ranks"]):
            for g, segs in enumerate(entry["segments"]):
                for name, start, stop, offset in segs:
                    self.pieces[name].append((start, stop, rank, g, offset))
        for v in self.pieces.values():
            v.sort()
        self.starts = {n: [p[0] for p in v] for n, v in self.pieces.items()}

    def check_tiling(self, meta: dict[str, Any], where: Path) -> None:
        """Every parameter's saved pieces must cover [0, numel) exactly once."""
        for p in meta["params"]:
            at = 0
            for start, stop, *_ in self.pieces[p["name"]]:
                if start != at or stop <= start:
                    break
                at = stop
            if at != p["numel"]:
                raise CheckpointError(
                    f"{where}: the saved pieces of {p['name']!r} do not cover its "
                    f"{p['numel']} elements exactly once"
                )

    def overlaps(self, name: str, rng: Range) -> Iterator[tuple[Range, int, int, int]]:
        """(overlap, rank, group, offset in that rank's file) for the pieces meeting ``rng``."""
        pieces = self.pieces[name]
        i = max(bisect.bisect_right(self.starts[name], rng.start) - 1, 0)
        for start, stop, rank, group, offset in pieces[i:]:
            if start >= rng.stop:
                break
            part = Range(start, stop).intersect(rng)
            if part is not None:
                yield part, rank, group, offset + part.start - start


def open_shard(tag_dir: Path, cache: dict, rank: int, group: int, kind: str) -> np.ndarray:
    """Memory-map one shard file (cached): reading a slice reads only those bytes."""
    key = (rank, group, kind)
    if key not in cache:
        with NPY_HEADER_LOCK:
            cache[key] = np.load(tag_dir / shard_file(rank, group, kind), mmap_mode="r")
    return cache[key]


# -- consolidation --------------------------------------------------------------------------------
def consolidate(
    ckpt_dir: str | Path,
    out: str | Path,
    tag: str | None = None,
    with_optimizer: bool = False,
) -> Path:
    """Write the full weights (and optionally optimizer states) of a checkpoint to one ``.npz``.

    ``ckpt_dir`` is a save directory (its ``latest``, or ``tag``, is used) or a tag directory.
    Keys: each parameter's name; with ``with_optimizer``, ``optimizer/<state>/<name>`` for every
    array state and ``optimizer/<scalar>/group<g>`` (0-d) for per-group scalars such as ``step``.
    One parameter is assembled at a time from the memory-mapped shards and streamed into the zip
    member, so peak memory ≈ the largest parameter (zero_to_fp32 holds the whole model).
    """
    ckpt_dir, out = Path(ckpt_dir), Path(out)
    if out.suffix != ".npz":
        raise ValueError(f"out must end in .npz (safetensors is not supported), got {out}")
    tag_dir = ckpt_dir if (ckpt_dir / METADATA).is_file() else resolve_tag(ckpt_dir, tag)
    meta = read_metadata(tag_dir)
    for name, entry in meta["files"].items():
        verify_file(tag_dir / name, entry)
    index = SavedIndex(meta)
    index.check_tiling(meta, tag_dir / METADATA)
    cache: dict = {}
    dtype = np.dtype(meta["dtype"])
    kinds = [("master", "")]
    if with_optimizer:
        keys = sorted({k for g in meta["groups"] for k in g["state_keys"]})
        kinds += [(k, f"optimizer/{k}/") for k in keys]

    def items() -> Iterator[tuple[str, np.ndarray]]:
        for kind, prefix in kinds:
            for p in meta["params"]:
                if kind != "master" and kind not in meta["groups"][p["group"]]["state_keys"]:
                    continue
                reads = list(index.overlaps(p["name"], Range(0, p["numel"])))
                srcs = [open_shard(tag_dir, cache, r, g, kind) for _, r, g, _ in reads]
                full = np.empty(p["numel"], dtype=srcs[0].dtype if srcs else dtype)
                for (part, _, _, at), src in zip(reads, srcs, strict=True):
                    full[part.start : part.stop] = src[at : at + part.size]
                yield prefix + p["name"], full.reshape(p["shape"])
                del full
        if with_optimizer:
            for g, group in enumerate(meta["groups"]):
                for k, v in group["scalars"].items():
                    yield f"optimizer/{k}/group{g}", np.asarray(v)

    return write_npz_streamed(out, items())
