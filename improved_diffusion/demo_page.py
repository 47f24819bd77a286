"""The demo's one page to look at: ``write_page(out_dir)`` renders ``OUT/index.html`` from what
``scripts/demo.py`` leaves in its output folder.

    from improved_diffusion.demo_page import write_page
    write_page("demo_out")          # -> "demo_out/index.html"

What it shows, each part only when its files are there:

- the figures table (``eval.json``: classifier confidence, label agreement, class histogram,
  Frechet distances) and the guidance table (``guidance.json``: a list of rows
  ``{"way", "label_agreement", "mean_confidence", "command"}``);
- the sample grid(s) (``samples/*.png``) and the loss curve (``samples/loss_curve.png``, the
  preemption/resume step marked on it by ``progress_plot``);
- the grids drawn while training (``run/samples/grid_{step:06d}.png``, ``--sample_interval``);
- any other PNG of the folder (outside ``data/``), the summary (``summary.txt``) and the
  settings (``settings.json``).

The page is self-contained: one HTML file with its CSS inline, no script, nothing from the
network; images are referenced by their path relative to the page, so the folder can be moved or
copied whole. Small images are scaled up by whole factors, pixelated, so 8x8 digits stay sharp.
"""
import html
import json
import os
import re
from urllib.parse import quote

PAGE = "index.html"
# Display images at least this wide (CSS pixels), by a whole factor.
MIN_WIDTH = 320
# Images shown under "other images" at most (a folder of many PNGs is not a gallery).
MAX_OTHER_IMAGES = 24
_TRAIN_GRID = re.compile(r"^grid_(\d+)\.png$")

_CSS = """
body { font-family: sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.5em 0; }
td, th { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { display: inline-block; margin: 0.4em 1em 0.8em 0; vertical-align: top; }
figcaption { font-size: 0.85em; color: #555; max-width: 720px; }
img.px { image-rendering: pixelated; }
pre, code { background: #f6f6f6; font-size: 0.85em; }
pre { padding: 0.6em; overflow-x: auto; }
"""


def _read_json(path):
    """The parsed JSON file, or None when it is missing or unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _read_text(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.3f}"
    if isinstance(v, (list, tuple)):
        return " ".join(_fmt(x) for x in v)
    return "" if v is None else str(v)


def _img(out_dir, path, caption):
    """A <figure> of the image at `path`, by its path relative to the page."""
    rel = os.path.relpath(path, out_dir).replace(os.sep, "/")
    width = ""
    try:
        from PIL import Image

        with Image.open(path) as im:
            w = im.size[0]
        if 0 < w < MIN_WIDTH:
            width = f' width="{w * -(-MIN_WIDTH // w)}" class="px"'
    except (ImportError, OSError):
        pass
    return (f'<figure><img src="{html.escape(quote(rel))}" alt="{html.escape(rel)}"{width}>'
            f"<figcaption>{html.escape(caption)} (<code>{html.escape(rel)}</code>)</figcaption>"
            f"</figure>")


def _table(head, rows, num_cols=()):
    out = ["<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
    for row in rows:
        cells = []
        for i, v in enumerate(row):
            cls = ' class="num"' if i in num_cols else ""
            cells.append(f"<td{cls}>{v}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    return "\n".join(out) + "</table>"


def _figures(fig):
    """Rows of the figures table from eval.json's dict."""
    n = fig.get("num_samples")
    rows = [("mean classifier confidence", fig.get("mean_confidence")),
            ("label agreement", fig.get("label_agreement")),
            ("class histogram (0..9)", fig.get("histogram")),
            ("Frechet distance, generated vs real", fig.get("fid_real_vs_generated")),
            ("Frechet distance, real half vs half", fig.get("fid_real_halves")),
            (f"Frechet distance, {n} real vs real", fig.get("fid_real_subset_same_n")),
            ("samples scored", n)]
    return _table(("figure", "value"),
                  [(html.escape(k), html.escape(_fmt(v))) for k, v in rows if v is not None],
                  num_cols=(1,))


