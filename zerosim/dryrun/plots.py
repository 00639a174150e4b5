"""The dry run's picture: one rank's live memory over its simulated step (``--plot``), with the
phases of the step and how busy each stream is.

A step of a large model has thousands of collectives and matrix products, most far shorter than
a pixel: drawn one bar each, both streams look solid however idle they are. So the lower panel
draws, for each stream, the fraction of every interval (``INTERVALS`` of them across the step)
that the stream is busy, and names its busy time over the whole step.
"""

from __future__ import annotations

from pathlib import Path

from zerosim.dryrun.timeline import StepTime
from zerosim.report.plots import byte_unit

GIB = 2**30
INTERVALS = 200  # busy fractions drawn across the step: 5 pixels each at the plot's width
STREAMS = (("compute", "compute", "C2"), ("comm", "communication", "C1"))
# DeepSpeed's reduction stream, drawn when a step has one (stage 3: ``timeline.simulate``)
REDUCTION_STREAM = ("reduce", "reduction", "C4")


def busy_fractions(
    spans: list[tuple[str, str, float, float]], stream: str, end: float, intervals: int
) -> list[float]:
    """For each of ``intervals`` equal intervals of [0, ``end``], the fraction of it in which
    ``stream`` has a span (spans of one stream never overlap: each stream runs one at a time)."""
    if end <= 0:
        return [0.0] * intervals
    width = end / intervals
    busy = [0.0] * intervals
    for s, _, start, stop in spans:
        if s != stream:
            continue
        first, last = int(start / width), min(int(stop / width), intervals - 1)
        for i in range(first, last + 1):
            busy[i] += max(0.0, min(stop, (i + 1) * width) - max(start, i * width))
    return [b / width for b in busy]


def plot_step_memory(
    step: StepTime, path: str | Path, title: str = "", device_memory_bytes: float | None = None
) -> None:
    """Live bytes (every allocation and free of the step) against the simulated time, the phases
    shaded, and below it each stream's busy fraction; with ``device_memory_bytes`` the device's
    memory as a line (named only, when it is more than twice the peak), and a title that says
    the step would not start when the peak exceeds it."""
    import matplotlib  # noqa: PLC0415  (only the plot needs it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (mem, streams) = plt.subplots(
        2, 1, figsize=(10, 5), sharex=True, gridspec_kw={"height_ratios": [3, 2]}
    )
    peak = max((b for _, b in step.memory), default=0)
    drawn = device_memory_bytes is not None and device_memory_bytes <= 2 * peak
    shown = max(peak, device_memory_bytes) if drawn else peak
    unit, scale = byte_unit(shown or 1, base=1024)
    if step.memory:
        times, live = zip(*step.memory, strict=True)
        mem.step(times, [b / scale for b in live], where="post", color="C0", label="live memory")
    mem.set_ylabel(f"live memory ({unit})")
    title = title or "memory over one simulated step"
    if device_memory_bytes is not None:
        label = f"device memory, {device_memory_bytes / GIB:.3g} GiB"
        if drawn:  # on the scale of the peak: drawn where it is
            mem.axhline(device_memory_bytes / scale, color="C3", linestyle="--", label=label)
        else:  # far above the peak: named, not drawn (it would flatten the curve)
            mem.plot([], [], color="C3", linestyle="--", label=label + " (off the scale)")
        if peak > device_memory_bytes:
            title += (
                f"\nwould not start: peak {peak / GIB:.3g} GiB > device "
                f"{device_memory_bytes / GIB:.3g} GiB (OOM)"
            )
    _shade_phases(mem, step)
    mem.set_ylim(0, shown / scale * 1.15 or 1)
    mem.legend(loc="lower right", fontsize="small")
    mem.set_title(title)
    _draw_busy(streams, step)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _shade_phases(ax, step: StepTime) -> None:
    """Each phase of the step (forward, backward, step…, as its collectives name it), from the
    time its first collective is issued to the next phase's, shaded and named at the top."""
    bounds = [*step.phases, (step.step_s, "")]
    for k, ((start, name), (stop, _)) in enumerate(zip(bounds, bounds[1:], strict=False)):
        ax.axvspan(start, stop, color="0.85" if k % 2 else "0.93", zorder=0, linewidth=0)
        ax.text((start + stop) / 2, 0.98, name, transform=ax.get_xaxis_transform(),
                ha="center", va="top", fontsize="x-small", clip_on=True)  # fmt: skip


def _draw_busy(ax, step: StepTime) -> None:
    """Each stream's busy fraction per interval, one band each, labelled with its busy time."""
    end = step.step_s
    edges = [end * i / INTERVALS for i in range(INTERVALS + 1)]
    labels = []
    streams = STREAMS
    if any(s == REDUCTION_STREAM[0] for s, *_ in step.spans):
        streams = (*STREAMS, REDUCTION_STREAM)
    for row, (stream, name, colour) in enumerate(streams[::-1]):
        fractions = busy_fractions(step.spans, stream, end, INTERVALS)
        top = [row + 0.9 * f for f in fractions]
        ax.stairs(top, edges, baseline=row, fill=True, color=colour)
        seconds = sum(b - a for s, _, a, b in step.spans if s == stream)
        share = seconds / end if end else 0.0
        labels.append(f"{name}\n{seconds:.3g} s, {share:.0%} busy")
    ax.set_yticks([row + 0.45 for row in range(len(streams))], labels, fontsize="small")
    ax.set_ylim(0, len(streams))
    ax.set_xlim(0, end or 1)
    ax.set_xlabel("simulated time (s)")
