"""Gantt charts and Chrome traces of pipeline timelines (05b_schedules.py, bench/).

A timeline is one list of Events per rank; an Event has .op ("F", "B" or "W"), .mb (the
microbatch), .chunk (which of a rank's v chunks), .start and .end. Plotting teaches
nothing about pipelines, so it lives here.
"""

import json
from pathlib import Path


def plot_timelines(
    timelines: dict, path, unit: float = 1e3, xlabel: str = "ms since the step began"
) -> None:
    """{title: per-rank Events} -> one Gantt chart per title, stacked, into `path`.

    Each box is shaded and numbered by its microbatch (with the chunk's letter when a
    rank holds several chunks). `unit` scales the Events' times: 1e3 turns s into ms."""
    from matplotlib import figure  # no pyplot: a file, never a window

    p = len(next(iter(timelines.values())))
    n = len(timelines)
    fig = figure.Figure(figsize=(13, 1 + 0.45 * p * n), layout="tight")
    axes = fig.subplots(n, 1, sharex=True, squeeze=False)[:, 0]
    for ax, (title, timeline) in zip(axes, timelines.items()):
        chunked = any(e.chunk for events in timeline for e in events)
        for r, events in enumerate(timeline):
            for e in events:
                draw_box(ax, r, e, unit, chunked)
        ax.set(yticks=range(p), ylim=(p - 0.5, -0.5))
        ax.set_yticklabels([f"rank {r}" for r in range(p)])
        ax.set_title(title, fontsize=9, loc="left")
    axes[-1].set_xlabel(f"{xlabel}; forwards blue, backwards orange, W green")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)


def draw_box(ax, r: int, e, unit: float, chunked: bool) -> None:
    """One forward (blue), backward (orange) or W (green) on rank r's row: 3 or 3a."""
    from matplotlib import colormaps

    x = e.start * unit
    width = (e.end - e.start) * unit
    shade = 0.3 + 0.2 * (e.mb % 4)  # four shades tell neighbouring microbatches apart
    colour = colormaps[{"F": "Blues", "B": "Oranges", "W": "Greens"}[e.op]](shade)
    ax.broken_barh([(x, width)], (r - 0.4, 0.8), color=colour, ec="k", lw=0.3)
    label = f"{e.mb}{'abcdefgh'[e.chunk]}" if chunked else f"{e.mb}"  # 0a: chunk 0
    ink = "w" if shade > 0.6 else "k"  # white text on the darker shades
    ax.text(x + width / 2, r, label, ha="center", va="center", fontsize=6, color=ink)


def write_chrome_trace(timelines: dict, path) -> None:
    """{name: per-rank Events} -> Chrome-trace JSON (open in ui.perfetto.dev): a process
    per schedule, a thread per pipeline rank, a slice per forward or backward."""
    trace = []
    for pid, (name, timeline) in enumerate(timelines.items()):
        trace.append(dict(ph="M", name="process_name", pid=pid, args={"name": name}))
        for r, events in enumerate(timeline):
            rank = {"name": f"rank {r}"}
            trace.append(dict(ph="M", name="thread_name", pid=pid, tid=r, args=rank))
            for e in events:
                kind = {"F": "forward", "B": "backward", "W": "weight gradient"}[e.op]
                slice_ = dict(ph="X", name=f"{e.op}{e.mb} chunk {e.chunk}", cat=kind)
                slice_.update(pid=pid, tid=r, ts=e.start * 1e6)
                trace.append({**slice_, "dur": (e.end - e.start) * 1e6})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))

