"""
The end of a script's process: what Python's own exit does, without its teardown of the modules
(``exit_process``; cli re-exports it). Standard library only: a script that has not imported
torch does not import it here.
"""
import atexit
import gc
import io
import itertools
import os
import sys
import threading

_WRITERS = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)


def exit_process(code):
    """
    End this process with ``code`` (what a script's main returned: None is 0, an int its exit
    status, anything else printed to stderr and 1, as ``sys.exit`` takes them), doing what
    Python's own exit does except its teardown of the modules. Call from a script's ``if
    __name__ == "__main__":`` block, on the main thread, as its last statement.

    Python ends a process in this order: it joins the threads that are not daemons, runs the
    atexit handlers (weakref finalizers among them: the checkpoint writer process, the loader
    workers, temp folders; the trackers' own), flushes stdout and stderr, then tears its modules
    down object by object (which flushes and closes any file object still open), and last runs
    the C-level exit hooks (mpi4py's ``MPI_Finalize``) and the C library's exit. The teardown
    only frees memory that the kernel frees at once anyway, and with torch and
    ``torch._dynamo`` imported (every training rank: an optimizer's first call imports it) it
    costs about 1.2 s of CPU per process, a sixth of a short 1-rank job
    (benchmarks/exit_cost.py). Here the same steps run without it: the threads joined, the
    atexit handlers, every file object still open for writing flushed, stdout and stderr
    flushed, then ``os._exit(code)``.

    A rank of an MPI job (mpi4py initialized MPI: under mpiexec) ends by Python's own exit
    instead, teardown included: MPICH's mpiexec takes a rank that ends by ``_exit`` for a failed
    process, even after MPI_Finalize and with status 0, and kills the job's other ranks; the C
    library's ``exit`` without the teardown aborts in C++ static destructors (signal 6, seen
    in tests/sharded_driver.py's ranks). So the saving is for single processes and torchrun's
    ranks.

    Example: ``exit_process(main())`` at the end of scripts/train.py, where ``main()`` returned
    75 after a preemption save.
    """
    if code is None:
        code = 0
    elif not isinstance(code, int):
        sys.stderr.write(f"{code}\n")
        code = 1
    if _mpi_initialized():
        sys.exit(code)
    _join_threads()
    atexit._run_exitfuncs()
    _flush_open_files()
    os._exit(code & 0xFF)


def _join_threads():
    """Wait for the threads that are not daemons, as the interpreter's exit does first."""
    shutdown = getattr(threading, "_shutdown", None)  # what Py_Finalize calls (CPython 3.8+)
    if shutdown is not None:
        shutdown()
        return
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()


def _flush_open_files():
    """Flush every Python file object still open for writing (text layers first, then the
    buffers under them), and stdout and stderr: what the teardown's closing of them would
    write. Errors (a closed pipe) are ignored, as the teardown ignores them."""
    # By type, of the concrete classes, at C speed (a torch process holds ~300,000 objects: an
    # isinstance of the io ABCs runs Python code for each, 0.3 s, and isinstance reads
    # ``__class__``, which some objects compute with a warning).
    objects = gc.get_objects()
    kinds = {t for t in set(map(type, objects)) if issubclass(t, _WRITERS)}
    files = list(itertools.compress(objects, map(kinds.__contains__, map(type, objects))))
    del objects
    files.sort(key=lambda f: not isinstance(f, io.TextIOWrapper))
    for f in [*files, sys.stdout, sys.stderr]:
        try:
            if f is not None and not f.closed and f.writable():
                f.flush()
        except Exception:  # a closed pipe, a detached buffer, ...
            pass


def _mpi_initialized():
    """Whether mpi4py initialized MPI in this process (imported by dist_util under mpiexec)."""
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        return mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized()
    except Exception:
        return False
