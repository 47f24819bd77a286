"""The demo's one page to look at: ``write_page(out_dir)`` renders ``OUT/index.html`` from what
``scripts/demo.py`` leaves in its output folder.

    from improved_diffusion.apps.demo_page import write_page
    write_page("demo_out")          # -> "demo_out/index.html"

What it shows, each part only when its files are there:

- above the fold, what was trained (``demo.json``, the demo's record: data, image size, the
  class-conditional UNet and its size, steps, batch, time) and the training command (its
  ``training.command``, short_command), the sample grid (``samples/*.png``)
  and the figures table (``eval.json``: classifier confidence, label agreement, class histogram,
  Frechet distance, each beside its reference: the real digits' own, scored the same way, and
  the Frechet floor for that many samples);
- ADM's five figures (``eval.json``'s "adm": FID, sFID, IS, precision, recall) of the samples
  and of held-out real digits;
- FID while training (``run/eval/fid_{step:06d}.json``, train.py --eval_interval) and the
  post-hoc EMA chosen by FID (``phema_sweep.json`` and its plot ``eval/phema_sweep.png``, from
  ``ckpt.py phema --evaluate``): the widths' table, the best marked, beside the curve;
- the guidance table (``guidance.json``: rows ``{"way", "label_agreement", "mean_confidence",
  "command", "grid", "reference_label_agreement", "reference_what"}``), each way's grid in its
  row and its command under it, as typed in the repository (short_command);
- the loss curve (``samples/loss_curve.png``, the preemption/resume step marked on it by
  ``progress_plot``), the grids drawn while training (``run/samples/grid_{step:06d}.png``,
  ``--sample_interval``), any other PNG of the folder (outside ``data/``), the summary
  (``summary.txt``) and the settings (``settings.json``).

The page is self-contained: one HTML file with its CSS inline, no script, nothing from the
network; images are referenced by their path relative to the page, so the folder can be moved or
copied whole; each image and its path link to its file. Small images are scaled up by whole
factors, pixelated, so 8x8 digits stay sharp.
"""
import html
import json
import os
import re
from urllib.parse import quote

PAGE = "index.html"
# scripts/demo.py's record of the run (what was trained, the stages' times, its programs).
RECORD = "demo.json"
# Display images at least this wide (CSS pixels), by a whole factor.
MIN_WIDTH = 320
# Images shown under "other images" at most (a folder of many PNGs is not a gallery).
MAX_OTHER_IMAGES = 24
_TRAIN_GRID = re.compile(r"^grid_(\d+)\.png$")
_TRAIN_FID = re.compile(r"^fid_(\d+)\.json$")
# scripts/demo.py's post-hoc EMA sweep (ckpt.py phema --evaluate --json, the plot's path relative)
SWEEP = "phema_sweep.json"

