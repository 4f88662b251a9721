"""``--help`` of every command answers without importing torch (issue 32: `train`, `demo`, `model comm`, `model
flops`, `bench collectives` took 3.7-7.8 s), and the help pages kept for the commands whose flags need torch
(``ddtrain/cli/help_snapshot.py``) are the real parsers' pages, model and strategy lists included."""
import os
import subprocess
import sys

import pytest

from helpers import REPO

from ddtrain.cli import COMMANDS, quick_help

WATCH = ("import sys, runpy; sys.argv = ['ddtrain', *sys.argv[1:]]\n"
         "try:\n    runpy.run_module('ddtrain', run_name='__main__')\n"
         "except SystemExit as exit_:\n    code = exit_.code\n"
         "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', code)\n")


@pytest.mark.parametrize("words", list(COMMANDS), ids=" ".join)
def test_help_of_every_command_imports_no_torch(words):
    result = subprocess.run([sys.executable, "-c", WATCH, *words, "--help"], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert result.stdout.strip().splitlines()[-1] in ("NO-TORCH 0", "NO-TORCH None"), result.stdout[-500:] + \
        result.stderr[-2000:]
    assert f"usage: ddtrain {' '.join(words)}" in result.stdout


@pytest.mark.parametrize("words", list(quick_help.COMMANDS_WITH_SNAPSHOT), ids=" ".join)
def test_the_kept_help_pages_are_the_real_ones(words, monkeypatch):
    """Fails after a flag (or its help, default, choices, a model or strategy) changed: write the pages again with
    ``PYTHONPATH=src python -m ddtrain.cli.quick_help`` (the help is right meanwhile, only slower)."""
    from ddtrain.cli.help_snapshot import SNAPSHOTS
    monkeypatch.setenv("COLUMNS", "100")
    kept = SNAPSHOTS[" ".join(words)]
    real = quick_help.real_parser(words)
    assert quick_help.rebuild(kept["parser"]).format_help() == real.format_help(), \
        "run: PYTHONPATH=src python -m ddtrain.cli.quick_help"
    assert kept["sources"] == quick_help.sources(words) and kept["sha256"] == quick_help.fingerprint(kept["sources"]), \
        "run: PYTHONPATH=src python -m ddtrain.cli.quick_help"


def test_train_help_lists_the_registries():
    from ddtrain.data import DATASETS
    from ddtrain.models import MODELS
    from ddtrain.sync import STRATEGIES
    text = quick_help.real_parser(("train",)).format_help().replace("\n", " ")
    text = " ".join(text.split())
    for names in (MODELS, STRATEGIES, DATASETS):
        assert ", ".join(names) in text.replace("- ", "-"), names


def test_a_stale_page_is_not_used(tmp_path, monkeypatch, capsys):
    """A source changed since the page was kept: the real parser answers (slower, never out of date)."""
    from ddtrain.cli import help_snapshot
    entry = {**help_snapshot.SNAPSHOTS["train"], "sha256": "0" * 64}
    monkeypatch.setitem(help_snapshot.SNAPSHOTS, "train", entry)
    assert quick_help.print_help(("train",)) is False
    assert capsys.readouterr().out == ""
