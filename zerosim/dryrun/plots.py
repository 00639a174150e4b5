"""The dry run's picture: one rank's live memory over its simulated step (``--plot``)."""

from __future__ import annotations

from pathlib import Path

from zerosim.dryrun.timeline import StepTime

GIB = 2**30


def plot_step_memory(step: StepTime, path: str | Path, title: str = "") -> None:
    """Live bytes (every allocation and free of the step) against the simulated time, with the
    compute and communication streams drawn below it."""
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
    mem.set_title(title or "memory over one simulated step")
    for row, stream, colour in ((1, "compute", "C2"), (0, "comm", "C1")):
        bars = [(a, b - a) for s, _, a, b in step.spans if s == stream and b > a]
        streams.broken_barh(bars, (row - 0.4, 0.8), color=colour)
    streams.set_yticks([0, 1], ["communication", "compute"])
    streams.set_xlabel("simulated time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
