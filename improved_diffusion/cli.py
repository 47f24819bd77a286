"""What every command-line script does with an error: one line, an exit code, no rank left hanging.

Scripts stay thin: ``sys.exit(cli.run_main(main, usage_errors=..., runtime_errors=...))``.
"""
import sys
import traceback

from . import dist_util

USAGE_EXIT_CODE = 2  # bad command line or flag values
ERROR_EXIT_CODE = 1  # anything else that stops the run
INTERRUPTED_EXIT_CODE = 130  # KeyboardInterrupt, as a shell reports Ctrl-C (128 + SIGINT)


class UsageError(Exception):
    """A bad command line (exit 2); the message names the flag and what to do."""

    exit_code = USAGE_EXIT_CODE


def one_line(e):
    """An exception's message on one line (its type name when it has none)."""
    return " ".join(str(e).split()) or type(e).__name__


def print_error(message):
    """Write ``error: message`` to stderr in a single write, so lines of several ranks never mix."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def print_note(message):
    """Write ``note: message`` to stderr in a single write."""
    sys.stderr.write(f"note: {message}\n")
    sys.stderr.flush()


def check_dist_timeout(seconds, flag="--dist_timeout"):
    """Raise UsageError unless ``seconds`` is a finite number > 0 (the process-group bound)."""
    try:
        dist_util.as_timedelta(seconds)
    except ValueError:
        raise UsageError(f"{flag} must be a number of seconds > 0 (got {seconds})") from None


def run_main(main, argv=None, *, usage_errors=(), runtime_errors=()):
    """
    Run ``main(argv)`` and turn our errors into one ``error: ...`` line and an exit code:
    ``usage_errors`` (and ``UsageError``) exit 2, ``runtime_errors`` exit with their
    ``exit_code`` attribute or 1; a failed rendezvous or a collective that failed because a rank
    died (``dist_util.diagnose_failure``) is one line naming the rank(s), exit 1; any other
    exception is a bug: its traceback is kept, exit 1. A KeyboardInterrupt (exit 130) or
    SystemExit (its code) on one rank of a process group ends the job on every rank, its cause
    printed once; in a single process they keep Python's own handling.
    After an error on some ranks only, the whole job is ended instead of left hanging
    (``dist_util.end_job_after_error``), within a bounded wait.
    """
    lost = ()
    try:
        return main(argv)
    except (UsageError, *usage_errors) as e:
        code, message = USAGE_EXIT_CODE, one_line(e)
    except (dist_util.RendezvousError, dist_util.RankLostError) as e:
        code, message = ERROR_EXIT_CODE, one_line(e)
    except runtime_errors as e:
        code, message = getattr(e, "exit_code", ERROR_EXIT_CODE), one_line(e)
    except Exception as e:
        diagnosis = _diagnose(e)
        if diagnosis is None:
            traceback.print_exc()
            code, message = ERROR_EXIT_CODE, "unexpected error (traceback above)"
        else:
            code, message, lost = ERROR_EXIT_CODE, one_line(diagnosis), _gone(diagnosis)
            if diagnosis.ended and not diagnosis.lost and \
                    all(s.startswith("ended the job") for s in diagnosis.ended.values()):
                print_note(message)  # the rank that ended the job printed the cause
                message = None
    except BaseException as e:  # KeyboardInterrupt, SystemExit, ...
        if not dist_util.is_distributed():
            raise
        return _end_job_after_exit(e)
    if message:
        print_error(message)
    dist_util.end_job_after_error(code, cause=message, lost=lost)
    return code


def _diagnose(e):
    """RankLostError when ``e`` is a collective that failed as ranks died or ended, else None."""
    if not (dist_util.is_distributed() and dist_util.looks_like_comm_failure(e)):
        return None
    return dist_util.diagnose_failure(e)


def _gone(diagnosis):
    return tuple(diagnosis.lost) + tuple(diagnosis.ended)


def exit_cause(e):
    """(exit code, one-line cause) of a BaseException that is not an Exception."""
    if isinstance(e, KeyboardInterrupt):
        return INTERRUPTED_EXIT_CODE, "interrupted (KeyboardInterrupt)"
    if isinstance(e, SystemExit):
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
            return code, f"exit requested (SystemExit {code})"
        return ERROR_EXIT_CODE, f"exit requested (SystemExit: {one_line(e)})"
    return ERROR_EXIT_CODE, f"{type(e).__name__}: {one_line(e)}"


def _end_job_after_exit(e):
    code, cause = exit_cause(e)
    cause = f"{cause} on rank {dist_util.get_rank()}"
    if dist_util.first_to_report("exit"):
        print_error(f"{cause}; ending the job on all {dist_util.get_world_size()} ranks")
    dist_util.end_job_after_error(code, cause=cause)
    return code
