"""What every command-line script does with an error: one line, an exit code, no rank left hanging.

Scripts stay thin: ``sys.exit(cli.run_main(main, usage_errors=..., runtime_errors=...))``.
"""
import sys
import traceback

from . import dist_util

USAGE_EXIT_CODE = 2  # bad command line or flag values
ERROR_EXIT_CODE = 1  # anything else that stops the run


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


def run_main(main, argv=None, *, usage_errors=(), runtime_errors=()):
    """
    Run ``main(argv)`` and turn our errors into one ``error: ...`` line and an exit code:
    ``usage_errors`` (and ``UsageError``) exit 2, ``runtime_errors`` exit with their
    ``exit_code`` attribute or 1; any other exception is a bug: its traceback is kept, exit 1.
    After an error on some ranks only, the whole job is ended instead of left hanging
    (``dist_util.end_job_after_error``).
    """
    try:
        return main(argv)
    except (UsageError, *usage_errors) as e:
        code, message = USAGE_EXIT_CODE, one_line(e)
    except runtime_errors as e:
        code, message = getattr(e, "exit_code", ERROR_EXIT_CODE), one_line(e)
    except Exception:
        traceback.print_exc()
        code, message = ERROR_EXIT_CODE, "unexpected error (traceback above)"
    print_error(message)
    dist_util.end_job_after_error(code)
    return code
