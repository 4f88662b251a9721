"""Issue 29 item 1: ps-async workers evaluating together every 4 steps, run N times; how many finish.

    PYTHONPATH=<a checkout before issue 29>/src python3 experiments/ps_async_eval_before.py 5
    PYTHONPATH=src python3 experiments/ps_async_eval_before.py 20

The run is tests/sync/test_ps_script_collectives.py's ``evaluate_every`` (3 Gloo ranks: 2 workers,
1 server; staleness 1; worker 1 slower; the servers' timeout 4 s, so a deadlock ends in seconds).
Before the fix the faster worker waited in the evaluation's collective while the server held the
other's gradient for its own: each hung run ends with the server naming "worker rank 0".
"""
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "sync")]

from multirank import run_ranks  # noqa: E402
import test_ps_script_collectives as script  # noqa: E402


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    finished = 0
    for seed in range(runs):
        start = time.monotonic()
        try:
            run_ranks(script.evaluate_every, 3, 4, 1, seed, timeout_s=60)
            finished += 1
            outcome = "finished"
        except Exception as exc:            # the first line of what the ranks reported
            outcome = "failed: " + str(exc).splitlines()[0][:300]
        print(f"run {seed}: {time.monotonic() - start:.1f} s, {outcome}", flush=True)
    print(f"{finished} of {runs} runs finished")


if __name__ == "__main__":
    main()
