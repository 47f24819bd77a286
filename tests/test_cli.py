"""The command line (issue 13): no prefix matching, one-line errors with "did you mean", grouped
--help with defaults and meanings that agree with docs/flags.md, the class count from the data,
pasteable flags, the progress line, errors in log.txt, fp16 on a CPU."""
import importlib.util
import io
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch as th

from improved_diffusion.ckpt import checkpoint as ckpt
from improved_diffusion.ckpt import file_writer
from improved_diffusion import amp, logger, progress_plot, script_util
from improved_diffusion.infra import flags as flag_table
from improved_diffusion.apps.ckpt_tool import build_parser as ckpt_parser
from improved_diffusion.apps.ckpt_tool import main as ckpt_main
from improved_diffusion.infra.errors import UsageError

from conftest import PY, REPO, _run, hang_s, run_mpi, run_script, write_class_folder

# The pages whose commands, flags, files and links the tests check.
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# The scripts whose flags docs/flags.md lists (upstream's image_*.py reuse their parsers).
TABLE_SCRIPTS = ("train.py", "super_res_train.py", "sample.py", "super_res_sample.py", "nll.py",
                 "classifier_sample.py", "classifier_train.py")
# Flags of launchers and installers the README and docs/ show (not ours).
LAUNCHER_FLAGS = {"--nproc_per_node", "--nnodes", "--standalone", "--rdzv_endpoint",
                  "--master_addr", "--no-print-directory",
                  # torchrun's and SLURM's (sbatch/srun) own, in docs/CLUSTERS.md
                  "--local_addr", "--master_port", "--max_restarts", "--node_rank",
                  "--rdzv_backend", "--rdzv_id", "--cpus-per-task", "--gpus-per-node",
                  "--job-name", "--mpi", "--nodelist", "--nodes", "--ntasks-per-node",
                  "--open-mode", "--output", "--requeue", "--signal", "--time", "--gpus-per-task",
                  "--signals_to_handle", "--shutdown_timeout",
                  # unshare's and setpriv's, in docs/RELIABILITY.md
                  "--mount", "--bounding-set",
                  # gcp-storage-emulator's, in docs/CLUSTERS.md (trying a bucket locally)
                  "--host", "--port", "--in-memory"}
# What docs/flags.md shows as mistakes (typos, a shortened flag) and the usage line's placeholder.
EXAMPLE_MISTAKES = {"--num_chanels", "--num_channel", "--lr_anneal", "--bad_flag", "--flag"}
TINY = ["--image_size", "8", "--num_channels", "32", "--channel_mult", "1",
        "--attention_resolutions", "", "--num_res_blocks", "1", "--diffusion_steps", "20",
        "--noise_schedule", "cosine"]


