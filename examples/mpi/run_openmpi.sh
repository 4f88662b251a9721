#!/bin/bash
# Open MPI. One host: mpirun -n 2 python examples/minimal.py (as root also --allow-run-as-root).
# --bind-to none: Open MPI would pin each rank to one core, and torch's threads with it.
# Several hosts: rank 0's host is the master; -x passes it to every rank. The port comes from the job id.
set -euo pipefail
mpirun --hostfile examples/mpi/hostfile -n 4 --bind-to none -x MASTER_ADDR=node01 -x PATH -x PYTHONPATH \
       python examples/minimal.py --epochs 2
