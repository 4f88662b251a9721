"""``--help`` of the commands whose flags need torch to be built, answered without importing it.

``ddtrain train``'s flags are generated from the configuration dataclasses, whose packages import
torch (3.7-7.8 s on a loaded machine for a help page: issue 32). Their parsers are described once
here (``describe``: the groups and each flag's strings, help, default, choices) and kept in
``help_snapshot.py``; ``--help`` rebuilds the parser from that description (argparse formats it
for the terminal as usual) when the sources it was described from are unchanged (their SHA-256),
else builds the real parser. ``tests/cli/test_quick_help.py`` checks that the snapshot is the real
parser's help and that the commands' help imports no torch; after changing a flag, write it again:

    PYTHONPATH=src python -m ddtrain.cli.quick_help
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import pprint
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent      # src/ddtrain
SNAPSHOT = Path(__file__).with_name("help_snapshot.py")
# the commands whose parser needs torch, with the modules besides theirs that write their help page (their
# defaults, choices); `train`'s are TrainConfig's sections, found from it
COMMANDS_WITH_SNAPSHOT = {("train",): (), ("bench", "collectives"): ("ddtrain.bench.collectives",
                                                                     "ddtrain.distributed.config"),
                          ("bench", "data"): (), ("cluster", "probe"): ("ddtrain.cluster.probe",)}
_ACTIONS = {"_StoreAction": "store", "_StoreTrueAction": "store_true", "_StoreFalseAction": "store_false",
            "_AppendAction": "append", "_StoreConstAction": "store_const", "_CountAction": "count"}


def wants_help(rest: list[str]) -> bool:
    """``-h``/``--help`` among the command's own arguments (not after ``--``)."""
    own = rest[:rest.index("--")] if "--" in rest else rest
    return "-h" in own or "--help" in own


def real_parser(words: tuple[str, ...]) -> argparse.ArgumentParser:
    """The command's parser as ``ddtrain.cli`` builds it (imports the command's module)."""
    from ddtrain.cli.commands import COMMANDS, new_parser
    module_name, help_ = COMMANDS[words]
    parser = new_parser(words, help_)
    importlib.import_module(module_name).add_arguments(parser)
    return parser


def describe(parser: argparse.ArgumentParser) -> dict:
    """The parser as plain data: what its help page shows, nothing it needs to parse."""
    groups = []
    for group in parser._action_groups:
        actions = []
        for action in group._group_actions:
            if type(action).__name__ == "_HelpAction":
                continue
            kind = _ACTIONS.get(type(action).__name__)
            if kind is None:
                raise TypeError(f"quick help cannot describe {type(action).__name__} ({action.option_strings})")
            actions.append({"option_strings": list(action.option_strings), "dest": action.dest, "kind": kind,
                            "nargs": action.nargs, "required": action.required, "help": action.help,
                            "metavar": list(action.metavar) if isinstance(action.metavar, tuple) else action.metavar,
                            # the help page prints str(default) and str(choice): strings render the same
                            "default": str(action.default),
                            "choices": None if action.choices is None else [str(c) for c in action.choices]})
        groups.append({"title": group.title, "description": group.description, "actions": actions})
    return {"prog": parser.prog, "description": parser.description, "epilog": parser.epilog, "groups": groups}


def rebuild(description: dict) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` whose help page is the described parser's."""
    parser = argparse.ArgumentParser(prog=description["prog"], description=description["description"],
                                     epilog=description["epilog"],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    standard = {"positional arguments", "options", "optional arguments"}
    for group in description["groups"]:
        target = (parser if group["title"] in standard
                  else parser.add_argument_group(group["title"], group["description"]))
        for a in group["actions"]:
            # argparse tells a suppressed help or default by identity with its SUPPRESS string
            kwargs = {key: argparse.SUPPRESS if a[key] == argparse.SUPPRESS else a[key] for key in ("help", "default")}
            if a["kind"] in ("store", "append"):
                kwargs.update(nargs=a["nargs"], choices=a["choices"],
                              metavar=tuple(a["metavar"]) if isinstance(a["metavar"], list) else a["metavar"])
            if a["option_strings"]:
                kwargs.update(dest=a["dest"], required=a["required"])
                target.add_argument(*a["option_strings"], action=a["kind"], **kwargs)
            else:
                target.add_argument(a["dest"], action=a["kind"], **kwargs)
    return parser


def sources(words: tuple[str, ...]) -> list[str]:
    """The files a command's help page is written from (paths under src/ddtrain): ``ddtrain.cli.commands``, the command's
    module and the flag generator; for ``train`` the modules of ``TrainConfig`` and of each of its sections, whose
    fields' comments are the flags' help; the modules ``COMMANDS_WITH_SNAPSHOT`` names. The registries' names the
    help lists (models, strategies, data formats) are checked by the test."""
    import inspect

    from ddtrain.cli.commands import COMMANDS
    module = importlib.import_module(COMMANDS[words][0])
    files = {Path(module.__file__), Path(__file__).with_name("commands.py"), Path(__file__).with_name("args.py")}
    if words == ("train",):
        from ddtrain.config import TrainConfig
        files.update(Path(inspect.getsourcefile(type(c))) for c in [TrainConfig(), *_sections(TrainConfig())])
    files.update(Path(importlib.import_module(name).__file__) for name in COMMANDS_WITH_SNAPSHOT[words])
    return sorted(str(f.relative_to(PACKAGE)) for f in files)


def _sections(config) -> list:
    """The nested dataclass sections of a config, depth first."""
    import dataclasses
    out = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out += [value, *_sections(value)]
    return out


def fingerprint(files: list[str]) -> str:
    digest = hashlib.sha256()
    for name in files:
        digest.update(name.encode() + b"\0" + (PACKAGE / name).read_bytes())
    return digest.hexdigest()


def snapshot_of(words: tuple[str, ...]) -> dict:
    """The stored entry for ``words``: its parser's description and the fingerprint of its sources."""
    files = sources(words)
    return {"parser": describe(real_parser(words)), "sources": files, "sha256": fingerprint(files)}


def print_help(words: tuple[str, ...]) -> bool:
    """Print ``words``' help page from the snapshot; False (nothing printed) when it is missing or stale."""
    try:
        from ddtrain.cli.help_snapshot import SNAPSHOTS
    except ImportError:
        return False
    entry = SNAPSHOTS.get(" ".join(words))
    if entry is None:
        return False
    try:
        if fingerprint(entry["sources"]) != entry["sha256"]:
            return False
    except OSError:   # a source file gone: a changed tree
        return False
    rebuild(entry["parser"]).print_help()
    return True


def write(path: Path = SNAPSHOT) -> None:
    entries = {" ".join(words): snapshot_of(words) for words in COMMANDS_WITH_SNAPSHOT}
    text = ('"""Generated by ``python -m ddtrain.cli.quick_help`` (ddtrain/cli/quick_help.py says why); '
            'do not edit."""\n'
            f"SNAPSHOTS = {pprint.pformat(entries, width=120, sort_dicts=False)}\n")
    path.write_text(text)


if __name__ == "__main__":
    write()
    print(f"wrote {SNAPSHOT}")
