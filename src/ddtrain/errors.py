"""The one exception type users see: a clear message, no traceback."""


class DDTrainError(Exception):
    """A problem with the user's input or environment, reported as one line.

    The command line prints ``ddtrain: error: <message>`` (prefixed with the rank inside a
    multi-process job) and exits with status 2; library callers catch it like any exception.
    """


def choice_error(kind: str, name: str, valid) -> DDTrainError:
    """An error for an unknown registry name that lists the valid ones."""
    return DDTrainError(f"unknown {kind} {name!r}; valid: {', '.join(sorted(valid))}")
