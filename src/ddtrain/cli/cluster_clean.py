"""``ddtrain cluster clean``: remove emulated clusters left behind (only ours, by name prefix).

Every ``cluster run`` already sweeps away runs whose owner process died (a SIGKILLed run
cannot clean up after itself); this command also removes runs kept with ``--keep`` and, with
``--all``, runs still in progress (their processes are stopped first).
"""
from __future__ import annotations

from ddtrain.cluster import checks, cpu, netns


def add_arguments(parser) -> None:
    parser.add_argument("--all", action="store_true",
                        help="also remove clusters whose owning 'ddtrain cluster run' is still alive")
    parser.add_argument("--dry-run", action="store_true", help="only list the namespaces that exist")


def main(args) -> int:
    checks.preflight()
    if args.dry_run:
        for name in netns.list_namespaces():
            print(name)
        return 0
    removed = netns.sweep(include_kept=True, include_live=args.all)
    for name in cpu.sweep(include_live=args.all):   # the CPU cgroups of --node-cpu
        print(f"removed cgroup {name}")
    for name in removed:
        print(f"removed {name}")
    left = netns.list_namespaces()
    print(f"# removed {len(removed)} namespaces; {len(left)} of ours left"
          + (" (live runs; --all removes them)" if left else ""))
    return 0
