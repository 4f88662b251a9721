"""Settings from files for ``ddtrain train``: ``--config FILE`` (TOML or YAML) and ``--config-from RESULTS.json``.

Both are the command line's: a file's keys are the flags' names, and its problems are reported
naming the file, its line and the key (or the flag that named the file).
"""
from __future__ import annotations

import typing

from ddtrain.config import _UNIONS, NOT_FLAGS, TrainConfig, field_kind, fields_of, flag_name
from ddtrain.errors import ConfigError, DDTrainError

CONFIG_SUFFIXES = (".toml", ".yaml", ".yml")
OUTPUTS = ("out", "save", "tensorboard", "csv", "trace", "checkpoint_dir")   # not replayed: a replay writes anew


def flag_fields() -> dict[str, tuple[str, object]]:
    """``{flag name without dashes: (field name, annotation)}`` for every flag of ``ddtrain train``."""
    return {flag_name(f.name)[2:]: (f.name, tp) for f, tp in fields_of(TrainConfig)}


def read_config_file(path: str) -> dict:
    """``{field: value}`` from a TOML or YAML file of flat ``flag-name = value`` lines.

    Keys are the flags' names without the dashes (``lr-schedule`` or ``lr_schedule``); the
    ``model-arg``/``data-arg`` options are tables (``[model-arg]``, ``depth = 18``). An unknown key
    or a value of the wrong type is refused naming the file, its line and the key.
    """
    import pathlib
    file = pathlib.Path(path)
    if file.suffix not in CONFIG_SUFFIXES:
        raise DDTrainError(f"--config {path}: use a .toml or .yaml file")
    try:
        text = file.read_text()
    except OSError as exc:
        raise DDTrainError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    if file.suffix == ".toml":
        raw = _parse_toml(text, path)
    else:
        try:
            import yaml
        except ImportError:
            raise DDTrainError(f"--config {path}: YAML files need PyYAML (pip install pyyaml); or use TOML") from None
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise DDTrainError(f"--config {path}: not valid YAML: {exc}") from None
        raw = {} if raw is None else raw
        if not isinstance(raw, dict):
            raise DDTrainError(f"--config {path}: the file must be a mapping of flag names to values")
    known = flag_fields()
    out = {}
    for key, value in raw.items():
        where = f"{path}:{_line_of(text, str(key))}"
        name = str(key).replace("_", "-")
        if name not in known:
            import difflib
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else " (keys are the flags of ddtrain train --help)"
            raise DDTrainError(f"{where}: unknown key {key!r}{hint}")
        field_name, tp = known[name]
        problem = value_problem(tp, value)
        if problem:
            raise DDTrainError(f"{where}: {key} = {value!r}: {problem}")
        if isinstance(value, list):  # lr-milestones = [30, 60, 80]
            value = ",".join(str(v) for v in value)
        out[field_name] = value
    return out


def _parse_toml(text: str, path: str) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise DDTrainError(f"--config {path}: TOML needs Python 3.11 or the tomli package on Python 3.10 "
                               "(pip install tomli)") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise DDTrainError(f"--config {path}: not valid TOML: {exc}") from None


def _line_of(text: str, key: str) -> int:
    """The line where ``key`` is set (``key =``, ``key:`` or a ``[key]`` table), 1-based; 0 if not found."""
    import re
    pattern = re.compile(rf"""^\s*(\[\s*)?["']?{re.escape(key)}["']?\s*(=|:|\])""")
    for number, line in enumerate(text.splitlines(), 1):
        if pattern.match(line):
            return number
    return 0


def value_problem(tp, value) -> str | None:
    """What is wrong with ``value`` for a field annotated ``tp`` (None when it fits)."""
    bare, kind = field_kind(tp)
    optional = typing.get_origin(tp) in _UNIONS and type(None) in typing.get_args(tp)
    if value is None:
        return None if optional else "a value is required"
    if kind == "choice":
        allowed = typing.get_args(bare)
        return None if value in allowed else f"expected one of: {', '.join(map(str, allowed))}"
    if kind == "switch":
        return None if isinstance(value, bool) else "expected true or false"
    if kind == "pairs":
        return None if isinstance(value, dict) else "expected a table of KEY = VALUE"
    if kind == "int-or-word":
        return None if isinstance(value, (int, str)) and not isinstance(value, bool) else "expected an integer or a word"
    if bare is bool or isinstance(value, bool):
        return f"expected {getattr(bare, '__name__', bare)}, got a boolean"
    if bare is int:
        return None if isinstance(value, int) else f"expected an integer, got {type(value).__name__}"
    if bare is float:
        return None if isinstance(value, (int, float)) else f"expected a number, got {type(value).__name__}"
    if bare is str:
        if isinstance(value, list) and all(isinstance(v, (int, float, str)) for v in value):
            return None   # a list of values where a comma-separated string is expected
        return None if isinstance(value, str) else f"expected a string, got {type(value).__name__}"
    return None


def read_record_config(path: str) -> tuple[dict, int | None]:
    """(``{field: value}`` of a results record's resolved configuration, the run's world size) for a replay.

    Outputs (``OUTPUTS``) are left out, so that a replay never overwrites the run it replays.
    """
    import json
    try:
        with open(path) as f:
            record = json.load(f)
    except OSError as exc:
        raise DDTrainError(f"--config-from {path}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise DDTrainError(f"--config-from {path}: not a JSON results record ({exc})") from None
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
        raise DDTrainError(f"--config-from {path}: no 'config' in it (is it the --out record of ddtrain train?)")
    try:
        config = TrainConfig.from_dict(record["config"])
    except (ConfigError, TypeError) as exc:
        raise DDTrainError(f"--config-from {path}: its config does not load: {exc}") from None
    values = {k: v for k, v in config.flat().items() if k not in OUTPUTS and k not in NOT_FLAGS}
    return values, record.get("world_size")
