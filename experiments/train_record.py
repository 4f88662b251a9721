"""One ``ddtrain train`` command run to its end, for the benchmark scripts: its --out record and wall time."""
from __future__ import annotations

import json
import shlex
import subprocess
import time
from pathlib import Path


def train(command: list[str], timeout_s: float) -> tuple[dict, float]:
    """Run one command that writes a record to its --out; (the record, wall seconds). A failure stops the script."""
    out = command[command.index("--out") + 1]
    start = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    wall = time.monotonic() - start
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}): {shlex.join(command)}\n{done.stderr[-3000:]}")
    return json.loads(Path(out).read_text()), wall


def write_result(result: dict, out: str) -> None:
    """Write a benchmark's result as JSON to ``out`` with the machine it ran on (uname, CPUs this process may use)."""
    import os
    result["machine"] = subprocess.run(["uname", "-srm"], capture_output=True, text=True).stdout.strip()
    result["cpus"] = len(os.sched_getaffinity(0))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"# wrote {out}")
