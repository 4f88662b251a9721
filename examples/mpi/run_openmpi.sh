#!/bin/bash
# Open MPI, named explicitly (mpirun.openmpi): a bare `mpirun` may be MPICH's once both are installed.
#   examples/mpi/run_openmpi.sh                                 # one host: 2 ranks
#   HOSTFILE=examples/mpi/hostfile NPROC=4 MASTER_ADDR=node01 examples/mpi/run_openmpi.sh   # several hosts
# As root Open MPI also wants OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (or --allow-run-as-root).
# --bind-to none: Open MPI would pin each rank to one core, and torch's threads with it.
# Several hosts: rank 0's host is the master; -x passes it to every rank. The port comes from the job id.
set -euo pipefail
command -v mpirun.openmpi >/dev/null || {
    echo "run_openmpi.sh: Open MPI's mpirun.openmpi is not installed (apt-get install openmpi-bin)" >&2; exit 2; }
hosts=()
if [ -n "${HOSTFILE:-}" ]; then hosts=(--hostfile "$HOSTFILE"); fi
mpirun.openmpi "${hosts[@]}" -n "${NPROC:-2}" --bind-to none -x MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}" -x PATH \
       -x PYTHONPATH python examples/minimal.py --epochs 2
