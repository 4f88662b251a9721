"""Command-line flags generated from configuration dataclasses.

One generic generator instead of a hand-written flag per field: a field ``batch_size: int = 64
# samples per step on each rank`` becomes ``--batch-size`` with that comment as its help, a
``Literal`` becomes the flag's choices, a ``bool`` a switch, a ``dict`` a repeatable
``--model-arg KEY=VALUE``, and a nested dataclass (a section another package owns) an argument
group (a small generic generator in one place, in place of a dataclass-to-CLI library:
docs/DEPENDENCIES.md says why). ``config_from_args`` builds the config from the parsed flags; its inverse,
``ddtrain.config.to_argv``, is what starts ``ddtrain train`` again (workers, benchmark cells,
the demo), so no flag is serialised by hand. Flag names are the field names with dashes.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import io
import re
import tokenize
import typing

from ddtrain.config import NOT_FLAGS, TrainConfig, field_kind, fields_of, flag_name, parse_kv
from ddtrain.errors import ConfigError


def describe(error: ConfigError) -> str:
    """A ConfigError as the command line says it: the flag, then the problem, fields named in it as flags too.

    The library names fields (``global_batch_size 100 does not divide ... x grad_accum 2``); here
    a field with an underscore in its name (no word of prose has one), or one the error ``mentions``,
    reads as its flag, unless written as Python's ``name=value`` (a ``prepare()`` call's spelling).
    """
    flags, mentioned = _flag_fields(), set(error.mentions)
    problem = re.sub(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)*\b(?!=)",
                     lambda m: flag_name(m.group()) if m.group() in flags and ("_" in m.group() or m.group() in mentioned)
                     else m.group(), error.problem)
    return f"{error.flag or flag_name(error.field)} {problem}"


@functools.cache
def _flag_fields() -> frozenset:
    return frozenset(f.name for f, _ in fields_of(TrainConfig))


@functools.cache
def field_help(cls) -> dict[str, str]:
    """``{field: comment}`` from the comment that ends each field's line in ``cls``'s source."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    names = {}
    for number, line in enumerate(source.splitlines(), 1):
        head = line.strip().split(":", 1)[0]
        if ":" in line and head.isidentifier() and head not in ("def", "class", "return"):
            names[number] = head
    helps = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and tok.start[0] in names:
            helps.setdefault(names[tok.start[0]], tok.string.lstrip("#").strip())
    return helps


def _int_or_word(text: str):
    """``"4"`` -> 4; a word (``"epoch"``) stays a string."""
    try:
        return int(text)
    except ValueError:
        return text


# flags whose values are a registry's names: their --help lists them (issue 32: train --help named no model nor
# strategy); (module, registry, how the list is introduced)
REGISTRY_FLAGS = {"model": ("ddtrain.models", "MODELS", "one of"),
                  "strategy": ("ddtrain.sync", "STRATEGIES", "one of"),
                  "data": ("ddtrain.data", "DATASETS", "formats")}


def registry_help(name: str) -> str:
    """``"; one of: mlp, simple-cnn, ..."`` for a flag of ``REGISTRY_FLAGS`` ("" for any other)."""
    if name not in REGISTRY_FLAGS:
        return ""
    module, registry, lead = REGISTRY_FLAGS[name]
    import importlib
    return f"; {lead}: {', '.join(getattr(importlib.import_module(module), registry))}"


def add_dataclass_arguments(parser, cls=TrainConfig, *, skip=()) -> None:
    """One flag per field of ``cls`` (sections as argument groups), defaults from the dataclass."""
    hints = typing.get_type_hints(cls)
    helps = field_help(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            group = parser.add_argument_group(f"{f.name}: {(tp.__doc__ or '').strip().rstrip('.')}")
            add_dataclass_arguments(group, tp, skip=skip)
            continue
        if f.name in NOT_FLAGS or f.name in skip:
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        bare, kind = field_kind(tp)
        kwargs = {"help": helps.get(f.name, "") + registry_help(f.name), "dest": f.name}
        if kind == "switch":
            parser.add_argument(flag_name(f.name), action="store_true", **kwargs)
        elif kind == "pairs":
            parser.add_argument(flag_name(f.name), action="append", metavar="KEY=VALUE", default=None, **kwargs)
        elif kind == "choice":
            parser.add_argument(flag_name(f.name), choices=list(typing.get_args(bare)), default=default, **kwargs)
        elif kind == "int-or-word":
            parser.add_argument(flag_name(f.name), type=_int_or_word, default=default, **kwargs)
        else:
            parser.add_argument(flag_name(f.name), type=bare if bare in (int, float, str) else str,
                                default=default, **kwargs)


def config_from_args(args: argparse.Namespace, defaults: dict | None = None, cls=TrainConfig):
    """The config the parsed flags describe (``from_flat`` of every flag's value).

    ``defaults`` (``{field: value}``, from a config file or a replayed record) fill what the flags
    leave out: ``reparse_with_defaults`` made them the parser's defaults, and a ``--model-arg``
    style option adds its pairs to the file's table.
    """
    defaults = defaults or {}
    values = {}
    for f, tp in fields_of(cls):
        if hasattr(args, f.name):
            value = getattr(args, f.name)
            if field_kind(tp)[1] == "pairs":
                value = {**(defaults.get(f.name) or {}), **parse_kv(value, flag_name(f.name))}
            values[f.name] = value
    return cls.from_flat(**values)


def reparse_with_defaults(add_arguments, argv: list[str], defaults: dict) -> argparse.Namespace:
    """Parse ``argv`` again with ``defaults`` as the parser's defaults: flags given on the line win."""
    parser = argparse.ArgumentParser(add_help=False)
    add_arguments(parser)
    parser.set_defaults(**{k: v for k, v in defaults.items() if not isinstance(v, dict)})
    args = parser.parse_args(argv)
    args.argv = argv
    return args
