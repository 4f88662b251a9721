"""The ``ddtrain`` command: a table of subcommands, each a module with ``add_arguments`` and ``main``.

Only the chosen subcommand's module is imported, so ``ddtrain --help`` is quick and one
broken optional extra cannot take every command down.
"""
from __future__ import annotations

import importlib
import os
import signal
import sys

from ddtrain.errors import ConfigError, DDTrainError

from ddtrain.cli.commands import COMMANDS, new_parser


def _usage() -> str:
    width = max(len(" ".join(words)) for words in COMMANDS)
    lines = ["usage: ddtrain COMMAND [options]   (ddtrain COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {' '.join(words):<{width}}  {help_}" for words, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def _match(argv: list[str]):
    for n in (2, 1):
        words = tuple(argv[:n])
        if words in COMMANDS:
            return words, argv[n:]
    return None, argv


class Terminated(BaseException):
    """SIGTERM arrived (raised by the handler main installs in a process no launcher started)."""


def _on_sigterm(_signum, _frame):
    raise Terminated()


def check_environment() -> None:
    """The environment variables ddtrain reads, checked before any command runs (DDTrainError, one line)."""
    from ddtrain.distributed.config import default_timeout_s
    from ddtrain.reliability.faults import from_env
    default_timeout_s()
    from_env()
    from ddtrain.distributed.env import check_variables
    check_variables()
    logs = os.environ.get("DDTRAIN_LOG_DIR", "")
    if logs and not os.path.isdir(logs):
        raise DDTrainError(f"environment variable DDTRAIN_LOG_DIR={logs!r} is not a directory")
    backend = os.environ.get("DDTRAIN_BACKEND", "")
    from ddtrain.distributed.config import BACKENDS
    if backend and backend not in BACKENDS:
        raise DDTrainError(f"environment variable DDTRAIN_BACKEND={backend!r}: valid: {', '.join(BACKENDS)}")


def _drop_stale_launch_variables(rest: list[str]) -> None:
    """``--nproc N`` in a shell that kept RANK/WORLD_SIZE of an earlier job: say so, and start the N workers."""
    own = rest[:rest.index("--")] if "--" in rest else rest
    if not any(a == "--nproc" or a.startswith("--nproc=") for a in own):
        return
    from ddtrain.distributed.launch import stale_launch_variables
    stale = stale_launch_variables()
    if stale:
        shown = " ".join(f"{name}={os.environ[name]}" for name in stale)
        print(f"ddtrain: warning: ignoring {shown} from the environment: no launcher started this process "
              f"(no TORCHELASTIC_RUN_ID), and --nproc starts the workers", file=sys.stderr, flush=True)
        for name in stale:
            del os.environ[name]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        check_environment()
    except DDTrainError as exc:
        print(f"ddtrain: error: {exc}", file=sys.stderr, flush=True)
        return 2
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from ddtrain import __version__
        print(f"ddtrain {__version__}")
        return 0
    words, rest = _match(argv)
    if words is None:
        groups = sorted({w[0] for w in COMMANDS if len(w) > 1})
        hint = f" (try: ddtrain {argv[0]} {'|'.join(w[1] for w in COMMANDS if w[0] == argv[0])})" if argv[0] in groups else ""
        print(f"ddtrain: error: unknown command {' '.join(argv[:2])!r}{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, help_ = COMMANDS[words]
    _drop_stale_launch_variables(rest)
    from ddtrain.distributed.launch import LAUNCHER_PID_ENV, die_with_launcher, inside_launcher
    worker = inside_launcher() and LAUNCHER_PID_ENV in os.environ  # a rank that run_local started
    if worker:
        die_with_launcher()
        # Stopped by the launcher's agent (it forwards Ctrl-C and SIGTERM): end now, even inside a
        # collective that would hold a KeyboardInterrupt back until it returns; the launcher reports.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    elif not os.environ.get("DDTRAIN_DEBUG") and "TORCH_CPP_LOG_LEVEL" not in os.environ:
        # torch's C++ side prints its failed connects and timeouts with stack frames; ddtrain names them itself
        os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
        os.environ["DDTRAIN_SET_CPP_LOG_LEVEL"] = "1"
    previous = None
    if not inside_launcher() and threading_is_main():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)  # exit 143 with one line, not a traceback
    try:
        return _run(module_name, words, help_, rest)
    except KeyboardInterrupt:  # under run_local, the launcher says it once for the job
        if not worker:
            print("ddtrain: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        return 130
    except Terminated:
        print("ddtrain: stopped by SIGTERM", file=sys.stderr, flush=True)
        return 143
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def threading_is_main() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


def _run(module_name: str, words, help_: str, rest: list[str]) -> int:
    from ddtrain.cli import quick_help
    if words in quick_help.COMMANDS_WITH_SNAPSHOT and quick_help.wants_help(rest) and quick_help.print_help(words):
        raise SystemExit(0)   # as argparse's --help does; the page came without importing torch (cli/quick_help.py)
    module = importlib.import_module(module_name)
    parser = new_parser(words, help_)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    args.argv = rest
    try:
        return int(module.main(args) or 0)
    except ConfigError as exc:  # the library names the field; the command line names the flag
        from ddtrain.cli.args import describe
        from ddtrain.distributed.runtime import eprint
        eprint(f"ddtrain: error: {describe(exc)}")
        return 2
    except DDTrainError as exc:
        from ddtrain.distributed.runtime import eprint
        eprint(f"ddtrain: error: {exc}")
        return 2
    except Exception as exc:  # a bug or a failed peer: one line per rank, the traceback on request
        return _report_unexpected(exc)


def _report_unexpected(exc: Exception) -> int:
    """One line for this rank. A rank that merely lost a failed peer says so without claiming the error."""
    import os
    import traceback
    from ddtrain.distributed.launch import PEER_LOST   # one list, the launcher's too
    from ddtrain.distributed.runtime import eprint
    debug = bool(os.environ.get("DDTRAIN_DEBUG"))
    if debug:
        traceback.print_exc()
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    if any(p.lower() in text.lower() for p in PEER_LOST):
        eprint(f"stopped: lost contact with another rank ({type(exc).__name__}: {first[:160]})")
        # Let the launcher see the rank that failed first: it names the earliest failure, in whole seconds.
        import time
        time.sleep(2.0)
        from ddtrain.distributed.launch import LOST_PEER_EXIT
        return LOST_PEER_EXIT
    eprint(f"ddtrain: error: {type(exc).__name__}: {first}" + ("" if debug else "  (DDTRAIN_DEBUG=1 shows the traceback)"))
    return 1
