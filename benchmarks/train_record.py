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
