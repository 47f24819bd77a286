"""A run's loss curve as a PNG, from its progress.csv: the loss by timestep quartile
(``loss_q0`` .. ``loss_q3``, as the trainer logs them) against the step, on a log scale.

Drawn with matplotlib (axis titles, a legend: q0 is the loss of the timesteps in the first
quarter of the range, the least noisy, q3 of the last, the noisiest). Used by
``scripts/plot_progress.py RUN_DIR`` and by the demo, which writes ``loss_curve.png`` beside
its sample grid. The steps where the run was preempted or resumed (found in its ``log.txt``,
``run_events``) are marked on the curve.
"""
import csv
import math
import os
import re

from .infra.errors import UserError

QUARTILE_KEYS = ("loss_q0", "loss_q1", "loss_q2", "loss_q3")
# One colour per quartile (q0: the least noisy timesteps).
COLOURS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40))
# The dashed vertical line at a preemption or resume step.
MARK_COLOUR = (148, 103, 189)
# What the checkpointer logs (checkpointer.py): "preempted (SIGTERM on some rank): saved step 21;
# ..." and "resumed at step 21 from ...".
_EVENTS = ((re.compile(r"^preempted \(.*\): saved step (\d+)\b"), "preempted"),
           (re.compile(r"^resumed at step (\d+)\b"), "resumed"))


class PlotError(UserError):
    """progress.csv is missing or holds no loss columns; one line (exit 1)."""


def read_progress(csv_path, keys=("step",) + QUARTILE_KEYS):
    """{key: [float or None per row]} of ``keys`` from a progress.csv (empty cells: None)."""
    if not os.path.isfile(csv_path):
        raise PlotError(f"{csv_path}: no such file; give a run directory that holds progress.csv")
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    out = {k: [] for k in keys}
    for row in rows:
        for k in keys:
            cell = (row.get(k) or "").strip()
            try:
                value = float(cell) if cell else None
            except ValueError:
                value = None
            out[k].append(value if value is None or math.isfinite(value) else None)
    return out


def run_events(log_txt):
    """[(step, "preempted" | "resumed" | "preempted, resumed")] from a run's log.txt, in step
    order; [] when the file is missing."""
    events = {}
    try:
        with open(log_txt, errors="replace") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        for pattern, what in _EVENTS:
            m = pattern.match(line.strip())
            if m and what not in events.setdefault(int(m.group(1)), []):
                events[int(m.group(1))].append(what)
    return [(step, ", ".join(whats)) for step, whats in sorted(events.items())]


def _series(table, keys):
    """{key: sorted [(step, value)]} of the keys with at least one value (last row per step)."""
    series = {}
    for k in keys:
        points = {}
        for step, v in zip(table["step"], table[k]):
            if step is not None and v is not None and v > 0:
                points[int(step)] = v
        if points:
            series[k] = sorted(points.items())
    return series


