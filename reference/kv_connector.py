"""A KV connector that needs no network: it completes or fails the remote KV transfers of a workload on the
workload's own schedule.

vLLM 0.32's scheduler talks to a KV connector (``vllm/distributed/kv_transfer/kv_connector/v1/base.py``
``KVConnectorBase_V1``): ``get_num_new_matched_tokens`` says how many prompt tokens a remote transfer can load
and whether it loads asynchronously; the worker side reports each step which loads landed
(``finished_recving``), which blocks they failed to fill (``invalid_block_ids``) and which sends completed
(``finished_sending``: ``KVConnectorOutput``). Here the workload says it all (:class:`~schedspec.spec.workload.RequestSpec`
``num_external_computed_tokens``, ``kv_load_steps``, ``kv_load_invalid_block``, ``kv_send``, ``kv_send_steps``):
:class:`ScheduledConnector` turns the loads a plan starts and the sending requests that finish into the
report (:class:`~schedspec.spec.state.KVTransferOutput`) of the step they are due in, as the engine loop's
worker side. Used by :class:`~schedspec.reference.engine.Engine`; the ``vllm`` adapter's connector follows the
same schedule.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from schedspec.spec.request import Request
from schedspec.spec.state import NO_TRANSFERS, KVTransferOutput, StepPlan
from schedspec.spec.workload import RequestSpec


def uses_kv_connector(workload: Iterable[RequestSpec]) -> bool:
    """Whether any request of the workload loads its prefix remotely or sends its KV when it finishes."""
    return any(spec.num_external_computed_tokens or spec.kv_send for spec in workload)


class ScheduledConnector:
    """The worker side of a KV connector on the workload's schedule (module docstring).

    Per step ``s``: :meth:`report` (``s``) is the report applied after step ``s``; then :meth:`started`
    (``s``, the plan) and :meth:`finished` (``s``, what ended) schedule the later reports. A load started in
    step ``s`` lands with the report of step ``s + kv_load_steps`` (default 1), failing from its block
    ``kv_load_invalid_block`` if set; a ``kv_send`` request that finished in step ``s`` completes its send
    with the report of step ``s + kv_send_steps`` (default 1). A load lands even if its request was aborted
    meanwhile (its blocks are then freed: vLLM ``Scheduler._update_from_kv_xfer_finished``).
    """

    def __init__(self, workload: Sequence[RequestSpec]) -> None:
        self.specs = {spec.request_id: spec for spec in workload if spec.num_external_computed_tokens or spec.kv_send}
        self._recving: dict[int, list[str]] = {}
        self._invalid: dict[int, list[int]] = {}
        self._sending: dict[int, list[str]] = {}

    @property
    def pending(self) -> bool:
        """Whether a report is still due (the engine steps on until every transfer is done)."""
        return bool(self._recving or self._sending)

    def report(self, step: int) -> KVTransferOutput:
        """The report applied after ``step`` (removed from the schedule)."""
        recving = self._recving.pop(step, ())
        invalid = self._invalid.pop(step, ())
        sending = self._sending.pop(step, ())
        if not (recving or sending):
            return NO_TRANSFERS
        return KVTransferOutput(tuple(recving), tuple(invalid), tuple(sending))

    def started(self, step: int, plan: StepPlan) -> None:
        """Schedule the landing of each load ``plan`` (of ``step``) starts."""
        for load in plan.loads:
            spec = self.specs[load.request_id]
            due = step + (spec.kv_load_steps or 1)
            self._recving.setdefault(due, []).append(load.request_id)
            index = spec.kv_load_invalid_block
            if index is not None and index < len(load.new_block_ids):
                self._invalid.setdefault(due, []).append(load.new_block_ids[index])

    def finished(self, step: int, finished: Iterable[str], ended: Mapping[str, Request]) -> None:
        """Schedule the send of each ``kv_send`` request that finished in ``step`` (``ended``: the terminal
        requests after it)."""
        for request_id in finished:
            if ended[request_id].kv_send:
                spec = self.specs.get(request_id)
                due = step + ((spec.kv_send_steps if spec is not None else None) or 1)
                self._sending.setdefault(due, []).append(request_id)
