"""What every command-line script does with an error: one line, an exit code, no rank left hanging.

Scripts stay thin: ``cli.exit_process(cli.run_main(main))``. The error model is errors.py's: a
UserError (UsageError: exit 2) is one ``error: ...`` line, printed once for the job; anything else
is a bug and keeps its traceback.
"""
import hashlib
import json
import os
import sys
import time
import traceback

from .. import dist_util, logger
from . import heartbeat, preemption

from .process_exit import exit_process
from .errors import USAGE_EXIT_CODE, USER_ERROR_EXIT_CODE, UsageError, UserError, one_line

ERROR_EXIT_CODE = USER_ERROR_EXIT_CODE  # anything that stops the run (a bug too)
INTERRUPTED_EXIT_CODE = 130  # KeyboardInterrupt, as a shell reports Ctrl-C (128 + SIGINT)
__all__ = ["USAGE_EXIT_CODE", "UsageError", "UserError", "run_main", "exit_process", "print_error",
           "one_line"]


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


def run_main(main, argv=None):
    """
    Run ``main(argv)`` and turn a UserError into one ``error: ...`` line and its ``exit_code``
    (a failed rendezvous or a collective that failed because a rank died is one too, naming the
    rank(s)); any other exception is a bug: its traceback is kept, exit 1. A line that several
    ranks would print alike (a decision made on rank 0 and broadcast) is printed once for the
    job. A KeyboardInterrupt (exit 130) or SystemExit (its code) on one rank of a process group
    ends the job on every rank, its cause printed once; in a single process they keep Python's
    own handling. After an error on some ranks only, the whole job is ended instead of left
    hanging (``heartbeat.end_job_after_error``), within a bounded wait. A preemption signal
    before training began (``preemption.Preempted``, or a collective that failed because ranks
    ended for one) ends every rank with exit 75 and its one line. A log dir in an object store
    gets its last lines before the interpreter's exit (logger.upload_spools).
    """
    try:
        return _run_main(main, argv)
    finally:
        logger.upload_spools()


def _run_main(main, argv):
    lost = ()
    error, tb = None, None
    heartbeat.set_error_line_hook(_record_error_line)
    try:
        return main(argv)
    except preemption.Preempted:
        return _end_job_preempted()
    except UserError as e:
        error, code, message = e, e.exit_code, one_line(e)
    except Exception as e:
        error, diagnosis = e, _diagnose(e)
        if _preempted_before_training(e, diagnosis):
            return _end_job_preempted(lost=_gone(diagnosis) if diagnosis else ())
        if diagnosis is None:
            tb = traceback.format_exc()
            traceback.print_exc()
            logger.append_to_log_files(tb.rstrip())
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
    topic = "error/" + hashlib.sha1((message or "").encode()).hexdigest()
    if message and (message.startswith("unexpected error") or _first_to_report(topic, error)):
        print_error(message)
    if message:
        logger.append_to_log_files(f"error: {message}")
    _record_for_torchelastic(code, message, tb)
    heartbeat.end_job_after_error(code, cause=message, lost=lost)
    return code


def _record_error_line(message):
    """Where an error line goes beside stderr: the log files, and torchrun's failure summary."""
    logger.append_to_log_files(f"error: {message}")
    _record_for_torchelastic(ERROR_EXIT_CODE, message)


def _preempted_before_training(e, diagnosis):
    """Whether ``e`` (an Exception that is not a UserError) is how a preemption before training
    reached this rank: a collective that failed as the other ranks ended for a signal (their
    heartbeat says so), or failed after this rank got one itself (its peers are ending too)."""
    if diagnosis is not None and any(preemption.BEFORE_TRAINING in s
                                     for s in diagnosis.ended.values()):
        return True
    return (preemption.before_training() and preemption.signalled() is not None
            and heartbeat.looks_like_comm_failure(e))


def _end_job_preempted(lost=()):
    """End the job after a preemption signal before training began: every rank returns exit 75,
    the one line printed once for the job (and kept in log.txt when the logger writes one).
    ``lost``: ranks already gone (not waited for)."""
    preemption.ending()
    line = preemption.BEFORE_TRAINING
    if heartbeat.first_to_report("preempted"):
        sys.stderr.write(f"{line}\n")
        sys.stderr.flush()
    logger.append_to_log_files(line)
    _record_for_torchelastic(preemption.EXIT_CODE, line, kind="preempted")
    heartbeat.end_job_after_error(preemption.EXIT_CODE, cause=line, lost=lost)
    return preemption.EXIT_CODE


def _first_to_report(topic, e):
    """Whether this rank prints the line of ``e``. Before the process group exists, a bad command
    line (UsageError) is the same on every rank of the launch, so its first rank prints it."""
    if isinstance(e, UsageError) and not dist_util.is_distributed():
        return logger.get_rank_without_dist() == 0
    return heartbeat.first_to_report(topic)


def _record_for_torchelastic(code, message, tb=None, kind=None):
    """Under torchrun, put this rank's one line (or a bug's traceback) where the agent's failure
    summary shows it (TORCHELASTIC_ERROR_FILE) instead of its "To enable traceback" link. The
    summary's exitcode (2 usage, 1 error, 75 preempted) is this rank's exit code."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    kind = kind or ("usage error" if code == USAGE_EXIT_CODE else "error")
    line = f"{kind} (exit {code}): {message or 'see the first rank that failed'}"
    data = {"message": {"message": line, "extraInfo": {
        "py_callstack": tb or line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:  # the agent's temp dir: the line is on stderr all the same
        pass


def _diagnose(e):
    """RankLostError when ``e`` is a collective that failed as ranks died or ended, else None."""
    if not (dist_util.is_distributed() and heartbeat.looks_like_comm_failure(e)):
        return None
    return heartbeat.diagnose_failure(e)


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
    if heartbeat.first_to_report("exit"):
        print_error(f"{cause}; ending the job on all {dist_util.get_world_size()} ranks")
    heartbeat.end_job_after_error(code, cause=cause)
    return code
