"""``ddtrain model flops``: parameters and counted forward FLOPs per sample of the model zoo."""
from __future__ import annotations

from ddtrain.errors import DDTrainError


def add_arguments(parser) -> None:
    parser.add_argument("models", nargs="*", help="model names (default: every model)")
    parser.add_argument("--input", metavar="CxHxW", help="input shape instead of each "
                        "model's reference input, e.g. 3x128x128")
    parser.add_argument("--classes", type=int, help="number of classes instead of the "
                        "reference one")


def main(args) -> int:
    shape = None
    if args.input:
        try:
            shape = tuple(int(v) for v in args.input.lower().split("x"))
            assert len(shape) == 3 and min(shape) > 0
        except (ValueError, AssertionError):
            raise DDTrainError(f"--input must look like 3x128x128, got {args.input!r}") from None
    from ddtrain.models.flops import format_table, reference_table   # here: --help answers without torch
    print(format_table(reference_table(args.models, shape, args.classes)))
    return 0
