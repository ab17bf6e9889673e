"""Theorems, options and results shared by the spec proofs and the policy proofs.

Nothing here imports z3: the command line lists theorems and prints results without it, and the
z3-using modules (:mod:`.encoding`, :mod:`.solve`, :mod:`.theorems`) are imported only when a
theorem runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PROVED = "proved"
COUNTEREXAMPLE = "counterexample"
UNKNOWN = "unknown"

DEFAULT_SLOTS = 16
DEFAULT_DEPTH = 6
DEFAULT_POLICY_SLOTS = 4
DEFAULT_BMC_SLOTS = 4
DEFAULT_BMC_BLOCK_SIZE = 2
DEFAULT_BLOCK_SIZE = 16
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_ID_BLOCKS = 6
"""M, the ``num_kv_blocks`` of the block-id theorems (:mod:`.blocks`: one variable per block)."""


@dataclass(frozen=True)
class Options:
    """How to run the theorems.

    Attributes:
        slots: N, the request slots of the symbolic state.
        block: ``"fixed"`` (``block_size`` is ``block_size_value``), ``"symbolic"`` or
            ``"uninterpreted"`` (see ``encoding.BLOCK_MODES``).
        block_size_value: the fixed block size (also used to re-check uninterpreted counterexamples).
        depth: K, the depth of bounded model checking.
        fixed: other ``SchedulerConfig`` fields fixed to values (``--set``); the rest stay symbolic.
        timeout_s: per solver query; a query that times out answers unknown.
        policy_slots: slots for the one-step policy theorems (at most ``slots``): the encoded policy
            step is a loop over a symbolic order, much larger than the spec's update.
        bmc_slots: slots for bounded model checking (at most ``slots``): an unrolling of K steps is K
            copies of the step.
        bmc_block_size: the block size of bounded model checking and its cover goals (with a fixed
            block size): small, so that decodes need new blocks within K steps and preemptions are
            reachable (with 16 and max_model_len <= K no run from the initial state preempts).
        id_blocks: M, the ``num_kv_blocks`` of the block-id theorems (:mod:`.blocks`), run at
            ``policy_n`` slots.
    """

    slots: int = DEFAULT_SLOTS
    block: str = "fixed"
    block_size_value: int = DEFAULT_BLOCK_SIZE
    depth: int = DEFAULT_DEPTH
    fixed: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = DEFAULT_TIMEOUT_S
    bmc_slots: int = DEFAULT_BMC_SLOTS
    policy_slots: int = DEFAULT_POLICY_SLOTS
    bmc_block_size: int = DEFAULT_BMC_BLOCK_SIZE
    id_blocks: int = DEFAULT_ID_BLOCKS

    @property
    def bmc_n(self) -> int:
        return min(self.slots, self.bmc_slots)

    @property
    def policy_n(self) -> int:
        return min(self.slots, self.policy_slots)

    @property
    def block_label(self) -> str:
        return f"fixed {self.block_size_value}" if self.block == "fixed" else self.block

    def config_fixed(self) -> dict[str, Any]:
        """The config fields given numerals in the encoding."""
        fixed = dict(self.fixed)
        if self.block == "fixed":
            fixed["block_size"] = self.block_size_value
        else:
            fixed.pop("block_size", None)
        return fixed


SAT = "sat"
UNSAT = "unsat"
UNCONFIRMED = "unconfirmed"
"""A cover goal the encoding reaches but the reference's replay of the same run does not: the encoding
and the code disagree."""


@dataclass
class Coverage:
    """One vacuity or cover check: ``case`` (``premises``, ``premises + preemption``, or a cover goal),
    ``status`` (``sat``: satisfiable / reached; ``unsat``: vacuous / unreachable within the depth;
    ``unconfirmed``: reached by the encoding, not by the reference's replay; ``unknown``), the depth it was
    reached at and the requests of that run (cover goals), its time."""

    case: str
    status: str
    depth: int | None = None
    seconds: float = 0.0
    slots: int | None = None
    """For a cover goal: the requests of the run that reached it (the search starts small)."""

    @property
    def reached(self) -> bool:
        return self.status == SAT

    def to_dict(self) -> dict[str, Any]:
        return {"case": self.case, "status": self.status, "depth": self.depth, "slots": self.slots,
                "seconds": round(self.seconds, 3)}

    def __str__(self) -> str:
        at = f" at depth {self.depth}" if self.depth is not None else ""
        if self.slots is not None and self.status == SAT:
            at += f" ({self.slots} requests, replayed on the reference)"
        word = {SAT: "satisfiable" if self.depth is None else "reached"}.get(self.status, self.status)
        if self.status == UNSAT:
            word = "UNSATISFIABLE (vacuous)" if self.depth is None else "NOT REACHED"
        if self.status == UNCONFIRMED:
            word = "NOT REPRODUCED by the reference"
        return f"{self.case}: {word}{at}"


@dataclass
class Result:
    """One theorem's outcome.

    Attributes:
        name, statement: the theorem.
        expected: ``proved``, or ``counterexample`` for a property the policy is known to break.
        status: ``proved``, ``counterexample`` or ``unknown``.
        slots, block, depth: the size it was checked at (``depth`` only for bounded model checking).
        seconds: wall time of its solver queries.
        detail: one line: why unknown, or what the counterexample shows.
        scenario: the counterexample as a scenario dict (bundled scenario format), if any.
        scenario_file: where the scenario was written or found, if anywhere.
        replayed: for a counterexample scenario, whether the executable reference confirmed it.
        witness: a counterexample state (slot values), for display.
    """

    name: str
    statement: str
    expected: str
    status: str
    slots: int
    block: str
    depth: int | None = None
    seconds: float = 0.0
    detail: str = ""
    scenario: dict[str, Any] | None = None
    scenario_file: str | None = None
    replayed: bool | None = None
    witness: dict[str, Any] | None = None
    vacuity: list[Coverage] = field(default_factory=list)
    """Satisfiability of the theorem's premises, alone and with each interesting case (a preemption,
    an admission at the cap, a stop, a rejection); for bounded model checking, the cover goals reached
    from the initial state (with the depth). A proof whose premises (or one case) are unsatisfiable
    proves nothing about it: the theorem is then not as expected."""

    @property
    def vacuous(self) -> list[Coverage]:
        return [c for c in self.vacuity if not c.reached]

    @property
    def ok(self) -> bool:
        """As expected: proved with every premise and case satisfiable (none vacuous), or a
        counterexample the reference replay confirmed."""
        if self.expected == PROVED:
            return self.status == PROVED and not self.vacuous
        return self.status == COUNTEREXAMPLE and self.replayed is not False

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "statement": self.statement, "expected": self.expected, "status": self.status,
            "ok": self.ok, "slots": self.slots, "block_size": self.block, "depth": self.depth,
            "seconds": round(self.seconds, 3), "scenario_file": self.scenario_file,
            "detail": self.detail or ("vacuous: " + "; ".join(str(c) for c in self.vacuous) if self.vacuous else ""),
            "replayed": self.replayed, "scenario": self.scenario, "witness": self.witness,
            "vacuity": [c.to_dict() for c in self.vacuity],
        }


@dataclass(frozen=True)
class Theorem:
    """A named claim with its statement in words and a function that checks it."""

    name: str
    statement: str
    run: Callable[[Options], Result]
    expected: str = PROVED
    bmc: bool = False
    """Checked by bounded model checking (its result names the depth K)."""


class Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start
