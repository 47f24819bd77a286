"""
The project's one error model.

``UserError``: something the user can fix - a file, a flag, a directory, a held log dir, a full
disk. Its message is one line that names the file or flag and says what to do; a script prints it
once as ``error: <message>`` and exits with its ``exit_code`` (1). ``UsageError``: a bad command
line (exit 2). Every user-facing error of the library derives from one of the two, so scripts
catch exactly these.

Anything else is a bug and keeps its traceback: never catch bare built-in exceptions (ValueError,
OSError, ...) wholesale to turn them into one-liners. Where a built-in exception of one known call
means a user mistake (a flag value a parser refuses), wrap that call and raise a UserError naming
the flag.
"""

USER_ERROR_EXIT_CODE = 1
USAGE_EXIT_CODE = 2


class UserError(Exception):
    """A problem the user can fix; the one-line message names the file or flag (exit 1)."""

    exit_code = USER_ERROR_EXIT_CODE


class UsageError(UserError):
    """A bad command line or flag value (exit 2)."""

    exit_code = USAGE_EXIT_CODE


def one_line(e):
    """An exception's message on one line (its type name when it has none)."""
    return " ".join(str(e).split()) or type(e).__name__


def typed_one_line(e):
    """An exception as one line with its type: ``OSError: [Errno 5] Input/output error``."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}".rstrip(": ")
