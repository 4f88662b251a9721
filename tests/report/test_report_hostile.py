"""`ddtrain report` on what a new user has (issue 22): no matplotlib (a report without plots that says
how to get them), a truncated run.json (named as damaged, not "no results")."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from helpers import REPO
from ddtrain.config import TrainConfig
from ddtrain.training.build import load_and_build
from ddtrain.training.loop import fit

os.environ.pop("RANK", None)
NO_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None; from ddtrain.cli import main; sys.exit(main(sys.argv[1:]))"


def report(*args, block_matplotlib=False):
    code = NO_MATPLOTLIB if block_matplotlib else "import sys; from ddtrain.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "report", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO / "src")})


@pytest.fixture(scope="module")
def record_folder(tmp_path_factory):
    """A results record as `ddtrain demo` and `ddtrain train --out` write them."""
    folder = tmp_path_factory.mktemp("results")
    config = TrainConfig.from_flat(model="mlp", data="digits", batch_size=64, epochs=1, steps=3, quiet=True,
                                   out=str(folder / "workers1.json"))
    data, model = load_and_build(config)
    fit(model, data, config)
    return folder


def test_without_matplotlib_the_report_has_its_tables_and_says_how_to_get_the_plots(record_folder, tmp_path):
    """Was: exit 2, 'ddtrain report needs matplotlib' and no report, as soon as one plot was due."""
    folder = shutil.copytree(record_folder, tmp_path / "r")
    (folder / "collectives.json").write_text(json.dumps(
        {"world_size": 2, "backend": "gloo", "device": "cpu", "rows": [{"algorithm": "ring", "bytes": 1024,
        "time_us": 50.0, "busbw_GBps": 0.02}]}))
    result = report(folder, block_matplotlib=True)
    assert result.returncode == 0, result.stderr
    assert "# 2 plot(s) not drawn: matplotlib is not installed (pip install 'ddtrain[report]', then run ddtrain " \
           "report again); the tables are complete" in result.stdout
    assert "--plot" not in result.stdout + result.stderr and "Traceback" not in result.stderr
    text = (folder / "report.md").read_text()
    assert "| workers1.json | mlp | digits | ddp |" in text
    assert "(Plot `busbw-collectives-json.png` not drawn: matplotlib is not installed; " \
           "`pip install 'ddtrain[report]'` and run `ddtrain report` again to get it.)" in text
    assert (folder / "report.html").exists()


def test_right_after_the_demo_without_matplotlib(record_folder, tmp_path):
    """The demo's folder (records only) reports without matplotlib and speaks of no --plot flag (guard)."""
    result = report(record_folder, block_matplotlib=True)
    assert result.returncode == 0 and "--plot" not in result.stdout + result.stderr, result.stderr


def test_a_truncated_run_json_is_named_as_damaged(record_folder, tmp_path):
    """Was: 'ddtrain: error: no results under DIR: expected scaling.json ...'."""
    folder = tmp_path / "cut"
    folder.mkdir()
    text = (record_folder / "workers1.json").read_text()
    (folder / "run.json").write_text(text[: len(text) // 2])
    result = report(folder)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"ddtrain: error: {folder / 'run.json'} is damaged: it ends before its JSON does (cut off at "
        f"{len(text) // 2} bytes: " + result.stderr.split("bytes: ", 1)[1].split(")")[0] + "); it was not written whole "
        "(run again to rewrite it, or remove it) (no other results to report)"]
    # next to a good record: the report is written, the damaged file named in a warning and in the report
    shutil.copy(record_folder / "workers1.json", folder / "good.json")
    result = report(folder)
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith(f"ddtrain: warning: skipped {folder / 'run.json'} is damaged: it ends before")
    assert f"Skipped: {folder / 'run.json'} is damaged" in (folder / "report.md").read_text()


def test_a_file_that_is_not_json_at_all(tmp_path):
    (tmp_path / "x.json").write_text("not json, but a note\n")
    result = report(tmp_path)
    assert result.returncode == 2
    assert f"{tmp_path / 'x.json'} is damaged: not valid JSON (Expecting value at line 1, column 1)" in result.stderr


def test_the_demos_folder_gets_the_figures_its_records_allow_and_is_told_which_not(record_folder, tmp_path):
    """Issue 32: `ddtrain report` on the demo's output drew 0 figures and said nothing about why (matplotlib
    installed). Its records (1 and 2 workers, epochs, no profile, no system samples) give training curves,
    throughput and speed-up against workers; the timelines and the bus-bandwidth plot are named as not drawn."""
    pytest.importorskip("matplotlib")
    folder = shutil.copytree(record_folder, tmp_path / "demo")
    record = json.loads((folder / "workers1.json").read_text())
    record.update(workers=2, world_size=2, epochs=[{**e, "samples_per_s": 1.8 * e["samples_per_s"]}
                                                   for e in record["epochs"]])
    (folder / "workers2.json").write_text(json.dumps(record))
    result = report(folder)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "# ddtrain report: 3 figures" in out, out
    for title in ("Training curves per run", "Throughput against workers", "Speed-up against workers"):
        assert f"#   {title}" in out, out
    assert "# not drawn: CPU and network timelines: no record holds system samples (train with `--monitor-system`" \
           in out, out
    assert "# not drawn: the bus-bandwidth plot: no `bench collectives` output here" in out, out
    assert len(list((folder / "report_files").glob("*.png"))) == 3
