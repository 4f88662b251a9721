"""What the cost model reads of each all-reduce algorithm, from its record in ``ddtrain.comm.ALGORITHMS`` only.

Each algorithm carries its cost beside its code (``ddtrain.comm.algorithm``): its formula
``time``, its message schedule ``steps`` (the bytes of each step on its critical path) and its
link-sharing rule ``link_share``. The terms that depend on the order of the messages (the token
bucket of an emulated link, ``burst``), on their number (α under load, ``loaded``) or on ranks
sharing a node's link (``advise``) read them through the functions here, by name, so an algorithm
registered from outside the package (``ddtrain.comm.register_algorithm``) is modelled like ours.
An algorithm whose record lacks what a term needs is refused by name (``missing``: the adviser
leaves it out and says why).
"""
from __future__ import annotations

from ddtrain import comm
from ddtrain.comm.algorithm import Algorithm
from ddtrain.errors import DDTrainError, choice_error


def missing(algorithm: str) -> list[str]:
    """Why the adviser cannot model ``algorithm`` (not registered, or what its record lacks); empty when it can."""
    record = comm.ALGORITHMS.get(algorithm)
    if record is None:
        return ["not in ddtrain.comm.ALGORITHMS"]
    return record.missing_cost()


def _record(algorithm: str, needs: str) -> Algorithm:
    record = comm.ALGORITHMS.get(algorithm)
    if record is None:
        raise choice_error("all-reduce algorithm", algorithm, comm.ALGORITHMS)
    if getattr(record, needs) is None:
        what = {"steps": "message schedule", "link_share": "link-sharing rule", "time": "cost formula"}[needs]
        raise DDTrainError(f"no {what} for algorithm {algorithm!r} (its ddtrain.comm Algorithm record has no {needs})")
    return record


def steps(algorithm: str, nbytes: float, ranks: int) -> list[float]:
    """Bytes of each step on the critical path of one all-reduce of ``nbytes`` over ``ranks`` ranks."""
    return list(_record(algorithm, "steps").steps(nbytes, ranks))


def link_share(algorithm: str, ranks: int, procs_per_node: int) -> float:
    """β multiplier for ``procs_per_node`` ranks behind one link (1 with one rank per node)."""
    return _record(algorithm, "link_share").link_share(ranks, procs_per_node)


def added_bytes(algorithm: str, nbytes: float, ranks: int) -> float:
    """Bytes one all-reduce combines locally on its critical path (its formula's γ term, per unit γ)."""
    return _record(algorithm, "time").added_bytes(nbytes, ranks)
