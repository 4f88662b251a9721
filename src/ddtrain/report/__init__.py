"""Reports: a results folder turned into ``report.md`` and a self-contained ``report.html`` with the
documents' plots (``build``: what goes in; ``sections``: the blocks per kind of result; ``plots``:
the figures, matplotlib only here)."""
from ddtrain.report.build import build, collect

__all__ = ["build", "collect"]
