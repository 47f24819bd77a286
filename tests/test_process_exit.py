"""infra/process_exit.exit_process, the last statement of every script: what Python's exit does
(threads joined, atexit handlers, open files flushed, MPI finalized, the exit code) without its
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

    rank = MPI.COMM_WORLD.Get_rank()

    def finalized(comm, keyval, value):  # MPI_Finalize deletes COMM_SELF's attributes first
        open(f"{sys.argv[1]}.{rank}", "w").write("finalized")
        return MPI.SUCCESS

    MPI.COMM_SELF.Set_attr(MPI.Comm.Create_keyval(delete_fn=finalized), 1)
    MPI.COMM_WORLD.Barrier()
    exit_process(0)
""")


def test_under_mpiexec_every_rank_finalizes_mpi_before_it_exits(tmp_path):
    """Python runs MPI_Finalize from mpi4py's C-level exit hook, which os._exit skips; Open MPI
    reports a rank that exits without it as a failed job."""
    script = tmp_path / "mpi_ends.py"
    script.write_text(MPI_ENDS)
    proc = _run([MPIEXEC, "-n", "2", PY, script, tmp_path / "fin"], 60)
    for rank in (0, 1):
        assert (tmp_path / f"fin.{rank}").read_text() == "finalized", proc.stdout