_CSS = """
body { font-family: sans-serif; margin: 2em auto; max-width: 1160px; padding: 0 1em;
       color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.6em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.5em 0; }
td, th { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
figure { display: inline-block; margin: 0.4em 1em 0.8em 0; vertical-align: top; }
figcaption { font-size: 0.85em; color: #555; max-width: 400px; }
img.px { image-rendering: pixelated; }
pre, code { background: #f6f6f6; font-size: 0.85em; }
pre { padding: 0.6em; overflow-x: auto; }
pre.wrap { white-space: pre-wrap; overflow-wrap: anywhere; max-width: 100%; }
p.lead { font-size: 1.05em; line-height: 1.45; max-width: 1000px; }
.note { font-size: 0.85em; color: #555; }
div.row { display: flex; gap: 2em; align-items: flex-start; flex-wrap: wrap; }
div.row h2 { margin-top: 0; }
div.row > div { flex: 0 1 auto; min-width: 0; }
div.row .note { max-width: 34em; }
table.guidance td { vertical-align: middle; }
table.guidance th { max-width: 10em; }
tr.cmd td { border-top: none; padding-top: 0; padding-bottom: 0.6em; }
tr.cmd code { white-space: normal; color: #444; background: none; }
tr.cmd code span, p.cmd code span { white-space: nowrap; }
p.cmd code { white-space: normal; color: #444; background: none; }
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


def _img(out_dir, path, caption, min_width=MIN_WIDTH, max_width=None):
    """A <figure> of the image at `path`, by its path relative to the page (caption None: the
    bare image); shown at least `min_width` px wide (a whole factor), at most `max_width`."""
    rel = os.path.relpath(path, out_dir).replace(os.sep, "/")
    width = ""
    try:
        from PIL import Image

        with Image.open(path) as im:
            w = im.size[0]
        if 0 < w < min_width:
            width = f' width="{w * -(-min_width // w)}" class="px"'
        elif max_width and w > max_width:
            width = f' width="{max_width}"'
    except (ImportError, OSError):
        pass
    href = html.escape(quote(rel))
    tag = f'<a href="{href}"><img src="{href}" alt="{html.escape(rel)}"{width}></a>'
    if caption is None:
        return tag
    return (f"<figure>{tag}<figcaption>{html.escape(caption)} (<a href=\"{href}\"><code>"
            f"{html.escape(rel)}</code></a>)</figcaption></figure>")


def _table(head, rows, num_cols=()):
    out = ["<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"]
    for row in rows:
        cells = []
        for i, v in enumerate(row):
            cls = ' class="num"' if i in num_cols else ""
            cells.append(f"<td{cls}>{v}</td>")
        out.append("<tr>" + "".join(cells) + "</tr>")
    return "\n".join(out) + "</table>"


def _num(v, digits=3):
    return "" if v is None else (f"{v:.{digits}f}" if isinstance(v, float) else _fmt(v))


def _count(n):
    """707267 -> '707 k'; 12345678 -> '12.3 M'."""
    if n >= 10 ** 6:
        return f"{n / 1e6:.1f} M"
    return f"{n / 1e3:.0f} k" if n >= 10 ** 4 else str(n)


def _minutes(sec):
    return f"{sec / 60:.1f} min" if sec >= 90 else f"{sec:.0f} s"


def _what_was_trained(rec, settings):
    """The lead paragraph: what was trained, on what, how long; from demo.json (the demo's own
    record), else from settings.json alone. Returns HTML or ''."""
    rec = rec if isinstance(rec, dict) else {}
    st = settings if isinstance(settings, dict) else {}
    data, model = rec.get("data") or {}, rec.get("model") or {}
    train, samp = rec.get("training") or {}, rec.get("sampling") or {}
    sec = rec.get("seconds") or {}
    size = data.get("image_size", st.get("image_size"))
    steps = train.get("steps", st.get("steps"))
    if size is None or steps is None:
        return ""
    e = html.escape
    batch, ranks = train.get("batch_size", st.get("batch_size")), train.get("ranks",
                                                                           st.get("ranks"))
    params = model.get("parameters")
    arch = ", ".join(x for x in (
        f"{_count(params)} parameters" if params else "",
        f"{model.get('num_channels', st.get('num_channels'))} channels x "
        f"{model.get('channel_mult', st.get('channel_mult'))}",
        f"{model.get('num_res_blocks', st.get('num_res_blocks'))} res block(s) per level")
        if x)
    n_img, classes = data.get("images", 1797), data.get("classes", 10)
    src = data.get("source_px", 8)
    parts = [f"<p class=\"lead\"><b>What was trained:</b> a <b>class-conditional UNet</b> "
             f"({e(arch)}) on <b>{e(data.get('name', 'handwritten digits'))}</b>: {n_img} real "
             f"digits, {classes} classes, "
             + (f"{src}x{src} px upscaled to " if int(size) != int(src) else "at ")
             + f"<b>{size}x{size} px</b>; "
             f"<b>{steps} training steps</b>"]
    if batch and ranks:
        parts.append(f" at batch {batch} x {ranks} ranks ({int(steps) * int(batch) * int(ranks):,}"
                     f" images seen)")
    ds = model.get("diffusion_steps", st.get("diffusion_steps"))
    if ds:
        schedule = model.get("noise_schedule", st.get("noise_schedule", ""))
        parts.append(f", a {ds}-step {e(str(schedule))} noise process")
    if sec.get("train") is not None:
        parts.append(f", in <b>{_minutes(sec['train'])}</b> on {ranks} CPU processes")
    if (train.get("preemption") or {}).get("preempted"):
        parts.append(" through a preemption and its automatic resume (below)")
    parts.append(".")
    n = samp.get("num_samples", st.get("num_samples"))
    if n:
        rate = model.get("ema_rate", st.get("ema_rate"))
        parts.append(f" <b>Sampled:</b> {n} digits, DDIM {e(str(samp.get('sample_steps', '')))} "
                     f"steps, from the EMA weights (rate {e(str(rate))}), classes 0..9 in turn.")
    if sec.get("total") is not None:
        parts.append(f" The whole demo (data, training, sampling, evaluation, guidance) took "
                     f"{_minutes(sec['total'])}.")
    return "".join(parts) + "</p>"


def _figures(fig):
    """The figures table from eval.json's dict: the samples' value beside the reference (the
    real digits' own, scored the same way; the Frechet floor for this many samples)."""
    n = fig.get("num_samples")
    ref = fig.get("reference") if isinstance(fig.get("reference"), dict) else {}
    floor_n = ref.get("fid_floor_n", n)
    rows = [("mean classifier confidence", fig.get("mean_confidence"),
             ref.get("mean_confidence")),
            ("label agreement", fig.get("label_agreement"),
             ref.get("label_agreement")),
            ("class histogram (0..9)", fig.get("histogram"), ref.get("histogram")),
            ("Frechet distance to the real digits",
             fig.get("fid_real_vs_generated"),
             ref.get("fid_floor", fig.get("fid_real_subset_same_n")))]
    if not ref:  # an older eval.json: its real-vs-real distances as rows of their own
        rows += [("Frechet distance, real half vs half", fig.get("fid_real_halves"), None),
                 (f"Frechet distance, {n} real vs real", fig.get("fid_real_subset_same_n"), None)]
    body = [(html.escape(k), html.escape(_num(v)), html.escape(_num(r)))
            for k, v, r in rows if v is not None]
    note = []
    if ref.get("num_samples"):
        note.append(f"Real digits: {ref['num_samples']} of the training images, held out of "
                    f"the reference batch, scored by the same evaluator; for the Frechet "
                    f"distance, the floor for {floor_n} samples ({floor_n} real digits vs the "
                    f"real digits).")
    note.append(f"Label agreement: the share of samples the classifier reads as the class they "
                f"were asked for; chance {_num(ref.get('chance_label_agreement', 0.1))} (1 in 10 "
                f"classes). The Frechet distance is in the classifier's features. A perfect model "
                f"scores like the real digits.")
    return (_table(("figure", f"samples ({n})", "real digits"), body, num_cols=(1, 2))
            + f"<p class=\"note\">{' '.join(note)}</p>")


ADM_ROWS = (("fid", "FID", "lower is better"), ("sfid", "sFID", "lower is better"),
            ("inception_score", "Inception Score", "higher is better (at most 10 classes)"),
            ("precision", "precision", "higher: samples look like real digits"),
            ("recall", "recall", "higher: samples cover the real digits"))


def _adm(adm, out_dir, programs, sample_npz):
    """ADM's five figures (scripts/evaluate.py --features digits) of the samples beside the
    real digits'."""
    ref_batch = os.path.join(out_dir, str(adm.get("ref_batch", "REF.npz")))
    cmd, used_out = short_command(f"python scripts/evaluate.py {ref_batch} {sample_npz} "
                                  f"--features digits", out_dir, programs)
    if used_out:
        cmd += f"   ($OUT is {os.path.abspath(out_dir)})"
    samples = adm.get("samples") if isinstance(adm.get("samples"), dict) else {}
    real = adm.get("real") if isinstance(adm.get("real"), dict) else {}
    body = [(html.escape(name), html.escape(_num(samples.get(k))), html.escape(_num(real.get(k))),
             html.escape(note)) for k, name, note in ADM_ROWS if k in samples]
    head = ("figure", f"samples ({samples.get('num_samples', '')})",
            f"real digits ({real.get('num_samples', '')}, held out)", "")
    return (_table(head, body, num_cols=(1, 2))
            + f"<p class=\"note\">ADM's evaluator with the digits classifier as its feature "
              f"network (<code>{html.escape(cmd)}</code>), against a reference batch of "
              f"{samples.get('num_ref', '')} real digits that the held-out ones are not part "
              f"of. With few samples every figure is noisy; compare with the real column, not "
              f"with ImageNet's numbers.</p>")


def _training_fids(run_eval):
    """[(step, fid, is)] of train.py --eval_interval's records in ``run_eval``."""
    out = []
    names = sorted(os.listdir(run_eval)) if os.path.isdir(run_eval) else []
    for name in names:
        rec = _read_json(os.path.join(run_eval, name)) if _TRAIN_FID.match(name) else None
        if isinstance(rec, dict) and "step" in rec:
            fid = next((v for k, v in rec.items() if k.startswith("fid_")), None)
            score = next((v for k, v in rec.items() if k.startswith("is_")), None)
            out.append((rec["step"], fid, score))
    return out


def _fid_section(out_dir, sweep, during, programs):
    """FID while training and the post-hoc EMA sweep: (html, the images shown)."""
    parts, shown = [], []
    if during:
        parts.append("<div><h3>While training</h3>" + _table(
            ("step", "FID", "IS"),
            [(html.escape(str(step)), html.escape(_num(fid, 2)), html.escape(_num(score, 3)))
             for step, fid, score in during], num_cols=(0, 1, 2))
            + "<p class=\"note\"><code>--eval_interval</code>: the EMA's samples scored against "
              "the real digits by the digits classifier, training unchanged.</p></div>")
    if isinstance(sweep, dict) and isinstance(sweep.get("table"), list):
        best = (sweep.get("best") or {}).get("std")
        rows = [(html.escape(f"{r.get('std', 0):.3f}" + (" (best)" if r.get("std") == best
                                                           else "")),
                 html.escape(_num(r.get("fid"), 2)), html.escape(_num(r.get("inception_score"))))
                for r in sweep["table"] if isinstance(r, dict)]
        cmd = sweep.get("command")
        note = ""
        if isinstance(cmd, list):
            text, used_out = short_command(" ".join(str(c) for c in cmd), out_dir, programs)
            note = f"<p class=\"note\"><code>{html.escape(text)}</code>" + (
                f" ($OUT is {html.escape(os.path.abspath(out_dir))})" if used_out else "") + "</p>"
        parts.append(f"<div><h3>Post-hoc EMA by FID (step {html.escape(str(sweep.get('step')))})"
                     "</h3>" + _table(("std", "FID", "IS"), rows, num_cols=(1, 2)) + note
                     + "</div>")
        plot = os.path.join(out_dir, str(sweep.get("plot", "")))
        if sweep.get("plot") and os.path.isfile(plot):
            parts.append("<div>" + _img(out_dir, plot, "FID of each reconstructed post-hoc EMA "
                                        "width (EDM2's sigma_rel), the best marked") + "</div>")
            shown.append(plot)
    if not parts:
        return None, shown
    return "<h2>FID while training and the post-hoc EMA</h2><div class=\"row\">" + "".join(
        parts) + "</div>", shown


def short_command(cmd, out_dir, programs=None):
    """A command as typed in the repository (tokens of absolute paths made short): the Python
    and mpiexec of the demo -> ``python``/``mpiexec``, files of the repository relative to it,
    files of the demo folder relative to the repository when inside it, else ``$OUT/...``.
    Returns (the short command, whether $OUT was used)."""
    programs = programs if isinstance(programs, dict) else {}
    here = os.path.abspath(__file__)  # improved_diffusion/apps/demo_page.py: three levels up
    repo = programs.get("repo") or os.path.dirname(os.path.dirname(os.path.dirname(here)))
    out_dir = os.path.abspath(out_dir)
    in_repo = out_dir.startswith(repo.rstrip(os.sep) + os.sep)
    used_out = False
    words = []
    for w in str(cmd).split(" "):
        if w and w in (programs.get("python"), programs.get("mpiexec")) or (
                os.path.isabs(w) and re.fullmatch(r"python[\d.]*|mpiexec", os.path.basename(w))):
            w = os.path.basename(w) if not os.path.basename(w).startswith("python") else "python"
        elif w == out_dir or w.startswith(out_dir + os.sep):
            if in_repo:
                w = os.path.relpath(w, repo)
            else:
                w, used_out = "$OUT" + w[len(out_dir):], True
        elif w.startswith(repo.rstrip(os.sep) + os.sep):
            w = os.path.relpath(w, repo)
        words.append(w)
    return " ".join(words), used_out


def _guidance(rows, out_dir, programs):
    """The guidance table: each way with its samples' grid, its figures beside the reference,
    and the command under it (short, wrapped)."""
    good = [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []
    out = ["<table class=\"guidance\"><tr><th>way</th><th>samples (column c = class c)</th>"
           "<th>label agreement</th><th>reference: real digits' (chance for the null label)</th>"
           "<th>mean confidence</th></tr>"]
    shown, used_out = [], False
    for r in good:
        grid = r.get("grid")
        path = os.path.join(out_dir, grid) if isinstance(grid, str) else None
        cell = ""
        if path and os.path.isfile(path):
            cell = _img(out_dir, path, None, min_width=160, max_width=200)
            shown.append(path)
        ref = r.get("reference_label_agreement")
        what = str(r.get("reference_what") or "")
        ref_text = "" if ref is None else _num(ref) + (
            " <span class=\"note\">(chance)</span>" if what.startswith("chance") else "")
        cmd, used = short_command(r.get("command"), out_dir, programs)
        used_out = used_out or used
        out.append(f"<tr><td>{html.escape(_fmt(r.get('way')))}</td><td>{cell}</td>"
                   f"<td class=\"num\">{html.escape(_num(r.get('label_agreement')))}</td>"
                   f"<td class=\"num\">{ref_text}</td>"
                   f"<td class=\"num\">{html.escape(_num(r.get('mean_confidence')))}</td></tr>")
        if cmd:
            # one <span> a word: lines break between words, never after a flag's "--"
            words = " ".join(f"<span>{html.escape(w)}</span>" for w in cmd.split(" "))
            out.append(f"<tr class=\"cmd\"><td colspan=\"5\"><code>{words}</code></td></tr>")
    out.append("</table>")
    note = "Each command (under its row) runs from the repository's folder"
    note += (f"; <code>$OUT</code> is <code>{html.escape(os.path.abspath(out_dir))}</code>."
             if used_out else ".")
    return f"<p class=\"note\">{note}</p>" + "\n".join(out), shown


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
    rec = _read_json(os.path.join(out_dir, RECORD))
    settings = _read_json(os.path.join(out_dir, "settings.json"))
    programs = rec.get("programs") if isinstance(rec, dict) else None
    parts = ["<h1>improved-diffusion demo: a diffusion model learns handwritten digits</h1>",
             _what_was_trained(rec, settings)]
    train_cmd = ((rec.get("training") or {}).get("command") if isinstance(rec, dict) else None)
    if train_cmd:  # demo.json's record of the training command, as typed in the repository
        cmd, used_out = short_command(train_cmd, out_dir, programs)
        words = " ".join(f"<span>{html.escape(w)}</span>" for w in cmd.split(" "))
        where = (f"; <code>$OUT</code> is <code>{html.escape(out_dir)}</code>" if used_out
                 else "")
        parts.append(f"<p class=\"note\">Trained with (from the repository's folder{where}):"
                     f"</p><p class=\"cmd\"><code>{words}</code></p>")

    summary = _read_text(os.path.join(out_dir, "summary.txt"))
    for line in (summary or "").splitlines():
        if line.startswith("preemption:"):  # demo.py's summary line
            parts.append(f"<p><b>Preemption:</b> {html.escape(line.split(':', 1)[1].strip())}</p>")

    grids = [p for p in _pngs(samples) if os.path.basename(p) != "loss_curve.png"]
    fig = _read_json(os.path.join(out_dir, "eval.json"))
    top = []
    if grids:
        top.append("<div>" + "".join(_img(out_dir, p, "samples of the final EMA weights; "
                                          "column c = class c", max_width=400)
                                     for p in grids) + "</div>")
        shown.update(grids)
    if isinstance(fig, dict):
        top.append("<div><h2>Figures</h2>" + _figures(fig) + "</div>")
    if top:
        parts.append("<div class=\"row\">" + "".join(top) + "</div>")
    if isinstance(fig, dict) and isinstance(fig.get("adm"), dict):
        npz = fig.get("path") or os.path.join(out_dir, "samples", "SAMPLES.npz")
        parts.append("<h2>ADM's metrics</h2>" + _adm(fig["adm"], out_dir, programs, npz))
    section, in_section = _fid_section(out_dir, _read_json(os.path.join(out_dir, SWEEP)),
                                       _training_fids(os.path.join(out_dir, "run", "eval")),
                                       programs)
    if section:
        parts.append(section)
        shown.update(in_section)
    guidance = _read_json(os.path.join(out_dir, "guidance.json"))
    if guidance is not None:
        table, in_table = _guidance(guidance, out_dir, programs)
        parts.append("<h2>Guidance</h2><p class=\"note\">The same seeds and labels sampled each "
                     "way; the reference is the real digits' label agreement, or chance for the "
                     "null label (no class asked).</p>" + table)
        shown.update(in_table)

    curve = os.path.join(samples, "loss_curve.png")
    if os.path.isfile(curve):
        parts.append("<h2>Loss curve</h2>" + _img(
            out_dir, curve, "training loss by quarter of the timestep range (q0: the least "
            "noisy quarter, q3: the noisiest), log scale; the dashed line marks the step where "
            "the run was preempted and resumed"))
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
        parts.append(  # its long lines (paths, commands) wrap at the page's width
            f"<h2>Summary</h2><pre class=\"wrap\">{html.escape(summary)}</pre>")
    if isinstance(settings, dict):
        parts.append("<h2>Settings</h2>" + _table(
            ("setting", "value"),
            [(html.escape(str(k)), html.escape(_fmt(v))) for k, v in settings.items()]))
    parts.append(f"<p class=\"note\">Folder: <code>{html.escape(out_dir)}</code></p>")
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
