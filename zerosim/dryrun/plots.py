"""The dry run's picture: one rank's live memory over its simulated step (``--plot``)."""

from __future__ import annotations

from pathlib import Path

from zerosim.dryrun.timeline import StepTime

GIB = 2**30


def plot_step_memory(
    step: StepTime, path: str | Path, title: str = "", device_memory_bytes: float | None = None
) -> None:
    """Live bytes (every allocation and free of the step) against the simulated time, with the
    compute and communication streams drawn below it; with ``device_memory_bytes`` the device's
    memory as a line, and a title that says the step would not start when the peak exceeds it."""
    import matplotlib  # noqa: PLC0415  (only the plot needs it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (mem, streams) = plt.subplots(
        2, 1, figsize=(10, 5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    if step.memory:
        times, live = zip(*step.memory, strict=True)
        mem.step(times, [b / GIB for b in live], where="post", color="C0")
    mem.set_ylabel("live memory (GiB)")
    title = title or "memory over one simulated step"
    if device_memory_bytes is not None:
        mem.axhline(device_memory_bytes / GIB, color="C3", linestyle="--", label="device memory")
        mem.legend(loc="upper left")
        peak = max((b for _, b in step.memory), default=0)
        if peak > device_memory_bytes:
            title += (
                f"\nwould not start: peak {peak / GIB:.3g} GiB > device "
                f"{device_memory_bytes / GIB:.3g} GiB (OOM)"
            )
    mem.set_title(title)
    for row, stream, colour in ((1, "compute", "C2"), (0, "comm", "C1")):
        bars = [(a, b - a) for s, _, a, b in step.spans if s == stream and b > a]
        streams.broken_barh(bars, (row - 0.4, 0.8), color=colour)
    streams.set_yticks([0, 1], ["communication", "compute"])
    streams.set_xlabel("simulated time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
