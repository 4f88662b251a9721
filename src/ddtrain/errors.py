"""The exception types users see: a clear message, no traceback."""
from __future__ import annotations


class DDTrainError(Exception):
    """A problem with the user's input or environment, reported as one line.

    The command line prints ``ddtrain: error: <message>`` (prefixed with the rank inside a
    multi-process job) and exits with status 2; library callers catch it like any exception.
    """


def choice_error(kind: str, name: str, valid) -> DDTrainError:
    """An error for an unknown registry name that lists the valid ones."""
    return DDTrainError(f"unknown {kind} {name!r}; valid: {', '.join(sorted(valid))}")


class ConfigError(DDTrainError):
    """A setting that is not allowed, naming the field; the command line names the flag instead.

    ``str(error)`` is ``"<field> <problem>"`` for library callers (``batch_size must be a
    positive integer, got 0``); ``ddtrain`` prints ``--batch-size must be ...``.
    """

    def __init__(self, field: str, problem: str, *, flag: str | None = None):
        self.field, self.problem, self.flag = field, problem, flag
        super().__init__(f"{field} {problem}")
