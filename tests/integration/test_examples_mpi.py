"""The MPI examples as written (issue 32: examples/mpi/run_mpich.sh and docs/LAUNCHERS.md called a bare
``mpiexec``, which is Open MPI's once both are installed: ``unknown option -f``, or Open MPI's root refusal).
Each script runs on one host when its launcher is installed (it is in CI and on the project's machine)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from helpers import REPO

SCRIPTS = {"run_mpich.sh": ("mpiexec.mpich", "mpiexec.hydra"), "run_openmpi.sh": ("mpirun.openmpi",)}
BARE = re.compile(r"(^|[\s;(|&`$])(mpiexec|mpirun)(\s|$)")


def test_no_example_nor_the_launchers_page_calls_a_bare_mpiexec_or_mpirun():
    pages = [REPO / "examples" / "mpi" / name for name in SCRIPTS] + [REPO / "docs" / "LAUNCHERS.md",
                                                                    REPO / "examples" / "minimal.py"]
    for page in pages:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            assert not BARE.search(line.replace("`mpiexec`", "").replace("`mpirun`", "")), f"{page}:{number}: {line}"


@pytest.mark.slow
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_the_mpi_example_runs_as_written_on_one_host(script):
    if not any(shutil.which(name) for name in SCRIPTS[script]):
        pytest.skip(f"{' or '.join(SCRIPTS[script])} is not installed")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", "DDTRAIN_TIMEOUT_S": "120"}
    if os.geteuid() == 0:   # what the script's header says Open MPI needs as root
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    result = subprocess.run(["bash", f"examples/mpi/{script}"], capture_output=True, text=True, timeout=500,
                            env=env, cwd=REPO)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "epoch 2: loss" in result.stdout and "(world size 2)" in result.stdout, result.stdout[-2000:]
    if script == "run_mpich.sh":   # then ddtrain train as 2 ranks
        assert "Epoch 2/2" in result.stdout, result.stdout[-2000:]
