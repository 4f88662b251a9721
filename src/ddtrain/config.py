"""One run's settings: ``TrainConfig``, with the sections its packages own nested inside it.

The command line's flags are generated from these fields (``ddtrain.cli.args``: the comment
after a field is its ``--help``, a ``Literal`` its choices), launching serialises the config
back to flags once (``ddtrain.cli.args.to_argv``), and every results record stores the
resolved config (``as_dict``). Each ``__post_init__`` checks its own fields and raises a
``ConfigError`` naming the field; the command line names the flag instead.
"""
from __future__ import annotations

import ast
import dataclasses
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from typing import Literal

from ddtrain.data.config import DataConfig
from ddtrain.distributed.config import DistConfig
from ddtrain.errors import ConfigError, DDTrainError, check_choices
from ddtrain.observe.config import ProfileConfig
from ddtrain.observe.tracking import TrackingConfig
from ddtrain.recipe.config import RecipeConfig
from ddtrain.reliability.config import ReliabilityConfig
from ddtrain.sync.base import SyncOptions

AmpMode = Literal["off", "bf16", "fp16"]
AMP_MODES = typing.get_args(AmpMode)
# The sections, each owned by the package that reads it; their fields are flags like the top-level ones.
SECTIONS = {"data": DataConfig, "recipe": RecipeConfig, "sync": SyncOptions, "reliability": ReliabilityConfig,
            "profile": ProfileConfig, "tracking": TrackingConfig, "dist": DistConfig}

# What a field's ``metadata`` says (``reliability.consistency`` derives its field lists from it, and
# tests/test_config_metadata.py fails when a setting that changes training is not marked):
#   "agree":  True: every rank must have the same value (the start-up fingerprint holds it);
#             "content": compared through what it yields (the data set's size, shape and dtype).
#   "resume": what resuming from a checkpoint requires of it: "same" (the checkpoint was written with
#             the same value), "same-workers" (the same unless the worker count changed, the global batch
#             kept: docs/ELASTIC.md), "may-change" (training goes on with the new value), "content" (as agree).
# A field without them changes nothing that ranks or a checkpoint must share (outputs, logging, launch).
AGREE_WORDS, RESUME_WORDS = (True, "content"), ("same", "same-workers", "may-change", "content")


