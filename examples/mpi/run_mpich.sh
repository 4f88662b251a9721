#!/bin/bash
# MPICH's Hydra, named explicitly: a bare `mpiexec` is Open MPI's once both are installed (Debian's
# alternatives), which refuses `-f` ("unknown option") and, as root, runs nothing.
#   examples/mpi/run_mpich.sh                                   # one host: 2 ranks on 127.0.0.1
#   HOSTS=examples/mpi/hosts NPROC=4 MASTER_ADDR=node01 examples/mpi/run_mpich.sh   # several hosts
# Several hosts: rank 0's host is the master; -genv passes it (and a port of your choice) to every rank.
set -euo pipefail
mpiexec=$(command -v mpiexec.mpich || command -v mpiexec.hydra) || {
    echo "run_mpich.sh: MPICH's mpiexec.mpich (or mpiexec.hydra) is not installed (apt-get install mpich)" >&2
    exit 2; }
hosts=()
if [ -n "${HOSTS:-}" ]; then hosts=(-f "$HOSTS"); fi
"$mpiexec" "${hosts[@]}" -n "${NPROC:-2}" -genv MASTER_ADDR "${MASTER_ADDR:-127.0.0.1}" -genv MASTER_PORT 29511 \
        python examples/minimal.py --epochs 2
"$mpiexec" "${hosts[@]}" -n "${NPROC:-2}" -genv MASTER_ADDR "${MASTER_ADDR:-127.0.0.1}" -genv MASTER_PORT 29512 \
        ddtrain train --model mlp --data digits --epochs 2
