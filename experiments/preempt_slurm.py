"""Issue 28, acceptance 2: an ``sbatch --signal=[B:]USR1@N --requeue`` job preempted mid-run is requeued and
finishes with the parameters of an uninterrupted run. Runs on the head node of the emulated SLURM (needs root):

    sudo PYTHONPATH=src ddtrain cluster run --nodes 2 --link 1gbit --slurm -- \
        python3 experiments/preempt_slurm.py OUT_DIR [--srun] [--signal-at-step 40]

It writes OUT_DIR/job.sbatch, submits it, and once the job has logged step ``--signal-at-step`` sends what
SLURM's ``--signal`` sends N seconds before a time limit:

* default: ``#SBATCH --signal=B:USR1@60`` and ``exec ddtrain train --nproc 2 ...`` in the batch script, so the
  batch shell is ddtrain's launcher; ``B:`` signals the batch shell only (``scancel --batch --signal=USR1``),
  and the launcher passes USR1 on to its 2 workers;
* ``--srun``: ``#SBATCH --signal=USR1@60`` and ``srun ddtrain train ...`` on 2 nodes, one rank per task; without
  ``B:`` SLURM signals every task of every step but not the batch shell (``scancel --signal=USR1``), so each
  rank gets USR1 itself and rank 0 requeues the job.

Both train with ``--checkpoint-dir OUT_DIR/ck --preempt-signal USR1 --requeue --save OUT_DIR/final.pt``. The
driver follows the job (``scontrol show job``) until it completes and prints the transcript: the commands,
every state the job went through, and the job's output (both runs; ``--open-mode=append``). Compare
OUT_DIR/final.pt with ``ddtrain train --nproc 2 <the same flags> --save ref.pt`` (tests/integration/
test_cluster_slurm_preemption.py does). Exit status 0 when the job completed after at least one requeue.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time

# The training of the job (and of the reference run): 2 workers, 2 epochs of digits, no periodic checkpoint due.
TRAIN = ["--model", "simple-cnn", "--data", "digits", "--epochs", "3", "--batch-size", "16", "--lr", "0.05",
         "--momentum", "0.9", "--seed", "1", "--lr-schedule", "cosine", "--warmup-steps", "5"]
DEADLINE_S = 600.0


def job_script(out: str, srun: bool) -> str:
    train = " ".join(shlex.quote(a) for a in [
        sys.executable, "-m", "ddtrain", "train", *([] if srun else ["--nproc", "2"]), *TRAIN,
        "--checkpoint-dir", f"{out}/ck", "--checkpoint-every", "100000", "--preempt-signal", "USR1", "--requeue",
        "--log-every", "20", "--save", f"{out}/final.pt"])
    shape, signal, run = ("-N 2 --ntasks-per-node 1 -c 1", "USR1@60", f"srun {train}") if srun else \
        ("-N 1 -n 1 -c 2", "B:USR1@60", f"exec {train}")
    return f"""#!/bin/sh
#SBATCH {shape}
#SBATCH --signal={signal}
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH -o {out}/job.out
echo "== job $SLURM_JOB_ID on $(hostname), SLURM_RESTART_COUNT=${{SLURM_RESTART_COUNT:-0}}"
export OMP_NUM_THREADS=1
{run}
"""


def say(line: str) -> None:
    print(line, flush=True)


def run(argv: list[str]) -> str:
    say("$ " + " ".join(shlex.quote(a) for a in argv))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    text = (done.stdout + done.stderr).strip()
    if text:
        say(text)
    if done.returncode != 0:
        raise SystemExit(f"failed with exit status {done.returncode}")
    return done.stdout.strip()


def job_fields(job: str) -> dict:
    done = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=60)
    return dict(item.split("=", 1) for item in done.stdout.split() if "=" in item)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="a new folder for the job's script, output, checkpoints and final model")
    # Early in the 135-step run: the driver polls the log every 0.5 s and a 45-step epoch takes about a second on
    # an idle 2-core machine, so a signal sent at step 120 reached a CI run after its last step (the job then
    # ended on the late signal instead of a preemption: results/ci, the run of 2026-11-26).
    parser.add_argument("--signal-at-step", type=int, default=40)
    parser.add_argument("--srun", action="store_true", help="one rank per srun task, signalled without B:")
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    script = job_script(out, args.srun)
    with open(f"{out}/job.sbatch", "w") as f:
        f.write(script)
    say(f"# {out}/job.sbatch:")
    for line in script.splitlines():
        say(f"#   {line}")
    job = run(["sbatch", "--parsable", f"{out}/job.sbatch"]).split(";")[0]
    start, log, signalled = time.monotonic(), f"{out}/job.out", None
    states, last = [], None
    while time.monotonic() - start < DEADLINE_S:
        fields = job_fields(job)
        now = (fields.get("JobState"), fields.get("Restarts"), fields.get("NodeList"), fields.get("Reason"))
        if now != last:
            states.append(now)
            say(f"[{time.monotonic() - start:6.1f} s] JobState={now[0]} Restarts={now[1]} NodeList={now[2]} "
                f"Reason={now[3]}")
            last = now
        # slurmctld holds a requeued batch job back (its BeginTime, about two minutes) before it may start again.
        # This driver used to let it go at once (scontrol update StartTime=now), as an administrator may; in two
        # loaded CI runs the job so released failed at once without running its script, while the nodes were
        # still tearing down the first run's step (2026-11-28), so the requeue now takes SLURM's own time.
        if signalled is None and os.path.exists(log):
            with open(log) as f:
                text = f.read()
            if f"step {args.signal_at_step} " in text:
                signalled = time.monotonic()
                what = "--signal=USR1 sends (every task, not the batch shell)" if args.srun else \
                    "--signal=B:USR1 sends (the batch shell only)"
                say(f"[{signalled - start:6.1f} s] the job logged step {args.signal_at_step}: sending what {what}")
                run(["scancel", "--signal=USR1", job] if args.srun else ["scancel", "--batch", "--signal=USR1", job])
        if now[0] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        time.sleep(0.5)
    say(f"# {log}:")
    with open(log) as f:
        for line in f.read().splitlines():
            say(f"    {line}")
    final = states[-1] if states else (None, None, None, None)
    ok = final[0] == "COMPLETED" and final[1] not in (None, "0") and os.path.exists(f"{out}/final.pt")
    say(f"# job {job}: {final[0]} after {final[1]} requeue(s); {out}/final.pt "
        f"{'written' if os.path.exists(f'{out}/final.pt') else 'missing'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
