"""Incremental checking: every invariant at every step, in time proportional to what the step changed.

:func:`schedspec.spec.invariants.check_step` looks at the whole state: every block (tens of thousands on
a real GPU) and every request that ever ended. That is the definition, and the Hypothesis suite uses
it. Over a one-hour trace (about 150,000 steps) it is too slow, so the lab uses
:class:`IncrementalChecker`, which must find exactly what the full check finds
(``tests/test_incremental.py`` compares the two on every step of random runs, with injected faults):

- terminal requests never change (no transition of the spec touches them), so each is checked once,
  in the step it becomes terminal;
- ``block-conservation`` is checked with a ledger (block -> owner, and the free set) updated from the
  block tables that changed: every newly owned block must have been free and in range, every released
  block must have been owned by the releasing request, and ``free + owned == num_kv_blocks`` with the
  free queue's length equal to the ledger's free count. The free queue's *order* is not compared.
"""

from __future__ import annotations

from collections.abc import Mapping

from schedspec.spec.config import SchedulerConfig
from schedspec.spec.invariants import check_step
from schedspec.spec.request import Request
from schedspec.spec.rules import Violation
from schedspec.spec.state import SchedulerState, StepPlan

NAME = "block-conservation"


class IncrementalChecker:
    """Checks steps incrementally (module docstring). Feed it every state in order.

    Usage per step: ``checker.sync(before)`` (after arrivals and aborts), then the plan may be checked
    with :func:`schedspec.spec.rules.violated_rules` (``before.free_block_set`` is served from the
    ledger), then ``checker.check(before, plan, after)``.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.owner: dict[int, str] = {}
        self.free: set[int] = set(range(config.num_kv_blocks))
        self.held: dict[str, tuple[int, ...]] = {}
        self.live: set[str] = set()
        self.pending_terminal: dict[str, Request] = {}
        self.violations: list[Violation] = []

    def _report(self, step: int, detail: str, request_id: str | None = None) -> None:
        self.violations.append(Violation(NAME, detail, step, request_id, kind="invariant"))

    def _release(self, step: int, request_id: str, blocks: tuple[int, ...]) -> None:
        for block_id in blocks:
            if self.owner.get(block_id) != request_id:
                self._report(step, f"released block {block_id} it does not own", request_id)
                continue
            del self.owner[block_id]
            self.free.add(block_id)

    def _take(self, step: int, request_id: str, blocks: tuple[int, ...]) -> None:
        for block_id in blocks:
            if not 0 <= block_id < self.config.num_kv_blocks:
                self._report(step, f"block id {block_id} out of range [0, {self.config.num_kv_blocks})", request_id)
            elif block_id in self.owner:
                self._report(step, f"block {block_id} also owned by {self.owner[block_id]}", request_id)
            elif block_id not in self.free:
                self._report(step, f"block {block_id} taken but not free", request_id)
            else:
                self.free.discard(block_id)
                self.owner[block_id] = request_id

    def _follow(self, state: SchedulerState) -> None:
        """Bring the ledger to ``state``: release the tables of requests no longer live, apply changed
        tables of live ones, and remember newly terminal requests."""
        step = state.step
        for request_id in [r for r in self.live if r not in state.requests]:
            self.live.discard(request_id)
            if request_id in self.held:
                self._release(step, request_id, self.held.pop(request_id))
            ended = state.finished.get(request_id)
            if ended is not None:
                self.pending_terminal[request_id] = ended
        self.live.update(state.requests)
        # Releases first (preemption empties a table), then allocations: a block released by one
        # request may be taken by another in the same step.
        takes: list[tuple[str, tuple[int, ...]]] = []
        for request_id, request in state.requests.items():
            old = self.held.get(request_id, ())
            table = request.block_ids
            if table is old or table == old:
                continue
            if table[: len(old)] == old:
                takes.append((request_id, table[len(old):]))
            else:
                self._release(step, request_id, old)
                takes.append((request_id, table))
            if table:
                self.held[request_id] = table
            else:
                self.held.pop(request_id, None)
        for request_id, blocks in takes:
            self._take(step, request_id, blocks)
        owned = sum(len(r.block_ids) for r in state.requests.values())
        if len(state.free_block_ids) + owned != self.config.num_kv_blocks:
            self._report(step, f"free {len(state.free_block_ids)} + owned {owned} != num_kv_blocks={self.config.num_kv_blocks}")
        elif len(state.free_block_ids) != len(self.free):
            self._report(step, f"free queue holds {len(state.free_block_ids)} blocks, the ledger {len(self.free)}")

    def sync(self, before: SchedulerState) -> list[Violation]:
        """Follow arrivals and aborts applied since the last step; serve ``before.free_block_set`` from
        the ledger. Returns the violations found."""
        self.violations = []
        self._follow(before)
        if len(before.free_block_ids) == len(self.free):
            object.__setattr__(before, "_free_set", self.free)
        return self.violations

    def check(self, before: SchedulerState, plan: StepPlan, after: SchedulerState) -> list[Violation]:
        """The violations of the step ``before -> after``: what :func:`check_step` would report."""
        object.__setattr__(before, "_free_set", None)  # the ledger's set is about to change
        self.violations = []
        self._follow(after)
        terminal: Mapping[str, Request] = self.pending_terminal
        self.pending_terminal = {}
        return check_step(before, plan, after, self.config, terminal=terminal, skip=frozenset({NAME})) + [
            Violation(v.name, v.detail, before.step, v.request_id, kind="invariant") for v in self.violations
        ] + [
            Violation(NAME, f"terminal request still owns {len(r.block_ids)} blocks", before.step, rid, kind="invariant")
            for rid, r in terminal.items() if r.block_ids
        ]
