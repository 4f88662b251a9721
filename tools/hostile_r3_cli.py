"""Issue 32's hostile cases of the command line and a newcomer's first run (round 3, the CLI helper's rows).

    python3 tools/hostile_cases.py ...   (the lead wires ``cases()`` into the table)

Each row: the adviser's inputs (rows, bandwidth, size, output file), a superscript digit in an
integer flag, ``--help`` without torch, the report of the demo's records, and a SLURM job that
can never start. docs/RELIABILITY.md "Round 3 (issue 32): the command line and a newcomer's
first run" shows what each prints.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from hostile_cases import REPO, Case, _report_folder

ADVISE = ["advise", "--params", "1000000", "--workers", "4", "--step-time", "0.4", "--compressions", "none,fp16",
          "--sync-every", "4"]
LINK = ["--link-rate", "1gbit"]
T_CLI = "tests/cli/test_advise_cli.py"


def near_zero_link(T: Path) -> None:
    """A calibration of a link of 8e-300 bit/s (beta 1e300 s per byte)."""
    (T / "dead_link.json").write_text(json.dumps({"alpha_s": 1e-4, "beta_s_per_byte": 1e300}))


def existing_advice(T: Path) -> None:
    (T / "advice.json").write_text("my notes\n")


def demo_records(T: Path) -> None:
    """A folder as `ddtrain demo --workers 1,2` leaves it: one record per worker count, nothing else."""
    _report_folder(T, "demo", "good")
    record = json.loads((T / "demo" / "workers1.json").read_text())
    record.update(workers=2, world_size=2)
    (T / "demo" / "workers2.json").write_text(json.dumps(record))


def cases() -> list:
    return [
        Case("advise", "--top -1 (was: every row but the last)", [*ADVISE, *LINK, "--top", "-1"], "refused",
             f"{T_CLI}::test_bad_input_is_one_clear_error", limit_s=120),
        Case("advise", "--top 0", [*ADVISE, *LINK, "--top", "0"], "refused",
             f"{T_CLI}::test_bad_input_is_one_clear_error", limit_s=120),
        Case("advise", "a near-zero bandwidth (calibration beta 1e300 s/B; was: inf ms per step and a first choice)",
             [*ADVISE, "--calibration", "{T}/dead_link.json"], "refused",
             f"{T_CLI}::test_a_near_zero_bandwidth_calibration_is_refused",
             before=near_zero_link, limit_s=120),
        Case("advise", "--latency 1e300 (was: a first choice predicted at 3e299 ms)", [*ADVISE, *LINK, "--latency",
             "1e300"], "refused", f"{T_CLI}::test_bad_input_is_one_clear_error", limit_s=120),
        Case("advise", "--params 1e12 (was: tried to allocate 4 TB)", ["advise", "--params", "1e12", "--workers", "4",
             "--step-time", "0.4", "--compressions", "none,fp16", "--sync-every", "4", *LINK], "ok",
             f"{T_CLI}::test_a_trillion_parameters_are_predicted_without_allocating_them", limit_s=180,
             look_for="first choice"),
        Case("advise", "--params 1e15 (past any model)", ["advise", "--params", "1e15", "--workers", "4",
             "--step-time", "0.4", *LINK], "refused", f"{T_CLI}::test_bad_input_is_one_clear_error", limit_s=120),
        Case("advise", "--json onto an existing file (was: replaced without a word)",
             [*ADVISE, *LINK, "--json", "{T}/advice.json"], "refused",
             f"{T_CLI}::test_the_json_output_is_checked_before_anything_runs", before=existing_advice, limit_s=120),
        Case("advise", "--json naming a directory (was: IsADirectoryError)", [*ADVISE, *LINK, "--json", "{T}"],
             "refused", f"{T_CLI}::test_the_json_output_is_checked_before_anything_runs", limit_s=120),
        Case("advise", "--json under a file (was: NotADirectoryError)",
             [*ADVISE, *LINK, "--json", "{T}/advice.json/out.json"], "refused",
             f"{T_CLI}::test_the_json_output_is_checked_before_anything_runs", before=existing_advice, limit_s=120),
        Case("flags", "--nproc ² (was: ValueError: invalid literal for int())",
             ["train", "--model", "mlp", "--data", "digits", "--nproc", "²"], "refused",
             "tests/cli/test_integer_flags.py::test_a_superscript_digit_is_one_line_naming_the_flag", limit_s=120),
        Case("flags", "--nnodes 1:²", ["train", "--model", "mlp", "--data", "digits", "--nnodes", "1:²"], "refused",
             "tests/cli/test_integer_flags.py::test_a_superscript_digit_is_one_line_naming_the_flag", limit_s=120),
        Case("flags", "bench scaling --sync-every ² (was: ValueError)",
             ["bench", "scaling", "--out", "{T}/bench", "--sync-every", "²"], "refused",
             "tests/cli/test_integer_flags.py::test_a_superscript_digit_is_one_line_naming_the_flag", limit_s=120),
        Case("flags", "run --nproc ²", ["run", "--nproc", "²", "script.py"], "refused",
             "tests/cli/test_integer_flags.py::test_a_superscript_digit_is_one_line_naming_the_flag", limit_s=120),
        Case("newcomer", "train --help (was: 3.7-7.8 s importing torch; no model nor strategy named)",
             ["train", "--help"], "ok", "tests/cli/test_quick_help.py::test_help_of_every_command_imports_no_torch",
             limit_s=60, look_for="one of: mlp,"),
        Case("newcomer", "report on the demo's records (was: 0 figures, no word why)", ["report", "{T}/demo"], "ok",
             "tests/report/test_report_hostile.py::test_the_demos_folder_gets_the_figures_its_records_allow_and_is_"
             "told_which_not", before=demo_records, limit_s=240, look_for="not drawn:"),
        Case("newcomer", "an sbatch asking 8 CPUs per task of 4-CPU emulated nodes (was: an hour of silence)",
             ["cluster", "run", "--nodes", "2", "--link", "1gbit", "--slurm", "--", "sbatch", "--wait",
              "--cpus-per-task", "8", "-o", "{T}/job.out", str(REPO / "examples/slurm/one_torchrun_per_node_cpu.sbatch")],
             "refused", "tests/integration/test_cluster_slurm_pending.py::test_a_job_too_large_for_the_nodes_is_"
             "cancelled_with_its_reason", limit_s=180),
    ]