def loss_figure(series, marks=(), size=(720, 440), title=None, keys=QUARTILE_KEYS):
    """The matplotlib Figure of the loss curve (no pyplot: no global state, no display).

    ``series``: {key: [(step, value)]} (``_series``); ``marks``: [(step, label)] drawn as dashed
    vertical lines, those outside the plotted steps left out. The plot area spans x = 70 ..
    width - 20 px and exactly the plotted steps, so a step's pixel column is known.
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

    w, h = size
    dpi = 100
    fig = Figure(figsize=(w / dpi, h / dpi), dpi=dpi)
    left, right, top, bottom = 70, 20, 84, 50  # the legend sits above the plot
    ax = fig.add_axes((left / w, bottom / h, (w - left - right) / w, (h - top - bottom) / h))
    steps = [s for pts in series.values() for s, _ in pts]
    x0, x1 = min(steps), max(steps)
    if x1 == x0:
        x1 = x0 + 1
    for i, k in enumerate(keys):
        if k not in series:
            continue
        xs, ys = zip(*series[k])
        q = k.rsplit("_q", 1)[-1]
        lo, hi = int(q) * 25, int(q) * 25 + 25
        ax.plot(xs, ys, color=tuple(c / 255 for c in COLOURS[i % len(COLOURS)]),
                linewidth=2.0, antialiased=False,
                label=f"q{q}: timesteps {lo}-{hi}% of T" + (" (least noise)" if q == "0" else
                                                            " (most noise)" if q == "3" else ""),
                marker="o" if len(xs) == 1 else None)
    ax.set_yscale("log")
    ax.set_xlim(x0, x1)
    ax.margins(x=0)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=8, steps=[1, 2, 2.5, 5, 10], integer=True))
    # plain numbers at 1, 2, 5 x 10^k (not matplotlib's 6 x 10^-2 minor labels)
    values = [v for pts in series.values() for _, v in pts]
    narrow = math.log10(max(values) / min(values)) < 1.0  # under a decade: 1, 2, 3, 5, 7 x 10^k
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(
        (1.0, 2.0, 3.0, 5.0, 7.0) if narrow else (1.0, 2.0, 5.0))))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(True, which="major", color="#dddddd", linewidth=0.8)
    ax.grid(True, which="minor", axis="y", color="#f0f0f0", linewidth=0.5)
    ax.set_xlabel("training step")
    ax.set_ylabel("training loss (log scale)")
    mark = tuple(c / 255 for c in MARK_COLOUR)
    ymin, ymax = ax.get_ylim()
    for step, label in marks:
        if not x0 <= step <= x1:
            continue
        ax.axvline(step, color=mark, linestyle=(0, (4, 3)), linewidth=2.2, antialiased=False)
        frac = (step - x0) / (x1 - x0)
        ax.annotate(f"{label} at step {step}", xy=(step, 0.03), xycoords=("data", "axes fraction"),
                    xytext=(5 if frac < 0.6 else -5, 0), textcoords="offset points",
                    ha="left" if frac < 0.6 else "right", color=mark, fontsize=9,
                    bbox=dict(boxstyle="square,pad=0.15", facecolor="white", edgecolor="none"))
    ax.legend(title="the loss by quarter of the timestep range t = 0 .. T", fontsize=8,
              title_fontsize=8, loc="lower left", bbox_to_anchor=(0, 1.01), ncol=2,
              frameon=False, borderaxespad=0)
    fig.suptitle(title or "training loss by timestep quartile", x=left / w, ha="left",
                 y=1 - 8 / h, fontsize=10)
    return fig


def plot_loss_curve(csv_path, png_path, keys=QUARTILE_KEYS, size=(720, 440), marks=()):
    """Draw ``keys`` of ``csv_path`` against the step (log-scale y) into ``png_path`` (an RGB
    PNG of ``size`` px, drawn with matplotlib: axis titles, a legend saying what q0..q3 are).

    ``marks``: [(step, label)] drawn as dashed vertical lines with their label and step (e.g.
    ``run_events(LOG_DIR/log.txt)``); those outside the plotted steps are left out.

    :return: the number of steps plotted.
    :raises PlotError: when the file is missing or none of ``keys`` has a value, or matplotlib
        is not installed.
    """
    series = _series(read_progress(csv_path, ("step",) + tuple(keys)), keys)
    if not series:
        raise PlotError(f"{csv_path}: no {', '.join(keys)} values to plot (train for at least "
                        f"one --log_interval first)")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        raise PlotError("the loss curve needs matplotlib: pip install matplotlib (or the "
                        "project's demo extra, pip install -e '.[demo]')") from None
    from PIL import Image

    fig = loss_figure(series, marks=marks, size=size, keys=keys)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    img = Image.frombuffer("RGBA", canvas.get_width_height(), canvas.buffer_rgba(), "raw",
                           "RGBA", 0, 1).convert("RGB")
    tmp = png_path + ".tmp.png"
    img.save(tmp)
    os.replace(tmp, png_path)
    return len({s for pts in series.values() for s, _ in pts})
