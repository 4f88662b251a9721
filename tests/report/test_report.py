"""``ddtrain report``: from real results (profiled training runs on 1 and 2 ranks, their scaling summary,
a bench collectives result with its calibration) to report.md and a self-contained report.html whose
figures are real images; the HTML is opened in headless Chromium where it is installed."""
import json
import re
import shutil
import subprocess

import pytest
import torch

from ddtrain import TrainConfig, fit
from ddtrain.observe import files
from ddtrain.observe.profiler import Profiler
from ddtrain.bench.scaling import Cell, ScalingConfig
from ddtrain.bench.scaling import cell_row, finish_rows
from ddtrain.data import Data
from ddtrain.data.arrays import ArrayDataset
from ddtrain.errors import DDTrainError
from ddtrain.models import build_model
from ddtrain.report.build import build
from multirank import run_ranks

PIL = pytest.importorskip("PIL.Image")
pytest.importorskip("matplotlib")


def profiled_run(out_path):
    torch.manual_seed(0)
    x, y = torch.randn(1024, 1, 8, 8, generator=torch.Generator().manual_seed(1)), torch.arange(1024) % 10
    data = Data("synthetic", ArrayDataset(x, y, num_classes=10), None, 10, (1, 8, 8), "classification")
    model = build_model("mlp", num_classes=10, in_channels=1, input_size=(8, 8), hidden=(256, 128))
    config = TrainConfig.from_flat(model="mlp", data="synthetic", strategy="ddp", epochs=0, steps=20, batch_size=32,
                         lr=0.05, val_fraction=0.0, quiet=True, out=out_path)
    fit(model, data, config, callbacks=[Profiler(monitor=True, interval_s=0.05, warmup_steps=2)])


def collectives(path):
    import torch.distributed as dist
    from ddtrain.bench.collectives import BenchConfig, run_bench
    from ddtrain.bench.collectives import write_outputs
    result = run_bench(BenchConfig(algorithms=["native", "ring"], sizes=[4096, 65536], iters=3,
                                   min_iters=2, warmup=1, budget_s=0.05, calibration_s=1.0))
    if dist.get_rank() == 0:
        write_outputs(result, json_path=path)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("results")
    cells = root / "bench" / "cells"
    config = ScalingConfig.of(model="mlp", data="synthetic", strategies=["ddp"], workers=[1, 2], steps=18,
                              warmup_steps=2)
    rows = []
    for workers in (1, 2):
        cell = Cell("ddp", workers, workers, 32, 0, "off")
        path = cells / f"{cell.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        if workers == 1:
            profiled_run(str(path))                  # this process: a world of one
        else:
            run_ranks(profiled_run, 2, str(path))
        log = cells / f"{cell.name}.log"
        log.write_text("")
        rows.append(cell_row(config, cell, {"exit_code": 0, "timed_out": False, "wall_s": 1.0, "log": str(log)},
                             path, root / "bench"))
    finish_rows(rows)
    files.write_json(root / "bench" / "scaling.json", {"kind": "ddtrain-bench-scaling", "cores": 2,
                                                         "config": config.as_dict(), "elapsed_s": 1.0, "cells": rows})
    shutil.copy(cells / "ddp-w2-b32-lw0-off.json", root / "run.json")     # a loose train record too
    run_ranks(collectives, 2, str(root / "collectives.json"))
    out = build(root, root)
    return root, out


def test_report_has_every_figure_the_results_allow(results):
    root, out = results
    titles = out["figures"]
    for expected in ("Throughput against workers", "Speed-up against workers, with the ideal line",
                     "Step time split per rank", "CPU utilisation and network traffic per rank",
                     "Bus bandwidth against message size", "Measured against cost-model time: one all-reduce",
                     "Measured against cost-model time: gradient sync per step"):
        assert any(t.startswith(expected) or expected in t for t in titles), (expected, titles)


def test_every_figure_is_a_real_picture(results):
    root, _ = results
    pngs = sorted((root / "report_files").glob("*.png"))
    assert len(pngs) >= 7
    for png in pngs:
        with PIL.open(png) as image:
            assert image.width >= 500 and image.height >= 350
            colours = image.convert("RGB").getcolors(maxcolors=1 << 16)
            assert colours is None or len(colours) > 50, png   # lines, text and axes, not a blank canvas


def test_markdown_has_tables_with_units_and_links_every_figure(results):
    root, out = results
    md = out["markdown"].read_text()
    assert "| strategy | workers | ranks | batch (/worker)" in md and "throughput (samples/s)" in md
    assert "step (ms)" in md and "epoch (s)" in md and "extrapolated" in md
    scaling = json.loads((root / "bench" / "scaling.json").read_text())
    for cell in scaling["cells"]:
        assert f"| {cell['samples_per_s']:.1f} |" in md
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert len(links) == len(out["figures"]) and all((root / link).exists() for link in links)
    assert "## Training runs" in md and "run.json" in md


def test_html_is_self_contained(results):
    _, out = results
    text = out["html"].read_text()
    sources = re.findall(r'(?:src|href)="([^"]*)"', text)
    assert sources and all(s.startswith("data:image/png;base64,") for s in sources)
    assert text.count("<img ") == len(out["figures"]) and "<table>" in text


def test_an_empty_folder_is_refused(tmp_path):
    with pytest.raises(DDTrainError, match="no results under"):
        build(tmp_path, tmp_path)


CHECK = """<script>
window.__errors = [];
window.addEventListener('error', e => window.__errors.push(String(e.message || e.type)), true);
window.addEventListener('load', () => {
  const bad = [...document.images].filter(i => !i.complete || i.naturalWidth === 0).length;
  document.body.setAttribute('data-check', `images=${document.images.length} broken=${bad} errors=${window.__errors.length}`);
});
</script>"""


@pytest.mark.skipif(not (shutil.which("chromium") or shutil.which("chromium-browser")),
                    reason="Chromium is not installed")
def test_html_opens_in_headless_chromium_without_errors(results, tmp_path):
    _, out = results
    page = tmp_path / "report.html"
    page.write_text(out["html"].read_text().replace("<head>", "<head>" + CHECK, 1))
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
                           "--v=0", "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    check = re.search(r'data-check="images=(\d+) broken=(\d+) errors=(\d+)"', proc.stdout)
    assert check, proc.stdout[:500]
    images, broken, errors = map(int, check.groups())
    assert images == len(out["figures"]) and broken == 0 and errors == 0
    console = [line for line in proc.stderr.splitlines() if "CONSOLE" in line]
    assert not console, console
