"""By hand (results/elastic-membership/join.txt): ddtrain train --nnodes 2:3 launchers in 3 emulated nodes; started on
nodes 0 and 1, node 2's launcher started once ckpt-20 exists. Usage: sudo python3 join_by_hand.py OUTDIR STEPS"""
import os, sys, subprocess, time, json
sys.path.insert(0, "/work/main/tests")
from pathlib import Path
from ddtrain.cluster import emulated_cluster, netns
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
STEPS = sys.argv[2] if len(sys.argv) > 2 else "600"
def argv(node):
    return ["nsenter", f"--net=/run/netns/{node.namespace}", sys.executable, "-m", "ddtrain", "train", "--model", "mlp",
            "--data", "digits", "--steps", STEPS, "--global-batch-size", "48", "--lr", "0.05", "--momentum", "0.9",
            "--seed", "1", "--checkpoint-every", "20", "--checkpoint-dir", str(out / "ck"), "--save", str(out / "m.pt"),
            "--out", str(out / "run.json"), "--nproc", "1", "--nnodes", "2:3", "--rdzv-endpoint", "198.18.0.1:29400",
            "--max-restarts", "2", "--quiet"]
def env(node):
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    e.update(OMP_NUM_THREADS="1", DDTRAIN_TIMEOUT_S="60", GLOO_SOCKET_IFNAME=node.interface, DDTRAIN_CLUSTER_NODE=str(node.index))
    return e
t0 = time.time()
with emulated_cluster(3, "1gbit") as cluster:
    logs = [open(out / f"n{i}.log", "w") for i in range(3)]
    procs = [subprocess.Popen(argv(n), env=env(n), stdout=logs[n.index], stderr=subprocess.STDOUT, start_new_session=True)
             for n in cluster.nodes[:2]]
    ck = out / "ck" / "ckpt-00000020.pt"
    while not ck.exists() and time.time() - t0 < 150: time.sleep(0.1)
    print(f"ckpt-20 at {time.time()-t0:.1f}s; node 2 joins", flush=True)
    n2 = cluster.nodes[2]
    procs.append(subprocess.Popen(argv(n2), env=env(n2), stdout=logs[2], stderr=subprocess.STDOUT, start_new_session=True))
    codes = [p.wait(timeout=300) for p in procs]
    for n in cluster.nodes: netns.kill_namespace_processes(n.namespace)
print("codes", codes, f"wall {time.time()-t0:.1f}")
for i in range(3): print(f"--- n{i}\n" + (out / f"n{i}.log").read_text()[-1500:])
print(json.dumps(json.load(open(out / "run.json"))["membership"], indent=0))
