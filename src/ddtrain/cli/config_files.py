"""Settings from files for ``ddtrain train``: ``--config FILE`` (TOML or YAML) and ``--config-from RESULTS.json``.

Both are the command line's: a file's keys are the flags' names, and its problems are reported
naming the file, its line and the key (or the flag that named the file). A file is read only if
it is a regular file of reasonable size (a FIFO would block the command forever), must be UTF-8,
and may not be nested deeper than a parser can follow (each is one line naming the file; issue 32).

A replay (``--config-from``) runs on this machine: the record's outputs are not replayed (a
replay writes anew), nor is where it ran (``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``): a
record of a multi-node job replays its world size here as ``--nproc``, with a note saying so
(issue 32: it waited for a node that never came). Give those flags to replay it across nodes.
"""
from __future__ import annotations

import sys
import typing

from ddtrain.config import _UNIONS, NOT_FLAGS, TrainConfig, field_kind, fields_of, flag_name
from ddtrain.errors import ConfigError, DDTrainError
from ddtrain.reliability.regular_files import NotRegular, read_regular

CONFIG_SUFFIXES = (".toml", ".yaml", ".yml")
OUTPUTS = ("out", "save", "tensorboard", "csv", "trace", "checkpoint_dir")   # not replayed: a replay writes anew
PLACEMENT = ("nnodes", "node_rank", "rdzv_endpoint")   # not replayed: where the run ran; a replay runs here
CONFIG_LIMIT = 4 << 20      # bytes: a settings file is a few hundred
RECORD_LIMIT = 256 << 20    # bytes: a results record with every epoch's and step's figures


def read_text(path: str, flag: str, limit: int) -> str:
    """The UTF-8 text of the settings file ``path`` named by ``flag``; one DDTrainError line naming it otherwise."""
    try:
        data = read_regular(path, limit)
    except NotRegular as exc:
        raise DDTrainError(f"{flag} {path}: it {exc}; give a settings file") from None
    except OSError as exc:
        raise DDTrainError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DDTrainError(f"{flag} {path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                           "save it as UTF-8") from None


def _too_deep(flag: str, path: str, what: str) -> DDTrainError:
    return DDTrainError(f"{flag} {path}: its {what} is nested too deeply to be read (thousands of levels of lists "
                        "or tables; a settings file has one or two)")


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
    text = read_text(path, "--config", CONFIG_LIMIT)
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
        except RecursionError:
            raise _too_deep("--config", path, "YAML") from None
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
    except RecursionError:
        raise _too_deep("--config", path, "TOML") from None


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

    Outputs (``OUTPUTS``) are left out, so that a replay never overwrites the run it replays, and
    so is where it ran (``PLACEMENT``): a multi-node record replays its world size on this machine.
    """
    import json
    text = read_text(path, "--config-from", RECORD_LIMIT)
    try:
        record = json.loads(text)
    except RecursionError:
        raise _too_deep("--config-from", path, "JSON") from None
    except ValueError as exc:
        raise DDTrainError(f"--config-from {path}: not a JSON results record ({exc})") from None
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
        raise DDTrainError(f"--config-from {path}: no 'config' in it (is it the --out record of ddtrain train?)")
    world_size = record.get("world_size")
    if world_size is not None and (not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1):
        raise DDTrainError(f"--config-from {path}: its 'world_size' is {json.dumps(world_size)[:40]}, not a positive "
                           "number of workers: the record is damaged or was edited; correct it (the run's worker "
                           "count), or delete the field and give --nproc N")
    try:
        config = TrainConfig.from_dict(record["config"])
    except (ConfigError, TypeError, ValueError, AttributeError, KeyError) as exc:
        raise DDTrainError(f"--config-from {path}: its config does not load: {exc}") from None
    except RecursionError:
        raise _too_deep("--config-from", path, "config") from None
    flat = config.flat()
    values = {k: v for k, v in flat.items() if k not in OUTPUTS and k not in NOT_FLAGS and k not in PLACEMENT}
    if world_size is None:
        print(f"ddtrain: note: --config-from {path}: the record has no 'world_size'; the replay runs on --nproc "
              "workers (1 unless given)", file=sys.stderr, flush=True)
    nodes = flat.get("nnodes", 1)
    if nodes not in (1, "1"):
        shown = f"--nproc {world_size}" if world_size else "--nproc 1"
        print(f"ddtrain: note: --config-from {path}: the record ran on {nodes} nodes (world size {world_size or '?'}); "
              f"a replay runs on this machine with {shown}; to replay it across nodes give --nnodes, --node-rank, "
              "--rdzv-endpoint and --nproc (the workers of each node)", file=sys.stderr, flush=True)
    return values, world_size
