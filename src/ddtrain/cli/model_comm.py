"""``ddtrain model comm``: document 000's communications per epoch (Table 5.1) for any grid.

    ddtrain model comm                                   # the document's own 49 rows
    ddtrain model comm --params 1,4,8 --workers 2,4,8 --steps-per-epoch 10
    ddtrain model comm --params 25613800 --workers 2,4,8 --json

Pure arithmetic (no processes, no torch import): the counts are exact fractions, printed as
the document prints them. docs/PERFORMANCE.md defines every column.
"""
from __future__ import annotations

import json

from ddtrain.errors import DDTrainError

DOCUMENT_PARAMS = "1,4,8,50,100,500,1000"    # N of Table 5.1
DOCUMENT_WORKERS = "2,4,8,50,100,500,1000"   # R of Table 5.1
DOCUMENT_STEPS = 10                          # E of Table 5.1

FORMULAS = {
    "centralized": "2·E·N·(R−1)",
    "decentralized": "2·E·(N/R)·(R−1)",
    "proposed": "2·E·(N/R)·(R−1) + B·N·(R−1)",
}


def add_arguments(parser) -> None:
    parser.add_argument("--params", default=DOCUMENT_PARAMS, metavar="N[,N...]",
                        help="model sizes N, in parameters (elements), comma-separated")
    parser.add_argument("--workers", default=DOCUMENT_WORKERS, metavar="R[,R...]",
                        help="numbers of workers R, comma-separated")
    parser.add_argument("--steps-per-epoch", type=int, default=DOCUMENT_STEPS, metavar="E",
                        help="training steps (mini-batches) per epoch E")
    parser.add_argument("--broadcasts-per-epoch", type=int, default=1, metavar="B",
                        help="parameter broadcasts per epoch in the proposed method (000 used 1; "
                             "a broadcast every K steps gives E/K)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")


def parse_int_list(text: str, flag: str, minimum: int) -> list[int]:
    """``"1,4,8"`` -> ``[1, 4, 8]``, each at least ``minimum``; a clear error otherwise."""
    values = []
    for item in text.split(","):
        item = item.strip().replace("_", "")
        try:
            value = int(item)
        except ValueError:
            raise DDTrainError(f"{flag}: {item!r} is not a whole number (expected e.g. 1,4,8)") from None
        if value < minimum:
            raise DDTrainError(f"{flag}: every value must be >= {minimum}, got {value}")
        values.append(value)
    return values


def render_table(rows, steps_per_epoch: int, broadcasts_per_epoch: int) -> str:
    """Fixed-width table, '#' before every line that is not data (like nccl-tests)."""
    from ddtrain.costmodel.counts import METHODS, format_count   # here: the costmodel package imports torch
    header = ("N", "R", *METHODS)
    units = ("(elements)", "(workers)", *["(values sent)"] * len(METHODS))
    cells = [(str(r.params), str(r.workers), *(format_count(getattr(r, m)) for m in METHODS)) for r in rows]
    widths = [max(len(header[i]), len(units[i]), *(len(c[i]) for c in cells)) for i in range(len(header))]

    def line(values, lead):
        return lead + "  ".join(v.rjust(w) for v, w in zip(values, widths))

    out = [f"# Communications per epoch between workers (document 000, Table 5.1), "
           f"E = {steps_per_epoch} steps per epoch, B = {broadcasts_per_epoch} broadcast(s) per epoch",
           *[f"#   {m:<13} = {FORMULAS[m]}" for m in METHODS],
           "#", line(header, "# "), line(units, "# ")]
    out += [line(c, "  ") for c in cells]
    return "\n".join(out)


def main(args) -> int:
    params = parse_int_list(args.params, "--params", 0)
    workers = parse_int_list(args.workers, "--workers", 1)
    if args.steps_per_epoch < 0:
        raise DDTrainError(f"--steps-per-epoch must be >= 0, got {args.steps_per_epoch}")
    if args.broadcasts_per_epoch < 0:
        raise DDTrainError(f"--broadcasts-per-epoch must be >= 0, got {args.broadcasts_per_epoch}")
    from ddtrain.costmodel.counts import count_table   # here, not at the top: --help answers without torch
    rows = count_table(params, workers, args.steps_per_epoch, args.broadcasts_per_epoch)
    if args.json:
        print(json.dumps({"steps_per_epoch": args.steps_per_epoch,
                          "broadcasts_per_epoch": args.broadcasts_per_epoch,
                          "unit": "values sent between workers per epoch",
                          "formulas": FORMULAS,
                          "rows": [r.as_dict() for r in rows]}, indent=2))
    else:
        print(render_table(rows, args.steps_per_epoch, args.broadcasts_per_epoch))
    return 0
