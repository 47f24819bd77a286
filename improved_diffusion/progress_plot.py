"""A run's loss curve as a PNG, from its progress.csv: the loss by timestep quartile
(``loss_q0`` .. ``loss_q3``, as the trainer logs them) against the step, on a log scale.

Drawn with PIL alone (no plotting library). Used by ``scripts/plot_progress.py RUN_DIR`` and by
the demo, which writes ``loss_curve.png`` beside its sample grid. The steps where the run was
preempted or resumed (found in its ``log.txt``, ``run_events``) are marked on the curve.
"""
import csv
import math
import os
import re

from .errors import UserError

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


def plot_loss_curve(csv_path, png_path, keys=QUARTILE_KEYS, size=(720, 440), marks=()):
    """Draw ``keys`` of ``csv_path`` against the step (log-scale y) into ``png_path``.

    ``marks``: [(step, label)] drawn as dashed vertical lines with their label and step (e.g.
    ``run_events(LOG_DIR/log.txt)``); those outside the plotted steps are left out.

    :return: the number of steps plotted.
    :raises PlotError: when the file is missing or none of ``keys`` has a value.
    """
    from PIL import Image, ImageDraw

    series = _series(read_progress(csv_path, ("step",) + tuple(keys)), keys)
    if not series:
        raise PlotError(f"{csv_path}: no {', '.join(keys)} values to plot (train for at least "
                        f"one --log_interval first)")
    steps = [s for pts in series.values() for s, _ in pts]
    values = [math.log10(v) for pts in series.values() for _, v in pts]
    x0, x1 = min(steps), max(steps)
    y0, y1 = min(values), max(values)
    if x1 == x0:
        x1 = x0 + 1
    if y1 - y0 < 1e-6:
        y0, y1 = y0 - 0.5, y1 + 0.5
    w, h = size
    left, right, top, bottom = 70, 20, 40, 50
    img = Image.new("RGB", size, "white")
    d = ImageDraw.Draw(img)

    def px(step, logv):
        x = left + (step - x0) / (x1 - x0) * (w - left - right)
        y = top + (y1 - logv) / (y1 - y0) * (h - top - bottom)
        return x, y

    d.rectangle([left, top, w - right, h - bottom], outline=(0, 0, 0))
    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
        logv = y0 + frac * (y1 - y0)
        _, y = px(x0, logv)
        d.line([left - 4, y, left, y], fill=(0, 0, 0))
        d.line([left + 1, y, w - right - 1, y], fill=(230, 230, 230))
        d.text((4, y - 6), f"{10 ** logv:.3g}", fill=(0, 0, 0))
        step = x0 + frac * (x1 - x0)
        x, _ = px(step, y0)
        d.line([x, h - bottom, x, h - bottom + 4], fill=(0, 0, 0))
        d.text((x - 12, h - bottom + 8), f"{step:.0f}", fill=(0, 0, 0))
    d.text((w // 2 - 14, h - 18), "step", fill=(0, 0, 0))
    d.text((left, 8), f"training loss by timestep quartile (log scale): {csv_path}"[:100],
           fill=(0, 0, 0))
    for step, label in marks:
        if not x0 <= step <= x1:
            continue
        x, _ = px(step, y0)
        for y in range(top + 1, h - bottom, 8):
            d.line([x, y, x, min(y + 4, h - bottom - 1)], fill=MARK_COLOUR, width=2)
        text = f"{label} at step {step}"
        tx = x + 5 if x + 5 + d.textlength(text) <= w - right else x - 5 - d.textlength(text)
        d.text((tx, h - bottom - 16), text, fill=MARK_COLOUR)
    for i, k in enumerate(keys):
        if k not in series:
            continue
        colour = COLOURS[i % len(COLOURS)]
        pts = [px(s, math.log10(v)) for s, v in series[k]]
        if len(pts) > 1:
            d.line(pts, fill=colour, width=2)
        for x, y in pts[-1:]:
            d.ellipse([x - 2, y - 2, x + 2, y + 2], fill=colour)
        lx = w - right - 90
        ly = top + 8 + 14 * i
        d.line([lx, ly + 6, lx + 18, ly + 6], fill=colour, width=3)
        d.text((lx + 24, ly), k, fill=(0, 0, 0))
    tmp = png_path + ".tmp.png"
    img.save(tmp)
    os.replace(tmp, png_path)
    return len(set(steps))
