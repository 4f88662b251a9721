"""``ddtrain report DIR``: its flags; the report itself is ``ddtrain.report``."""
from __future__ import annotations

import sys
from pathlib import Path



def add_arguments(p) -> None:
    p.add_argument("dir", help="results folder (from ddtrain bench scaling, bench collectives --json, train --out)")
    p.add_argument("--out", default=None, help="folder for report.md, report.html, report_files/ (None: DIR itself)")
    p.add_argument("--title", default=None, help="the report's title")
    p.add_argument("--all-timelines", action="store_true",
                   help="a utilisation/traffic timeline for every cell, not only each strategy's largest")


def main(args) -> int:
    from ddtrain.report.build import build   # here: --help answers without torch
    from ddtrain.report.plots import INSTALL
    root = Path(args.dir)
    out = Path(args.out) if args.out else root
    result = build(root, out, title=args.title, all_timelines=args.all_timelines)
    for note in result["damaged"]:
        print(f"ddtrain: warning: skipped {note}", file=sys.stderr)
    print(f"# ddtrain report: {len(result['figures'])} figures")
    for title in result["figures"]:
        print(f"#   {title}")
    for why in result["not_drawn"]:
        print(f"# not drawn: {why}")
    if result["plots_missing"]:
        print(f"# {result['plots_missing']} plot(s) not drawn: matplotlib is not installed ({INSTALL}, then run "
              "ddtrain report again); the tables are complete")
    print(f"# wrote {result['markdown']} and {result['html']} (self-contained)")
    return 0
