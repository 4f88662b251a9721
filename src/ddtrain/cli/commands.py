"""The table of ``ddtrain``'s commands (``COMMANDS``) and the parser each starts from (``new_parser``).

Apart from ``ddtrain.cli`` so that ``cli.quick_help`` reads it without importing the entry point.
"""
from __future__ import annotations

import argparse

# command words -> (module, one-line help). One line per subcommand.
COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("demo",): ("ddtrain.cli.demo", "train simple-cnn on the bundled digits with 1, 2 and 4 workers and compare"),
    ("train",): ("ddtrain.cli.train", "train a model data-parallel (locally with --nproc, or under torchrun/srun/mpirun)"),
    ("run",): ("ddtrain.cli.run", "start workers running any script through torchrun: N or MIN:MAX (elastic), "
               "on one node or several (the counterpart of torchrun, no root)"),
    ("model", "comm"): ("ddtrain.cli.model_comm", "communications per epoch of centralized, decentralized and "
                        "000's method (Table 5.1)"),
    ("model", "flops"): ("ddtrain.cli.model_flops", "parameters and counted forward FLOPs per sample of the model zoo"),
    ("bench", "collectives"): ("ddtrain.cli.bench_collectives", "time every all-reduce algorithm over a range of "
                               "sizes against the alpha-beta model (nccl-tests style)"),
    ("bench", "scaling"): ("ddtrain.cli.bench_scaling", "throughput, speed-up and step split of strategies x "
                           "workers (x batch, loader, amp), one launch per cell"),
    ("bench", "data"): ("ddtrain.cli.bench_data", "the input pipeline alone (read, decode, augment, batch, copy to "
                        "the device) in images/s: is a run data-bound?"),
    ("data", "pack"): ("ddtrain.cli.data_pack", "pack an image folder into a few large checksummed shard files "
                       "(pre-resized uint8 or JPEG) for --data packed:DIR"),
    ("report",): ("ddtrain.cli.report", "turn a results folder (train or bench) into report.md and a "
                  "self-contained report.html with plots"),
    ("cluster", "run"): ("ddtrain.cli.cluster_run", "run a ddtrain command on N emulated nodes (network "
                         "namespaces) joined by rate-limited links"),
    ("cluster", "probe"): ("ddtrain.cli.cluster_probe", "point-to-point rate between the ranks of an emulated "
                           "cluster (inside cluster run)"),
    ("doctor",): ("ddtrain.cli.doctor", "compare versions, GPUs, interfaces and data across the ranks of a job and "
                  "probe every link"),
    ("advise",): ("ddtrain.cli.advise", "predict the step time and bytes of every strategy x compression x "
                  "algorithm on a link, rank them, pick one"),
    ("checkpoint", "info"): ("ddtrain.cli.checkpoint_info", "a checkpoint's step, configuration, size, the worker "
                             "counts it resumes on, and its integrity"),
    ("cluster", "clean"): ("ddtrain.cli.cluster_clean", "remove emulated-cluster namespaces left behind by crashed "
                           "or --keep runs"),
}


def new_parser(words, help_: str) -> argparse.ArgumentParser:
    """The parser of command ``words`` before its module adds its flags."""
    return argparse.ArgumentParser(prog="ddtrain " + " ".join(words), description=help_,
                                   formatter_class=argparse.ArgumentDefaultsHelpFormatter)
