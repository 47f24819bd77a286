"""infra/process_exit.exit_process, the last statement of every script: what Python's exit does
(threads joined, atexit handlers, open files flushed, the exit code) without its
teardown of the modules. Checked in real processes, by what they leave on disk; the scripts'
own ends (exit 0, 75, 1 and their files) are every other test's."""
import textwrap

import pytest

from conftest import MPIEXEC, PY, _run

pytestmark = pytest.mark.timeout(120)

ENDS = textwrap.dedent("""
    import atexit, sys, threading, time
    from improved_diffusion.infra.process_exit import exit_process

    out = sys.argv[1]
    text = open(out + ".text", "w")  # left open, unflushed: the teardown would have closed it
    text.write("text " * 1000)
    data = open(out + ".bin", "wb", buffering=1 << 20)
    data.write(b"b" * 5000)
    atexit.register(lambda: open(out + ".atexit", "w").write("ran"))

    def late():  # a thread that is not a daemon: the process waits for it
        time.sleep(0.5)
        open(out + ".thread", "w").write("joined")

    threading.Thread(target=late).start()
    print("before the exit", end="")  # stdout's buffer, no newline
    exit_process(eval(sys.argv[2]))
""")


@pytest.mark.parametrize("code,status", [("7", 7), ("None", 0), ("'a message'", 1)])
def test_the_exit_joins_threads_runs_atexit_flushes_open_files_and_keeps_the_code(
        tmp_path, code, status):
    script = tmp_path / "ends.py"
    script.write_text(ENDS)
    out = tmp_path / "out"
    proc = _run([PY, script, out, code], 60, check=False)
    assert proc.returncode == status, proc.stdout
    assert (tmp_path / "out.text").read_text() == "text " * 1000
    assert (tmp_path / "out.bin").read_bytes() == b"b" * 5000
    assert (tmp_path / "out.atexit").read_text() == "ran"
    assert (tmp_path / "out.thread").read_text() == "joined"
    assert proc.stdout.startswith("before the exit")
    if status == 1:
        assert "a message" in proc.stdout


MPI_ENDS = textwrap.dedent("""
    import sys
    from mpi4py import MPI
    from improved_diffusion.infra.process_exit import exit_process

    MPI.COMM_WORLD.Barrier()
    out = open(f"{sys.argv[1]}.{MPI.COMM_WORLD.Get_rank()}", "w")  # left open
    out.write("ended")
    exit_process(3)
""")


def test_under_mpiexec_every_rank_ends_with_its_own_code_and_none_is_killed(tmp_path):
    """An MPI rank ends by Python's own exit (an MPICH rank that ends by _exit is taken by
    mpiexec for a failed process: the others are killed, signal 9). A shell prints each rank's
    exit code, as in test_guidance.py's overflow test, which caught it 1 run in 3."""
    import re

    script = tmp_path / "mpi_ends.py"
    script.write_text(MPI_ENDS)
    each_rank = '"$0" "$@"; echo "rank $PMI_RANK exit $?"'
    for attempt in range(3):
        proc = _run([MPIEXEC, "-n", "2", "sh", "-c", each_rank, PY, script, tmp_path / "out"],
                    60)
        assert sorted(re.findall(r"^rank (\d) exit (\d+)$", proc.stdout, re.M)) == [
            ("0", "3"), ("1", "3")], proc.stdout
        assert "BAD TERMINATION" not in proc.stdout, proc.stdout
        for rank in (0, 1):
            assert (tmp_path / f"out.{rank}").read_text() == "ended"
