"""ddtrain.comm_hook on a user's own DDP, under real torchrun (3 Gloo ranks), against plain DDP.

The reference is torch's DistributedDataParallel with its own all-reduce, trained in the same
processes from the same initial parameters on the same per-rank batches.
"""
import json
import subprocess
import sys
import textwrap

import pytest

import ddtrain
from ddtrain.errors import ConfigError, DDTrainError
from tests.helpers import REPO
from tests.multirank import free_port

SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    import ddtrain

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def model_():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(20, 33), torch.nn.Tanh(), torch.nn.Linear(33, 7))

    def batches(steps):
        g = torch.Generator().manual_seed(100 + rank)     # each rank its own data
        w = torch.randn(20, 7, generator=torch.Generator().manual_seed(5))
        out = []
        for _ in range(steps):
            x = torch.randn(16, 20, generator=g)
            out.append((x, (x @ w).argmax(1)))
        return out

    def train(steps, algorithm=None, compression=None, state=None, model=None, optimizer=None, start=0):
        model = model or model_()
        ddp = DDP(model, bucket_cap_mb=0.001)   # several buckets
        hook_state = None
        if algorithm is not None:
            hook_state, hook = ddtrain.comm_hook(algorithm, compression, model=model)
            if state is not None:
                hook_state.load_state_dict(state)
            ddp.register_comm_hook(hook_state, hook)
        optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        losses = []
        for x, y in batches(start + steps)[start:]:
            loss = F.cross_entropy(ddp(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return model, optimizer, hook_state, losses

    def flat(model):
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def replicas_equal(vector):
        gathered = [torch.empty_like(vector) for _ in range(world)]
        dist.all_gather(gathered, vector)
        return all(torch.equal(gathered[0], g) for g in gathered)

    result = {}
    reference = flat(train(8)[0])
    for algorithm in ("ring", "tree", "butterfly"):
        got = flat(train(8, algorithm)[0])
        result[algorithm] = {"max_abs_diff": (got - reference).abs().max().item(), "replicas_equal": replicas_equal(got)}
    model, _, _, losses = train(40, "ring", "powersgd:2")
    result["powersgd:2"] = {"replicas_equal": replicas_equal(flat(model)), "first_loss": losses[0],
                            "last_loss": sum(losses[-5:]) / 5}
    # checkpointable: 3 steps, save model, optimizer and hook state, resume in a new DDP with a new hook
    # (2 warm-up steps, so the compressor has error feedback and Q to save after step 3)
    whole = flat(train(6, "ring", "powersgd:2:2")[0])
    model, optimizer, hook_state, _ = train(3, "ring", "powersgd:2:2")
    saved = hook_state.state_dict()
    resumed = flat(train(3, "ring", "powersgd:2:2", state=saved, model=model, optimizer=optimizer, start=3)[0])
    result["resume"] = {"saved_error_tensors": len(saved["state"].get("error", {})),
                        "equal": torch.equal(whole, resumed), "max_abs_diff": (whole - resumed).abs().max().item()}
    # the saved state matters: the same 3 steps from the same parameters without it differ
    model, optimizer, _, _ = train(3, "ring", "powersgd:2:2")
    afresh = flat(train(3, "ring", "powersgd:2:2", model=model, optimizer=optimizer, start=3)[0])
    result["resume"]["without_state_differs"] = not torch.equal(whole, afresh)
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()
''')


@pytest.mark.slow
def test_comm_hook_under_torchrun_equals_plain_ddp(tmp_path):
    script, out = tmp_path / "hooked.py", tmp_path / "result.json"
    script.write_text(SCRIPT)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
                          "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), str(out)],
                         capture_output=True, text=True, timeout=300, env={**_env(), "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    print(json.dumps(result, indent=1))
    for algorithm in ("ring", "tree", "butterfly"):
        assert result[algorithm]["replicas_equal"], algorithm
        assert result[algorithm]["max_abs_diff"] <= 1e-5, (algorithm, result[algorithm])
    compressed = result["powersgd:2"]
    assert compressed["replicas_equal"]
    assert compressed["last_loss"] < 0.7 * compressed["first_loss"], compressed
    assert result["resume"]["saved_error_tensors"] > 0
    assert result["resume"]["equal"], result["resume"]
    assert result["resume"]["without_state_differs"]


def _env():
    import os
    return {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_comm_hook_refuses_unknown_names_naming_the_field():
    with pytest.raises(ConfigError, match="algorithm 'rnig' is not one of: .*butterfly.*ring"):
        ddtrain.comm_hook("rnig")
    with pytest.raises(ConfigError, match="compression .*powersgd"):
        ddtrain.comm_hook("ring", "powersgd:zero")


def test_comm_hook_state_refuses_another_compressors_state():
    import torch
    model = torch.nn.Linear(4, 3)
    state, _ = ddtrain.comm_hook("ring", "topk:0.5", model=model)
    other, _ = ddtrain.comm_hook("ring", "powersgd:1", model=model)
    with pytest.raises(DDTrainError, match="compression topk:0.5 is not restored"):
        other.load_state_dict(state.state_dict() | {"compression": "topk:0.5", "state": {}})
    other.load_state_dict({"compression": "topk:0.5", "state": {}}, strict=False)   # accepted: starts afresh
