#!/bin/bash
# MPICH's Hydra. One host: every rank on 127.0.0.1, nothing to set.
#   mpiexec -n 2 python examples/minimal.py
# Several hosts: rank 0's host is the master; -genv passes it (and a port of your choice) to every rank.
set -euo pipefail
mpiexec -f examples/mpi/hosts -n 4 -genv MASTER_ADDR node01 -genv MASTER_PORT 29511 \
        python examples/minimal.py --epochs 2
mpiexec -f examples/mpi/hosts -n 4 -genv MASTER_ADDR node01 -genv MASTER_PORT 29512 \
        ddtrain train --model mlp --data digits --epochs 2
