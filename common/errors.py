"""Which errors are the user's: the CLI prints those as one line (exit 2), anything else with its traceback.

A `UserError` is always the user's (a bad recipe, checkpoint, flag or launch). Plain ValueError and
FileNotFoundError count as the user's only while a command is still checking what it was asked to do:
a command whose work can raise them for other reasons (deep inside torch or DeepSpeed) calls
`begin_work()` once its checks have passed, and from then on only a UserError is one line.
"""

from __future__ import annotations


class UserError(ValueError):
    """Something the user asked for that cannot work; the message says what and how to fix it.
    (A ValueError, so callers that catch ValueError keep working.)"""


_work_started = False


def begin_work() -> None:
    """The checks are over: a ValueError or FileNotFoundError raised from here on is a bug or an
    environment failure, and the CLI shows its traceback."""
    global _work_started
    _work_started = True


def reset() -> None:
    """A new command starts in its checking phase (the CLI calls this; tests may call main() repeatedly)."""
    global _work_started
    _work_started = False


def is_user_error(e: BaseException) -> bool:
    return isinstance(e, UserError) or (isinstance(e, (ValueError, FileNotFoundError)) and not _work_started)
