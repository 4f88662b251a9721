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
    positive integer, got 0``); ``ddtrain`` prints ``--batch-size must be ...``. Other fields
    the problem names read as flags there too: those with an underscore in their name, and
    ``mentions`` (a field whose name is also a word of prose, such as ``resume``).
    """

    def __init__(self, field: str, problem: str, *, flag: str | None = None, mentions: tuple[str, ...] = ()):
        self.field, self.problem, self.flag, self.mentions = field, problem, flag, tuple(mentions)
        super().__init__(f"{field} {problem}")


def check_choices(settings) -> None:
    """ConfigError for the first field of the dataclass ``settings`` whose value its ``Literal`` annotation does not allow.

    The annotation is the one place a setting's choices are written: the command line's
    ``choices=``, a config file's check and this one all read it.
    """
    import dataclasses
    hints = _hints(type(settings))
    for f in dataclasses.fields(settings):
        allowed = _literal_choices(hints[f.name])
        value = getattr(settings, f.name)
        if allowed is not None and value not in allowed:
            shown = ", ".join(str(a) for a in allowed if a is not None)   # None: the setting left unset
            raise ConfigError(f.name, f"{value!r} is not one of: {shown}")


def _hints(cls) -> dict:
    import typing
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


_HINTS: dict = {}


def _literal_choices(tp) -> tuple | None:
    """The values a ``Literal[...]`` (or ``Literal[...] | None``) annotation allows; None for other annotations."""
    import types
    import typing
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        parts = typing.get_args(tp)
        literals = [a for a in parts if typing.get_origin(a) is typing.Literal]
        if len(literals) == 1 and all(a is type(None) or a in literals for a in parts):
            return (*typing.get_args(literals[0]), *((None,) if type(None) in parts else ()))
    return None