def _guidance(rows):
    good = [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []
    return _table(
        ("way", "label agreement", "mean confidence", "command"),
        [(html.escape(_fmt(r.get("way"))), html.escape(_fmt(r.get("label_agreement"))),
          html.escape(_fmt(r.get("mean_confidence"))),
          f"<code>{html.escape(_fmt(r.get('command')))}</code>") for r in good],
        num_cols=(1, 2))


def _pngs(folder):
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [os.path.join(folder, n) for n in names if n.lower().endswith(".png")]


def render(out_dir):
    """The page's HTML for the demo folder `out_dir` (a string; reads only)."""
    out_dir = os.path.abspath(out_dir)
    samples, run_samples = os.path.join(out_dir, "samples"), os.path.join(out_dir, "run", "samples")
    shown = set()
    parts = [f"<h1>improved-diffusion demo</h1><p>From <code>{html.escape(out_dir)}</code>: "
             "data, training with a preemption and its auto-resume, sampling, evaluation.</p>"]

    summary = _read_text(os.path.join(out_dir, "summary.txt"))
    for line in (summary or "").splitlines():
        if line.startswith("preemption:"):  # demo.py's summary line
            parts.append(f"<p><b>Preemption:</b> {html.escape(line.split(':', 1)[1].strip())}</p>")
    fig = _read_json(os.path.join(out_dir, "eval.json"))
    if isinstance(fig, dict):
        parts.append("<h2>Figures</h2>" + _figures(fig))
    guidance = _read_json(os.path.join(out_dir, "guidance.json"))
    if guidance is not None:
        parts.append("<h2>Guidance</h2>" + _guidance(guidance))

    grids = [p for p in _pngs(samples) if os.path.basename(p) != "loss_curve.png"]
    if grids:
        parts.append("<h2>Samples</h2>" + "".join(
            _img(out_dir, p, "samples of the final EMA weights; column c = class c")
            for p in grids))
        shown.update(grids)
    curve = os.path.join(samples, "loss_curve.png")
    if os.path.isfile(curve):
        parts.append("<h2>Loss curve</h2>" + _img(
            out_dir, curve, "training loss by timestep quartile (log scale); the dashed line "
            "marks the step where the run was preempted and resumed"))
        shown.add(curve)

    during = [(int(m.group(1)), p) for p in _pngs(run_samples)
              if (m := _TRAIN_GRID.match(os.path.basename(p)))]
    if during:
        parts.append("<h2>Samples while training</h2><p>EMA samples with fixed seeds and labels "
                     "(<code>--sample_interval</code>), so grids of different steps compare.</p>"
                     + "".join(_img(out_dir, p, f"step {step}") for step, p in sorted(during)))
        shown.update(p for _, p in during)

    others = []
    for root, dirs, files in os.walk(out_dir):
        dirs[:] = sorted(d for d in dirs if os.path.join(root, d) != os.path.join(out_dir, "data"))
        others += [os.path.join(root, f) for f in sorted(files)
                   if f.lower().endswith(".png") and os.path.join(root, f) not in shown]
    if others:
        parts.append("<h2>Other images</h2>" + "".join(
            _img(out_dir, p, os.path.basename(p)) for p in others[:MAX_OTHER_IMAGES]))

    if summary is not None:
        parts.append(f"<h2>Summary</h2><pre>{html.escape(summary)}</pre>")
    settings = _read_json(os.path.join(out_dir, "settings.json"))
    if isinstance(settings, dict):
        parts.append("<h2>Settings</h2>" + _table(
            ("setting", "value"),
            [(html.escape(str(k)), html.escape(_fmt(v))) for k, v in settings.items()]))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<title>improved-diffusion demo</title>"
            f"<style>{_CSS}</style></head><body>\n" + "\n".join(parts) + "\n</body></html>\n")


def write_page(out_dir):
    """Write ``out_dir/index.html`` (atomically) from the demo's files there; returns its path."""
    path = os.path.join(out_dir, PAGE)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(render(out_dir))
    os.replace(tmp, path)
    return path
