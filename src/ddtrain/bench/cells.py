"""Running one cell of ``ddtrain bench scaling``: a fresh launch, its progress, its deadline.

A cell is a new Python process that calls ``ddtrain.distributed.launch.run_local(ranks, ["train", ...])``
in its own session (so the cell's launcher and ranks can be stopped together). Its output
goes to ``<cell>.log``; the ``step N - loss`` lines rank 0 prints (``--log-every 1``) drive
the progress display. A cell that outlives ``--cell-timeout`` gets SIGTERM, then SIGKILL.
"""
from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

RUNNER = "import sys; from ddtrain.distributed.launch import run_local; sys.exit(run_local(int(sys.argv[1]), sys.argv[2:]))"
STEP_LINE = re.compile(r"^\s*step (\d+) - loss")


class Progress:
    """Which cell runs and how far it is: one redrawn line on a terminal, plain lines otherwise."""

    def __init__(self, total_cells: int, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.total, self.started = total_cells, time.perf_counter()
        self.last_draw = 0.0

    def cell(self, i: int, cell, note: str, final: bool = False) -> None:
        text = (f"[{i}/{self.total}] {cell.strategy}, {cell.workers} worker(s) ({cell.ranks} ranks), batch "
                f"{cell.batch_size}, loader {cell.loader_workers}, amp {cell.amp}: {note} "
                f"({time.perf_counter() - self.started:.0f} s in all)")
        if self.tty:
            now = time.perf_counter()
            if final or now - self.last_draw > 0.2:
                self.last_draw = now
                self.stream.write("\r" + text + "\x1b[K" + ("\n" if final else ""))
        elif final or note == "starting":
            self.stream.write("# " + text + "\n")
        self.stream.flush()


def run_cell(config, cell, argv: list[str], out: Path, progress: Progress, index: int, total_steps) -> dict:
    """Launch one cell, follow its output, enforce its deadline; returns {exit_code, wall_s, log}."""
    log_path = out / f"{cell.name}.log"
    env = dict(os.environ, DDTRAIN_TIMEOUT_S=str(config.train.dist.timeout), PYTHONUNBUFFERED="1")
    if not (os.environ.get("DDTRAIN_KEEP_OMP") and "OMP_NUM_THREADS" in env):
        # the same threads per worker in every cell (run_local keeps a value it did not set itself)
        env["OMP_NUM_THREADS"] = str(config.threads_per_worker)
        env.pop("DDTRAIN_SET_OMP_NUM_THREADS", None)
    progress.cell(index, cell, "starting")
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", RUNNER, str(cell.ranks), *argv],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        deadline = start + config.cell_timeout_s
        timed_out = False
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        while True:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                line = ""
            if line is None:  # the job closed its output
                break
            log.write(line)
            match = STEP_LINE.match(line)
            if match:
                progress.cell(index, cell, f"step {match.group(1)}/{total_steps or '?'}")
            if time.perf_counter() > deadline:
                timed_out = True
                break
        if timed_out:
            _stop(proc)
        try:
            code = proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            _stop(proc)
            code, timed_out = proc.wait(), True
    wall = time.perf_counter() - start
    if timed_out:
        with open(log_path, "a") as log:
            log.write(f"ddtrain bench scaling: cell stopped after --cell-timeout {config.cell_timeout_s:g} s\n")
    return {"exit_code": code, "timed_out": timed_out, "wall_s": wall, "log": str(log_path)}


def loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM then SIGKILL to the cell's own process group (its launcher and ranks)."""
    import signal
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue
