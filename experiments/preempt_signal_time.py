"""Issue 28: the time from a SIGTERM to ``ddtrain train --nproc 2``'s launcher to the checkpoint on disk, ResNet-50 size.

    PYTHONPATH=src python3 experiments/preempt_signal_time.py /tmp/preempt-r50 > results/preemption/sigterm_resnet50_nproc2.txt

Two workers train ddtrain's ResNet-50 (1000 classes: 25.6 M parameters, a 205 MB checkpoint with SGD's
momentum) on 3x32x32 synthetic inputs; 0.3 s after rank 0 logged step 5 the launcher gets SIGTERM, as a
scheduler sends it. The launcher's last line says which step every worker finished and how many seconds after
the signal the checkpoint was on disk (the rest of the step in flight, the agreement, the save and its write).
"""
import os
import signal
import subprocess
import sys
import time

folder = sys.argv[1] if len(sys.argv) > 1 else "/tmp/preempt-r50"
os.makedirs(folder, exist_ok=True)
cmd = [sys.executable, "-m", "ddtrain", "train", "--nproc", "2", "--model", "resnet50", "--data", "synthetic:cifar10",
       "--data-arg", "samples=200", "--data-arg", "classes=1000", "--batch-size", "2", "--epochs", "1", "--lr", "0.01",
       "--momentum", "0.9", "--seed", "0", "--checkpoint-dir", f"{folder}/ck", "--checkpoint-every", "100000",
       "--log-every", "1"]
print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
      f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}, {os.cpu_count()} CPUs")
print("$ OMP_NUM_THREADS=1 ddtrain " + " ".join(cmd[3:]), flush=True)
job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
for line in job.stdout:
    print(line.rstrip(), flush=True)
    if line.strip().startswith("step 5 "):
        break
time.sleep(0.3)
print(f"# {time.strftime('%H:%M:%S')}: kill -TERM <launcher> (0.3 s after rank 0 logged step 5)", flush=True)
os.kill(job.pid, signal.SIGTERM)
out, err = job.communicate(timeout=600)
print(out.rstrip())
print(err.rstrip())
print(f"# exit status: {job.returncode}")
print(f"$ ls -l {folder}/ck")
print(subprocess.run(["ls", "-l", f"{folder}/ck"], capture_output=True, text=True).stdout.rstrip())