@dataclass(kw_only=True)
class TrainConfig:
    """One training run: what to train, for how long, how; the sections hold the data, the recipe, the strategy, ..."""

    model: str = field(default="simple-cnn", metadata={"agree": True, "resume": "same"})   # model name (see ddtrain.models.MODELS)
    model_args: dict = field(default_factory=dict, metadata={"agree": True, "resume": "same"})   # model option, e.g. hidden=256,128
    strategy: str = field(default="ddp", metadata={"agree": True, "resume": "same"})   # synchronisation strategy (see ddtrain.sync.STRATEGIES)
    epochs: int | None = field(default=None, metadata={"agree": True, "resume": "may-change"})   # passes over the training data (default 1, or as many as --steps needs)
    steps: int = field(default=0, metadata={"agree": True, "resume": "may-change"})   # stop after this many steps in all (0: no limit)
    seed: int = field(default=0, metadata={"agree": True, "resume": "same"})   # seed for initialisation, shuffling and dropout
    amp: AmpMode = field(default="off", metadata={"agree": True, "resume": "same"})   # mixed precision (fp16 with a gradient scaler)
    channels_last: bool = False            # NHWC memory layout
    compile: bool = False                  # torch.compile the model
    compile_options: Literal["auto", "tuned", "tuned-graphs", "graphs", "default"] = "auto"   # with --compile on CUDA: tuned adds inductor's kernel tuning, tuned-graphs also CUDA graphs, graphs CUDA graphs without the tuning, auto tunes runs of >= 100,000 steps (tuned-graphs in one process, tuned otherwise) and takes the defaults for shorter ones, default is torch.compile's own (docs/PERFORMANCE.md)
    log_every: int = 0                     # print a line every N steps (0: per epoch)
    quiet: bool = False                    # no epoch lines or progress bar (errors only)
    out: str | None = None              # write the results record (JSON) here
    save: str | None = None             # save the final model (.pt state dict or .safetensors)
    data: DataConfig = field(default_factory=DataConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    sync: SyncOptions = field(default_factory=SyncOptions)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    def __post_init__(self):
        if self.epochs is None:  # "as many as --steps needs" when only steps are given
            self.epochs = 0 if self.steps else 1
        for name in ("epochs", "steps", "log_every", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(name, f"must be a non-negative integer, got {value!r}")
        if self.epochs == 0 and self.steps == 0:
            raise ConfigError("epochs", "and steps are both 0: nothing to do")
        check_choices(self)
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(name, f"must be a {cls.__name__}, got {type(getattr(self, name)).__name__} "
                                        f"(TrainConfig.from_flat takes every setting by its own name)")
        # Options the strategy does not read are refused where a run starts (training.build.check_run: ddtrain
        # train before any worker, fit), not here: a config may carry options for the strategies of a matrix.
        from ddtrain.sync import strategy_spec  # here: the registry imports torch.distributed
        spec = strategy_spec(self.strategy)
        if self.reliability.checkpoint_dir and not spec.checkpointable:
            raise ConfigError("checkpoint_dir", f"is not supported with strategy {self.strategy!r}: its state lives "
                              "outside the training loop (use max_restarts alone, which restarts from step 0)")

    def resolved(self, workers: int, resuming: bool | None = None) -> TrainConfig:
        """This config with ``recipe.batch_size`` the per-rank micro-batch on ``workers`` (``ddtrain.recipe.resolve``).

        ``resuming`` (default: ``reliability.resume``) keeps the global batch at another worker count.
        """
        from ddtrain import recipe
        resuming = self.reliability.resume if resuming is None else resuming
        mine = recipe.resolve(self.recipe, workers, resuming)
        return self if mine == self.recipe else dataclasses.replace(self, recipe=mine)

    def as_dict(self) -> dict:
        return asdict(self)

    def flat(self) -> dict:
        """Every setting under its own name, sections flattened (the inverse of ``from_flat``)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in SECTIONS}
        for name in SECTIONS:
            out.update(asdict(getattr(self, name)))
        return out

    @classmethod
    def from_flat(cls, **values) -> TrainConfig:
        """Build from one flat mapping of field names (the flags' names, a config file's keys):
        ``TrainConfig.from_flat(strategy="ps-sync", servers=2, lr=0.1, data="mnist:DIR")``.

        A section may also come whole, as its dataclass or as a dict of its fields (``as_dict``'s
        nesting); flat names given beside it override its values.
        """
        sections = {name: {} for name in SECTIONS}
        given = {}
        owner = {f.name: name for name, section in SECTIONS.items() for f in fields(section)}
        top = {}
        for key, value in values.items():
            if key in SECTIONS and isinstance(value, SECTIONS[key]):
                given[key] = value
            elif key in SECTIONS and isinstance(value, dict):   # "data" is a section and a field: a dict is the section
                sections[key].update(value)
            elif key in owner:
                sections[owner[key]][key] = value
            else:
                top[key] = value
        unknown = sorted(set(top) - {f.name for f in fields(cls)})
        for name, kwargs in sections.items():
            unknown += sorted(set(kwargs) - {f.name for f in fields(SECTIONS[name])})
        if unknown:
            raise ConfigError(unknown[0], "is not a setting of TrainConfig")
        built = {name: dataclasses.replace(given[name], **kwargs) if name in given else SECTIONS[name](**kwargs)
                 for name, kwargs in sections.items()}
        return cls(**top, **built)

    @classmethod
    def from_dict(cls, data: dict) -> TrainConfig:
        """The inverse of ``as_dict``: a results record's ``config``, also one an earlier version wrote.

        Earlier records hold some or all sections' settings at the top (``record_settings`` reads
        both), and may hold strategy options their strategy never read (``bench scaling`` gave
        ``--sync-every`` to every cell): they had no effect then, so they are left at their defaults.
        """
        values = record_settings(data)
        from ddtrain.sync import STRATEGIES
        spec = STRATEGIES.get(values.get("strategy", "ddp"))
        if spec is not None:
            unread = {f.name for f in fields(SyncOptions)} - {n for n in values if spec.takes_option(n)}
            values = {k: v for k, v in values.items() if k not in unread}
        return cls.from_flat(**values)


def record_settings(config: dict) -> dict:
    """A results record's ``config`` as one flat ``{setting: value}``, whichever version wrote it.

    Records nest the sections (``{"recipe": {"lr": ...}, ...}``); earlier ones held the recipe's
    and the data's settings at the top. Readers of records look settings up here, by name.
    """
    out = {}
    for key, value in config.items():
        if key in SECTIONS and isinstance(value, dict):
            out.update(value)
        else:
            out[key] = value
    return out


def parse_kv(items: list[str], flag: str) -> dict:
    """``["hidden=256,128", "dropout=0"]`` -> ``{"hidden": (256, 128), "dropout": 0}``."""
    out = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise DDTrainError(f"{flag} takes KEY=VALUE, got {item!r}")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw  # a bare word stays a string
        out[key.replace("-", "_")] = value
    return out


# ---- settings as flags: the names ddtrain.cli.args generates, and a config turned back into them ----

# Fields whose flag is not the field's name. The learning-rate warm-up has the flags the recipes
# use (--warmup-steps/--warmup-epochs); the profile's steps left out of its times (ProfileConfig's
# warmup_steps, a name the benchmarks pass to from_flat) take --profile-warmup-steps.
FLAG_NAMES = {"model_args": "model-arg", "data_args": "data-arg", "lr_warmup_steps": "warmup-steps",
              "lr_warmup_epochs": "warmup-epochs", "warmup_steps": "profile-warmup-steps"}
# Fields that are not flags: the parameter servers' own deadline is --timeout (DistConfig).
NOT_FLAGS = {"timeout_s"}
_UNIONS = (typing.Union, types.UnionType)


def flag_name(field_name: str) -> str:
    return "--" + FLAG_NAMES.get(field_name, field_name.replace("_", "-"))


def field_kind(tp) -> tuple[object, str]:
    """(the annotation without ``Optional``, its kind: "switch", "pairs", "choice", "int-or-word" or "value")."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in _UNIONS and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        tp = rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]  # noqa: UP007 (a Union built at run time)
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return tp, "choice"
    if tp is bool:
        return tp, "switch"
    if tp is dict or origin is dict:
        return tp, "pairs"
    if origin in _UNIONS:
        return tp, "int-or-word"
    return tp, "value"


def fields_of(cls):
    """(field, annotation) for every setting of ``cls`` that is a flag, sections expanded in order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from fields_of(hints[f.name])
        elif f.name not in NOT_FLAGS:
            yield f, hints[f.name]


def to_argv(config: TrainConfig) -> list[str]:
    """Flags that rebuild ``config`` (``ddtrain train`` parses them back to an equal config).

    Only values that differ from the defaults, plus --epochs and --steps (resolved); used
    wherever ddtrain starts ``ddtrain train`` again: workers, benchmark cells, the demo.
    """
    mine, base = config.flat(), type(config)().flat()
    argv = []
    for f, tp in fields_of(type(config)):
        value = mine[f.name]
        if value == base[f.name] and f.name not in ("epochs", "steps"):
            continue
        kind = field_kind(tp)[1]
        flag = flag_name(f.name)
        if kind == "switch":
            if value:
                argv.append(flag)
            elif base[f.name]:
                raise DDTrainError(f"{flag}: a switch that is on by default cannot be turned off from the command line")
        elif kind == "pairs":
            for key, item in value.items():
                argv += [flag, f"{key}={item!r}"]
        elif value is not None:
            argv += [flag, str(value)]
    return argv
