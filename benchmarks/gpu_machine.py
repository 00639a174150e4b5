"""What the GPU check asks of the machine it runs on: the parts of benchmarks/gpu_check.py that
run in a process of their own.

    python benchmarks/gpu_machine.py install WHEELS PREFIX FACTS   # the carried wheels it lacks
    python benchmarks/gpu_machine.py environment FACTS             # what it has, printed
    mpirun -n 2 python benchmarks/gpu_machine.py mpi-hello         # two ranks answer

``install`` installs, from the folder benchmarks/gpu_prepare.py filled, each wheel whose
distribution this Python lacks (``mpich``: where mpi4py finds no MPI library or no ``mpirun``
is found) into PREFIX, with ``pip --no-index --no-deps`` (nothing is downloaded; where pip is
missing the wheels are unpacked instead), and writes to FACTS the environment variables that
make them visible (PYTHONPATH, PATH, LD_LIBRARY_PATH, MPI4PY_LIBMPI). ``environment`` prints the
GPU, driver, CUDA, versions, the MPI library, ``mpirun``, NCCL through CuPy, the route CuPy
arrays take under ``mpirun -n 2`` here and why, and whether CuPy handles bfloat16; it writes the
same as JSON to FACTS. Neither changes anything outside PREFIX.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# -- install ---------------------------------------------------------------------------------
def mpi_works() -> str | None:
    """None when mpi4py loads an MPI library and an ``mpirun`` is found; else why not."""
    probe = "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        return "mpi4py's import did not finish in 60 s"
    if done.returncode != 0:
        return f"mpi4py loads no MPI library: {done.stderr.strip().splitlines()[-1:]}"
    if mpirun() is None:
        return "no mpirun next to this Python or on PATH"
    return None


def mpirun() -> str | None:
    """The ``mpirun`` tests/helpers/mpi_helpers.py would launch: next to this Python, else on
    PATH."""
    here = Path(sys.executable).parent
    return shutil.which("mpirun", path=str(here)) or shutil.which("mpirun")


def needed(wheel: Path) -> str | None:
    """Why this machine needs ``wheel`` (None: it has its distribution already)."""
    dist = wheel.name.split("-")[0]
    if dist == "mpich":
        return mpi_works()
    try:
        importlib.metadata.version(dist)  # names compare normalized: array_api_compat, …
    except importlib.metadata.PackageNotFoundError:
        return f"{dist} is not installed"
    return None


def unpack(wheel: Path, prefix: Path, site: Path) -> None:
    """A wheel installed by hand (where pip is missing): its packages into ``site``, its data
    (``*.data/data/``: mpich's bin/ and lib/) into ``prefix``, executables kept executable."""
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            parts = Path(info.filename).parts
            if parts[0].endswith(".data") and len(parts) > 2:
                kind = parts[1]
                target = prefix.joinpath("bin" if kind == "scripts" else "", *parts[2:])
                if kind == "purelib" or kind == "platlib":
                    target = site.joinpath(*parts[2:])
            else:
                target = site / info.filename
            if info.is_dir():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(archive.read(info))
            mode = info.external_attr >> 16
            if mode & 0o111 or target.parent.name == "bin":
                target.chmod(target.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def install(wheels: Path, prefix: Path, facts: Path) -> int:
    """Install the wheels this machine lacks into ``prefix``; write the environment to FACTS."""
    chosen = []
    for wheel in sorted(wheels.glob("*.whl")):
        why = needed(wheel)
        print(f"{wheel.name}: {'install: ' + why if why else 'not needed, the machine has it'}")
        if why:
            chosen.append(wheel)
    env: dict[str, str] = {}
    if chosen:
        pip = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps"]
        pip += ["--ignore-installed", "--disable-pip-version-check", "--prefix", str(prefix)]
        has_pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True)
        if has_pip.returncode == 0:
            print("$", " ".join(pip + [w.name for w in chosen]), flush=True)
            subprocess.run(pip + [str(w) for w in chosen], check=True)
        else:
            print("no pip here: unpacking the wheels instead", flush=True)
            for wheel in chosen:
                unpack(wheel, prefix, prefix / "site-packages")
        env = environment_for(prefix)
    facts.write_text(json.dumps({"installed": [w.name for w in chosen], "env": env}))
    for key, value in env.items():
        print(f"{key}={value}")
    return 0


def environment_for(prefix: Path) -> dict[str, str]:
    """The variables that make what was installed in ``prefix`` visible, found where pip put
    it (the layout differs between Pythons: lib/python3.12/site-packages, local/lib/…)."""
    env = {}
    sites = {p.parent for p in prefix.rglob("*.dist-info")}
    if sites:
        env["PYTHONPATH"] = os.pathsep.join(sorted(str(s) for s in sites))
    runners = [p for p in prefix.rglob("mpirun") if p.is_file()]
    if runners:
        env["PATH"] = str(runners[0].parent)
    libraries = [p for p in prefix.rglob("libmpi.so.12") if "site-packages" not in str(p)]
    if libraries:
        env["LD_LIBRARY_PATH"] = str(libraries[0].parent)
        env["MPI4PY_LIBMPI"] = str(libraries[0])
    return env


# -- environment -----------------------------------------------------------------------------
def command_output(*cmd: str) -> str:
    if shutil.which(cmd[0]) is None:
        return f"{cmd[0]}: not found"
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return f"{cmd[0]}: no answer in 30 s"
    return (done.stdout or done.stderr).strip()


def version_of(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def attempt(fn: Any) -> str:
    """``fn()``'s answer, or the error it raised, as one line."""
    try:
        return str(fn())
    except Exception as err:  # noqa: BLE001  (reported, whatever it is)
        return f"error: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def cuda_facts() -> dict[str, Any]:
    """The GPU as CuPy sees it, NCCL through CuPy, and CuPy's bfloat16."""
    try:
        import cupy  # noqa: PLC0415  (the error, if any, is the reason there is no GPU)
    except ImportError as err:
        return {"gpu": False, "no gpu": f"CuPy does not import ({err})", "devices": 0}
    rt = cupy.cuda.runtime
    try:
        count, why = rt.getDeviceCount(), "CuPy sees no CUDA device"
    except Exception as err:  # noqa: BLE001  (CUDARuntimeError: no driver, no device, …)
        count, why = 0, f"CuPy finds no CUDA device ({type(err).__name__}: {err})"
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        why += f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return {"gpu": False, "no gpu": why, "devices": 0, "cupy": cupy.__version__}
    names = [attempt(lambda i=i: _name(rt.getDeviceProperties(i)["name"])) for i in range(count)]
    facts: dict[str, Any] = {
        "gpu": True,
        "devices": count,
        "names": names,
        "cupy": cupy.__version__,
        "cuda runtime": attempt(rt.runtimeGetVersion),
        "cuda driver": attempt(rt.driverGetVersion),
        "compute capability": attempt(lambda: cupy.cuda.Device(0).compute_capability),
    }
    from cupy.cuda import nccl  # noqa: PLC0415

    facts["nccl"] = bool(getattr(nccl, "available", False))
    facts["nccl version"] = attempt(nccl.get_version) if facts["nccl"] else "not available"
    facts["bfloat16"] = bfloat16_probe(cupy)
    return facts


def _name(raw: Any) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def bfloat16_probe(cupy: Any) -> dict[str, str]:
    """What CuPy does with ml_dtypes' bfloat16 (CuPy ≥ 14 has some of it; zerosim's config refuses
    bf16 on the cupy backend): the operations zerosim's 16-bit path would need."""
    import ml_dtypes  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    host = np.arange(6, dtype=ml_dtypes.bfloat16)
    out: dict[str, str] = {"from host": attempt(lambda: cupy.asarray(host).dtype)}
    if out["from host"].startswith("error"):
        return out
    a = cupy.asarray(host)
    out["a * a + a"] = attempt(lambda: (a * a + a).get().tolist())
    out["astype float32"] = attempt(lambda: a.astype(cupy.float32).get().tolist())
    out["matmul"] = attempt(lambda: float((a.reshape(2, 3) @ a.reshape(3, 2)).sum()))
    out["sum"] = attempt(lambda: float(a.sum()))
    kernel = "cupy.ElementwiseKernel('T x', 'T y', 'y = x * x')"
    out[kernel] = attempt(
        lambda: cupy.ElementwiseKernel("T x", "T y", "y = x * x", "zs_bf16_probe")(a).get().tolist()
    )
    return out


def route_facts(cuda: dict[str, Any], cuda_aware: bool) -> dict[str, str]:
    """The route CuPy arrays take under ``mpirun -n 2`` here, and the routes that cannot run."""
    if not cuda["gpu"]:
        return {
            "route": "host",
            "route why": "collectives move NumPy arrays, handed to MPI as they are",
        }
    fallback = "cuda-aware" if cuda_aware else "staged"
    if cuda["nccl"] and cuda["devices"] >= 2:
        return {"route": "nccl", "route why": "NCCL through CuPy, a GPU for each of the 2 ranks"}
    why = (
        f"{cuda['devices']} GPU: the 2 ranks share GPU 0 and NCCL refuses two ranks on one device"
        if cuda["nccl"]
        else "CuPy has no NCCL"
    )
    aware = "the MPI library reads device memory" if cuda_aware else "the MPI is not CUDA-aware"
    return {
        "route": fallback,
        "route why": f"NCCL not exercised ({why}); {aware}, so CuPy arrays go {fallback}",
    }


def cuda_aware_mpi() -> bool:
    """What zerosim decides (comm/cuda.py): whether the MPI library reads device memory."""
    from zerosim.comm import cuda  # noqa: PLC0415  (imports mpi4py: may fail, reported)

    return cuda.cuda_aware_mpi()


def environment(facts_path: Path) -> int:
    import numpy as np  # noqa: PLC0415

    facts: dict[str, Any] = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "host": platform.node(),
        "nvidia-smi": command_output(
            "nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"
        ),
        "numpy": np.__version__,
    }
    for dist in ("cupy-cuda13x", "cupy-cuda12x", "mpi4py", "mpich", "ml_dtypes", "torch"):
        facts[dist] = version_of(dist)
    for dist in ("array-api-compat", "pytest", "pytest-timeout", "nvidia-nccl-cu13"):
        facts[dist] = version_of(dist)
    try:
        facts.update(cuda_facts())
    except Exception as err:  # noqa: BLE001  (reported; the other facts still count)
        from zerosim.backend import gpu_available  # noqa: PLC0415

        facts.update(gpu=gpu_available(), devices=0, nccl=False, **{"cuda facts": repr(err)})
    facts["mpi library"] = attempt(
        lambda: __import__("mpi4py.MPI").MPI.Get_library_version().splitlines()[0].strip()
    )
    facts["mpirun"] = mpirun()
    facts["cuda-aware mpi"] = attempt(cuda_aware_mpi) == "True"
    facts.update(route_facts(facts, facts["cuda-aware mpi"]))
    facts["torch cuda"] = (  # torch is imported only where it could use a GPU (seconds)
        attempt(lambda: __import__("torch").cuda.is_available())
        if facts["gpu"] and facts["torch"] != "not installed"
        else "not asked (no GPU)"
    )
    for key, value in facts.items():
        print(f"{key}: {json.dumps(value) if isinstance(value, dict | list) else value}")
    facts_path.write_text(json.dumps(facts, indent=1))
    return 0


# -- mpi-hello -------------------------------------------------------------------------------
def mpi_hello() -> int:
    """Every rank of the job: an all-reduce through zerosim's MPIComm, and the GPU it would use."""
    import numpy as np  # noqa: PLC0415

    from zerosim.backend import gpu_available, local_rank  # noqa: PLC0415
    from zerosim.comm import MPIComm  # noqa: PLC0415

    comm = MPIComm()
    buf = np.ones(4)
    comm.all_reduce(buf)
    assert buf.tolist() == [float(comm.size)] * 4, buf
    gpu = "no GPU"
    if gpu_available():
        import cupy  # noqa: PLC0415

        gpu = f"GPU {local_rank() % cupy.cuda.runtime.getDeviceCount()}"
    print(f"OK rank {comm.rank} of {comm.size} ({gpu})", flush=True)
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["install"] and len(argv) == 4:
        return install(Path(argv[1]), Path(argv[2]), Path(argv[3]))
    if argv[:1] == ["environment"] and len(argv) == 2:
        return environment(Path(argv[1]))
    if argv == ["mpi-hello"]:
        return mpi_hello()
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