def load_script(name):
    """scripts/<name> as a module (its parser, without running it)."""
    spec = importlib.util.spec_from_file_location(
        "script_" + name.replace(".py", ""), REPO / "scripts" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parser_of(name):
    return load_script(name).create_argparser()


def defaults_of(parser):
    return {a.dest: a.default for a in parser._actions if a.option_strings and a.dest != "help"}


def all_known_flags():
    known = set()
    for name in TABLE_SCRIPTS + ("demo.py",):
        known |= set(parser_of(name).known_flags())
    known |= set(ckpt_parser().known_flags()) | {"--json"}
    from improved_diffusion import evaluation

    known |= set(evaluation.create_parser().known_flags())  # scripts/evaluate.py
    known |= {"--out"}  # plot_progress.py
    for bench in (REPO / "benchmarks").glob("*.py"):  # the benchmarks' own flags
        known |= set(re.findall(r"add_argument\(\s*\"(--\w+)\"", bench.read_text()))
    for job in (REPO / "tests").glob("*_job.py"):  # the test jobs' switches, read from argv
        known |= set(re.findall(r"\"(--\w+)\" in sys\.argv", job.read_text()))
    return known


# ------------------------------------------------------------------------------ parsers


@pytest.mark.parametrize("script", TABLE_SCRIPTS)
def test_a_shortened_flag_is_refused_naming_the_flag_it_was_short_for(script):
    parser = parser_of(script)
    flag = "--classifier_width" if script == "classifier_train.py" else "--num_channels"
    with pytest.raises(UsageError, match=rf"unknown flag {flag[:-1]} \(did you mean "
                                         rf"{flag}\?\)"):
        parser.parse_args([flag[:-1], "64"])


def test_a_typo_names_the_closest_flag_and_several_unknown_flags_are_one_line():
    parser = parser_of("train.py")
    with pytest.raises(UsageError) as info:
        parser.parse_args(["--num_chanels", "64", "--lr_anneal", "10"])
    message = str(info.value)
    assert "\n" not in message
    assert "--num_chanels (did you mean --num_channels?)" in message
    assert "--lr_anneal (did you mean --lr_anneal_steps?)" in message
    assert message.endswith("see train.py --help")


def test_a_bad_value_is_one_usage_line_naming_the_flag():
    with pytest.raises(UsageError, match=r"argument --use_fp16: expected a boolean"):
        parser_of("train.py").parse_args(["--use_fp16", "maybe"])


def test_ckpt_and_demo_parsers_refuse_prefixes_and_suggest_flags():
    code = ckpt_main(["diff", "x.pt", "--flag", "x"], out=io.StringIO(),
                     err=(err := io.StringIO()))
    assert code == 2
    assert err.getvalue().strip() == ("error: ckpt.py: unknown flag --flag (did you mean "
                                      "--flags?); see ckpt.py --help")
    with pytest.raises(UsageError, match=r"--tin \(did you mean --tiny\?\)"):
        load_script("demo.py").create_argparser().parse_args(["--tin"])


@pytest.mark.parametrize("script", TABLE_SCRIPTS)
def test_every_flag_of_every_script_has_a_group_and_a_meaning(script):
    missing = [k for k in defaults_of(parser_of(script)) if k not in flag_table.FLAG_HELP]
    assert not missing, f"add these flags to flags.FLAG_HELP: {missing}"


def test_help_groups_flags_with_their_meaning_and_default_and_shows_the_docstring(capsys):
    with pytest.raises(SystemExit) as info:
        parser_of("sample.py").parse_args(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "Generate a large batch of samples" in text  # the docstring
    assert "Sample i's label, initial noise" in text
    heads = [h for h in re.findall(r"^(\w+) flags:$", text, re.M)]
    assert heads == ["model", "diffusion", "checkpointing", "logging", "distributed", "sampling"]
    assert re.search(r"--num_channels N +base channel count of the UNet .*\(default 128\)", text)
    assert re.search(r"--timestep_respacing STR +use fewer timesteps", text)
    assert "(default '')" in text
    assert len(text.splitlines()[0]) < 80  # one short usage line, not 30 lines of names


# ------------------------------------------------------------------------------ README, docs/


def flags_table():
    text = (REPO / "docs" / "flags.md").read_text()
    start = text.index("| flag | default | taken by | meaning |")
    return text[start:text.index("\n\n", start) + 1]


def test_the_flag_table_of_docs_flags_md_is_the_one_made_from_the_scripts_parsers():
    expected = flag_table.flags_markdown(
        {name: defaults_of(parser_of(name)) for name in TABLE_SCRIPTS})
    assert flags_table() == expected, ("docs/flags.md's flag table is stale; replace it with:\n"
                                       + expected)


def test_every_flag_the_readme_and_docs_name_exists_and_every_table_flag_is_taken():
    known = all_known_flags()
    for doc in DOCS:
        named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]", doc.read_text()))
        unknown = named - known - LAUNCHER_FLAGS - EXAMPLE_MISTAKES
        assert not unknown, f"{doc.name} names flags no script takes: {sorted(unknown)}"
    taken = set()
    for name in TABLE_SCRIPTS:
        taken |= set(defaults_of(parser_of(name)))
    untaken = {f"--{k}" for k in flag_table.FLAG_HELP} - {f"--{k}" for k in taken}
    assert not untaken, f"FLAG_HELP lists flags no script takes: {untaken}"


def heading_anchors(text):
    """The anchors of a markdown text's headings, as GitHub makes them."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # no headings inside code blocks
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_every_file_make_target_and_link_the_readme_and_docs_name_exists():
    targets = set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))
    for doc in DOCS:
        text = doc.read_text()
        named = re.findall(r"(?<![\w/.])((?:scripts|benchmarks|examples|datasets|tests|docs|"
                           r"improved_diffusion)/[\w./-]*\.(?:py|sh|md))\b", text)
        missing = sorted({n for n in named if not (REPO / n).is_file()})
        assert not missing, f"{doc.name} names files that do not exist: {missing}"
        # `make X` in a code span, or a line of a code block that starts with it
        unknown = set(re.findall(r"(?:^|`|time )make ([a-z][\w-]*)", text, re.M)) - targets
        assert not unknown, f"{doc.name} names make targets the Makefile lacks: {unknown}"
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            linked = (doc.parent / path).resolve() if path else doc
            assert linked.exists(), f"{doc.name} links to {target}: no such file"
            if anchor and linked.suffix == ".md":
                assert anchor in heading_anchors(linked.read_text()), (
                    f"{doc.name} links to {target}: {linked.name} has no heading #{anchor}")


# ------------------------------------------------------------------------------ pasteable flags


def test_flags_printed_as_argv_parse_back_to_the_same_values():
    flags = dict(script_util.model_and_diffusion_defaults(), channel_mult="1,2",
                 timestep_respacing="", attention_resolutions="", num_classes=10)
    argv = shlex.split(flag_table.flags_to_argv(flags))
    args = parser_of("sample.py").parse_args(argv)
    assert flag_table.args_to_dict(args, flags) == flags
    assert "--channel_mult 1,2" in flag_table.flags_to_argv(flags)
    assert "--timestep_respacing ''" in flag_table.flags_to_argv(flags)


# ------------------------------------------------------------------------------ logger


def test_progress_format_writes_one_line_per_dump_with_rates_and_eta():
    out = io.StringIO()
    fmt = logger.ProgressOutputFormat(out)
    fmt.start(100, total_steps=200)
    fmt.writekvs({"step": 110, "samples": 440, "loss": 0.25, "grad_norm": 1.5, "loss_q0": 0.1,
                  "mse": 0.2, "global_batch": 4})
    fmt.writekvs({"step": 120, "samples": 480, "loss": 0.125, "fp16_skipped": 1.0})
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert re.fullmatch(r"step 110/200  loss 0\.25  grad_norm 1\.5  \S+ steps/s  \S+ samples/s  "
                        r"elapsed \d+s  ETA \S+", lines[0]), lines[0]
    assert "loss_q0" not in lines[0] and "mse" not in lines[0]
    assert lines[1].startswith("step 120/200  loss 0.125  steps skipped (fp16 overflow)")


def test_training_logger_puts_the_line_on_stdout_and_the_full_table_in_log_txt(tmp_path, capsys):
    logger.configure(dir=str(tmp_path), rank=0, stdout_format="progress")
    try:
        logger.logkv("step", 10)
        logger.logkv_mean("loss", 0.5)
        logger.logkv_mean("loss_q3", 0.7)
        logger.dumpkvs()
    finally:
        logger.configure(dir=str(tmp_path / "other"), format_strs=[], rank=0)
    shown = capsys.readouterr().out
    assert "step 10  loss 0.5  elapsed" in shown and "|" not in shown
    log_txt = (tmp_path / "log.txt").read_text()
    assert "| loss_q3 " in log_txt and "| step " in log_txt
    assert (tmp_path / "progress.csv").read_text().splitlines()[0].split(",").count("loss_q3") == 1


def test_progress_off_a_terminal_is_plain_lines_without_escape_sequences():
    stream, lines = io.StringIO(), []
    bar = logger.Progress(64, "samples", "img", file=stream, every_s=0.0, log=lines.append)
    for _ in range(4):
        bar.update(16)
    bar.close()
    assert not bar.is_tty and stream.getvalue() == ""
    assert lines[0].startswith("samples 16/64 img, elapsed") and "ETA" in lines[0]
    assert lines[-1].startswith("samples 64/64 img")
    assert not any("\x1b" in line or "\r" in line for line in lines)


# ------------------------------------------------------------------------------ fp16 on a CPU


def test_cpu_bf16_units_are_read_from_cpuinfo(tmp_path):
    with_bf16, without = tmp_path / "a", tmp_path / "b"
    with_bf16.write_text("flags\t: fpu avx2 avx512f avx512_bf16 amx_tile\n")
    without.write_text("flags\t: fpu avx2 avx512f\n")
    assert amp.cpu_has_fast_bf16(str(with_bf16)) is True
    assert amp.cpu_has_fast_bf16(str(without)) is False


def test_fp16_on_a_cpu_without_bf16_units_warns_in_one_line_and_keeps_fp16(monkeypatch, tmp_path,
                                                                            capsys):
    monkeypatch.setattr(amp, "cpu_has_fast_bf16", lambda: False)
    logger.configure(dir=str(tmp_path), format_strs=["stdout"], rank=0)
    dtype, scaler = amp.make_amp(th.device("cpu"), True, 1e-3)
    monkeypatch.setattr(amp, "cpu_has_fast_bf16", lambda: True)
    dtype_bf16, scaler_bf16 = amp.make_amp(th.device("cpu"), True, 1e-3)
    warning = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert len(warning) == 1 and "slower than fp32" in warning[0]
    assert dtype in (th.float16, th.bfloat16)
    assert (dtype_bf16, scaler_bf16) == (th.bfloat16, None)


# ------------------------------------------------------------------------------ real scripts


@pytest.mark.timeout(120)
def test_a_typo_under_mpiexec_is_one_line_for_the_job_and_exit_2():
    proc = run_mpi(2, "train.py", "--num_chanels", "64", check=False, timeout=100)
    assert proc.returncode == 2, proc.stdout
    errors = [line for line in proc.stdout.splitlines() if "error" in line.lower()]
    assert errors == ["error: train.py: unknown flag --num_chanels (did you mean "
                      "--num_channels?); see train.py --help"], proc.stdout
    assert "usage:" not in proc.stdout


@pytest.fixture(scope="module")
def class_run(tmp_path_factory):
    """train.py --class_cond True on a 3-class folder without --num_classes (2 steps)."""
    root = tmp_path_factory.mktemp("cli")
    data = write_class_folder(root / "data")
    run = root / "run"
    proc = run_script("train.py", "--data_dir", data, "--log_dir", run, *TINY,
                      "--class_cond", "True", "--batch_size", "2", "--max_steps", "2",
                      "--log_interval", "1", timeout=150)
    return root, data, run, proc.stdout


@pytest.mark.timeout(200)
def test_class_cond_without_num_classes_counts_the_folders_classes_and_says_so(class_run):
    root, data, run, out = class_run
    assert out.count("--class_cond True: 3 classes in --data_dir") == 1
    stored = ckpt.load_file(str(run / "model000002.pt")).flags
    assert stored["num_classes"] == 3 and stored["class_cond"] is True
    # the progress line, one per --log_interval, and the table only in log.txt
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["1/2", "2/2"], out
    assert all("loss " in line and "elapsed" in line for line in lines)
    assert "steps/s" in lines[1] and "ETA" in lines[1]
    assert "| loss_q" not in out
    assert "| loss_q" in (run / "log.txt").read_text()


@pytest.mark.timeout(200)
def test_flags_of_inspect_paste_into_diff_and_sample_which_draws_only_trained_labels(class_run,
                                                                                    tmp_path):
    root, data, run, _ = class_run
    shown = io.StringIO()
    assert ckpt_main(["inspect", str(run / "ema_0.9999_000002.pt")], out=shown) == 0
    flags = re.search(r"^  flags +(.*)$", shown.getvalue(), re.M).group(1)
    assert "--timestep_respacing ''" in flags and "--num_classes 3" in flags
    diff = io.StringIO()
    assert ckpt_main(["diff", str(run / "model000002.pt"), "--flags", flags], out=diff) == 0
    assert "status      same" in diff.getvalue()
    proc = run_script("sample.py", "--model_path", run / "ema_0.9999_000002.pt",
                      "--log_dir", tmp_path, "--num_samples", "12", "--batch_size", "12",
                      "--use_ddim", "True", "--timestep_respacing", "ddim2",
                      *shlex.split(flags.replace("--timestep_respacing ''", "")), timeout=150)
    with np.load(tmp_path / "samples_12x8x8x3.npz") as z:
        labels = z["arr_1"]
    assert set(labels.tolist()) <= {0, 1, 2} and len(set(labels.tolist())) > 1
    assert "\x1b" not in proc.stdout and "\r" not in proc.stdout  # no bar off a terminal
    assert "\x1b" not in (tmp_path / "log.txt").read_text()


@pytest.mark.timeout(200)
def test_an_error_after_the_log_dir_exists_is_one_line_on_stderr_and_in_log_txt(class_run):
    root, data, run, _ = class_run
    proc = run_script("train.py", "--data_dir", data, "--log_dir", run, *TINY,
                      "--class_cond", "True", "--num_classes", "2", "--batch_size", "2",
                      "--max_steps", "3", check=False, timeout=150)
    assert proc.returncode == 1, proc.stdout
    errors = [line for line in proc.stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--num_classes" in errors[0], proc.stdout
    assert (run / "log.txt").read_text().rstrip().splitlines()[-1] == errors[0]
    assert not (run / "model000003.pt").exists()


@pytest.mark.timeout(200)
def test_a_run_directory_as_resume_checkpoint_resumes_its_newest_step_and_says_which(class_run,
                                                                                    tmp_path):
    root, data, run, _ = class_run
    proc = run_script("train.py", "--data_dir", data, "--log_dir", tmp_path / "new", *TINY,
                      "--class_cond", "True", "--batch_size", "2", "--max_steps", "3",
                      "--resume_checkpoint", run, timeout=150)
    assert re.search(rf"resumed at step 2 from {re.escape(str(run / 'model000002.pt'))}",
                     proc.stdout), proc.stdout
    assert (tmp_path / "new" / "model000003.pt").exists()
    assert sorted(p.name for p in run.glob("model*.pt")) == ["model000002.pt"]  # untouched


@pytest.mark.timeout(60)
def test_plot_progress_draws_the_loss_curve_of_a_run(class_run, tmp_path, capsys):
    root, data, run, _ = class_run
    png = tmp_path / "curve.png"
    plot_main = load_script("plot_progress.py").main
    assert plot_main([str(run), "--out", str(png)]) == 0
    assert f"loss curve of 2 logged steps: {png}" in capsys.readouterr().out
    from PIL import Image

    with Image.open(png) as im:
        assert im.size == (720, 440)
        colours = {c for _, c in im.getcolors(1 << 20)}
    assert colours & set(progress_plot.COLOURS)  # the quartiles' lines
    with pytest.raises(progress_plot.PlotError, match=r"progress.csv: no such file"):
        progress_plot.plot_loss_curve(str(tmp_path / "progress.csv"), str(tmp_path / "x.png"))
    assert not (tmp_path / "x.png").exists()


def test_the_loss_curve_marks_the_step_where_the_run_was_preempted_and_resumed(tmp_path):
    rows = ["step,loss_q0,loss_q1"] + [f"{s},{1 / s},{2 / s}" for s in range(2, 42, 2)]
    (tmp_path / "progress.csv").write_text("\n".join(rows) + "\n")
    (tmp_path / "log.txt").write_text(  # the checkpointer's lines, as a preempted run logs them
        "step 20/40  loss 0.1\npreempted (SIGTERM on some rank): saved step 21; exiting with "
        "code 75\nauto-resume: newest complete step in L is 21\n"
        "resumed at step 21 from L/model000021.pt (ema: ema_0.9_000021.pt; opt: opt000021.pt)\n")
    events = progress_plot.run_events(str(tmp_path / "log.txt"))
    assert events == [(21, "preempted, resumed")]
    assert progress_plot.run_events(str(tmp_path / "missing.txt")) == []
    from PIL import Image

    def mark_columns(png):
        with Image.open(png) as im:
            rgb = im.convert("RGB")
            return {x for x in range(rgb.width) for y in range(rgb.height)
                    if rgb.getpixel((x, y)) == progress_plot.MARK_COLOUR}

    marked, plain = tmp_path / "marked.png", tmp_path / "plain.png"
    progress_plot.plot_loss_curve(str(tmp_path / "progress.csv"), str(marked), marks=events)
    progress_plot.plot_loss_curve(str(tmp_path / "progress.csv"), str(plain))
    assert not mark_columns(plain)
    # step 21 of 2..40 on a plot area from x=70 to x=700
    x = 70 + (21 - 2) / (40 - 2) * (720 - 70 - 20)
    assert any(abs(c - x) <= 1.5 for c in mark_columns(marked)), sorted(mark_columns(marked))
    # plot_progress.py finds the events in the run's own log.txt
    assert load_script("plot_progress.py").main([str(tmp_path), "--out", str(plain)]) == 0
    assert mark_columns(plain)


def test_diff_against_names_only_the_flag_that_changes_shapes(tmp_path):
    paths = {}
    for name, extra in (("a", {}), ("b", dict(learn_sigma=True, dropout=0.3,
                                              diffusion_steps=50, noise_schedule="linear"))):
        flags = dict(script_util.model_and_diffusion_defaults(), image_size=8, num_channels=32,
                     channel_mult="1", attention_resolutions="", num_res_blocks=1,
                     diffusion_steps=20, noise_schedule="cosine")
        flags.update(extra)
        model, _ = script_util.create_model_and_diffusion(**flags)
        paths[name] = tmp_path / name / "model000008.pt"
        paths[name].parent.mkdir()
        file_writer.atomic_write(str(paths[name]), ckpt.model_payload(8, model.state_dict(), flags))
    out = io.StringIO()
    assert ckpt_main(["diff", str(paths["a"]), "--against", str(paths["b"])], out=out,
                     err=io.StringIO()) == 1
    likely = re.findall(r"likely flag (--\w+)", out.getvalue())
    assert likely == ["--learn_sigma"], out.getvalue()


def test_convert_names_the_step_of_a_single_file(tmp_path):
    flags = dict(script_util.model_and_diffusion_defaults(), image_size=8, num_channels=32,
                 channel_mult="1", attention_resolutions="", num_res_blocks=1)
    model, _ = script_util.create_model_and_diffusion(**flags)
    raw = tmp_path / "model000008.pt"
    th.save(model.state_dict(), raw)
    out = io.StringIO()
    assert ckpt_main(["convert", str(raw), "--to", "tagged", "--out", str(tmp_path / "o"),
                      "--flags", flag_table.flags_to_argv(flags)], out=out,
                     err=io.StringIO()) == 0
    assert "note: step 8: written without a manifest" in out.getvalue()
    assert "None" not in out.getvalue()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_torchrun_summary_shows_the_one_line_and_the_usage_exit_code(tmp_path):
    import subprocess
    import sys

    from conftest import child_env

    torchrun = Path(sys.executable).parent / "torchrun"
    proc = subprocess.run([str(torchrun), "--nproc_per_node", "2", str(REPO / "scripts" /
                           "train.py"), "--bad_flag"], cwd=tmp_path, env=child_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=hang_s(180))
    assert proc.returncode != 0
    assert proc.stdout.count("error: train.py: unknown flag --bad_flag") == 1, proc.stdout
    assert "exitcode  : 2" in proc.stdout
    assert "traceback : usage error (exit 2): train.py: unknown flag --bad_flag" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("bf16_units", [False, True], ids=["cpu-without-bf16", "cpu-with-bf16"])
def test_fp16_on_a_cpu_trains_reports_skipped_steps_and_warns_once(tmp_path, bf16_units):
    # Either CPU, on any CPU: tests/amp_train.py answers cpu_has_fast_bf16() as asked.
    data = write_class_folder(tmp_path / "data")
    proc = _run([PY, REPO / "tests" / "amp_train.py", "--data_dir", data, "--log_dir",
                 tmp_path / "run", *TINY, "--use_fp16", "True", "--batch_size", "2",
                 "--max_steps", "3", "--log_interval", "1"], timeout=hang_s(180),
                env={"CPU_BF16": str(int(bf16_units))})
    if bf16_units:
        assert "--use_fp16: bfloat16 autocast" in proc.stdout
        assert "slower than fp32" not in proc.stdout and "loss_scale" not in proc.stdout
    else:
        assert proc.stdout.count("slower than fp32") == 1
        skipped = [line for line in proc.stdout.splitlines() if " skipped: NaN/inf" in line]
        assert skipped, proc.stdout  # loss scale 2**20 overflows at first, as upstream's did
        for line in skipped:
            assert re.match(r"step \d+ skipped: NaN/inf float16 gradients at loss scale", line)
        assert re.search(r"^step 1/3  .*loss_scale \S+  steps skipped \(fp16 overflow\)",
                         proc.stdout, re.M), proc.stdout
    assert (tmp_path / "run" / "model000003.pt").exists()


def test_no_flag_help_names_two_defaults():
    """train.py --help said "--log_dir ... (default $OPENAI_LOGDIR) (default '')" (issue 29)."""
    for name in TABLE_SCRIPTS:
        doubled = [a.option_strings[0] for a in parser_of(name)._actions
                   if a.help and a.help.count("(default") > 1]
        assert not doubled, f"{name}: {doubled}"


def test_docs_guidance_md_shows_the_guidance_figures_of_docs_performance_md():
    """docs/guidance.md kept 0.720/0.716 of an older run where performance.md says 0.710/0.713."""
    perf = dict((w.strip(), (a.strip(), b.strip())) for w, a, b in re.findall(
        r"^\| ([a-z][^|]*) \| (\d\.\d{3}) \| (\d\.\d{3}) \|$",
        (REPO / "docs" / "performance.md").read_text(), re.M))
    shown = re.findall(r"^  ([a-z][a-z +()-]*?) {2,}(\d\.\d{3}) +(\d\.\d{3})$",
                       (REPO / "docs" / "guidance.md").read_text(), re.M)
    assert len(shown) == 6, shown
    for way, agreement, confidence in shown:
        assert perf[way] == (agreement, confidence), way


def test_the_readme_says_to_activate_the_venv_before_its_first_python_command():
    """After `make demo`, the README's `python scripts/...` lines failed with
    ModuleNotFoundError: it never said to activate .venv (issue 29)."""
    text = (REPO / "README.md").read_text()
    first_command = re.search(r"^(mpiexec .*|python) scripts/", text, re.M).start()
    assert ". .venv/bin/activate" in text[:first_command]
