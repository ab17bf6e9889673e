"""A KV connector for vLLM 0.32's V1 scheduler that needs no network: the ``vllm`` adapter's worker
(``engines/vllm_worker.py``) drives remote KV loads and sends on a workload's schedule through it.

Imports only ``vllm`` (it runs in vLLM's environment, beside the worker). vLLM loads it by module path
(``KVTransferConfig(kv_connector="ScheduledKVConnector", kv_connector_module_path="schedspec_vllm_connector")``,
``KVConnectorFactory``). The scheduler-side hooks of ``KVConnectorBase_V1``
(``vllm/distributed/kv_transfer/kv_connector/v1/base.py``) it implements:

- ``get_num_new_matched_tokens(request, num_computed_tokens)``: ``(n, True)`` (an asynchronous load) for a request
  the workload gives ``n`` remotely loadable prompt tokens, until its load has started; ``(0, False)`` otherwise.
- ``update_state_after_alloc(request, blocks, num_external_tokens)``: a load started (its blocks allocated):
  recorded in :attr:`ScheduledKVConnector.loads` for the worker's ``schedule`` reply, never offered again.
- ``build_connector_meta(scheduler_output)``: empty metadata (no worker side runs).
- ``request_finished(request, block_ids)``: ``(True, None)`` (delay the free: the blocks are being sent) for a
  request the workload marks ``kv_send`` that finished by a stop or a length, ``(False, None)`` otherwise.

The worker side (``start_load_kv``, ``wait_for_layer_load``, ``save_kv_layer``, ``wait_for_save``) does nothing:
the worker hands ``Scheduler.update_from_output`` the ``KVConnectorOutput`` (``finished_recving``,
``invalid_block_ids``, ``finished_sending``) the workload's schedule says, as a real connector's worker side
reports it.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


class ScheduledKVConnector(KVConnectorBase_V1):
    """The scheduler side of a KV connector whose transfers the worker completes (module docstring).

    Attributes:
        offers: request id -> prompt tokens a remote load can fill (set by the worker at ``add``).
        senders: ids whose KV is sent when they finish (set by the worker at ``add``).
        started: ids whose load started (offered no more).
        loads: ``(request id, tokens)`` of the loads started since the worker last took them.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.offers: dict[str, int] = {}
        self.senders: set[str] = set()
        self.started: set[str] = set()
        self.loads: list[tuple[str, int]] = []

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        offered = self.offers.get(request.request_id, 0)
        if offered and request.request_id not in self.started:
            return offered - num_computed_tokens, True
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            self.started.add(request.request_id)
            self.loads.append((request.request_id, num_external_tokens))

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        sent = request.request_id in self.senders and request.status in (RequestStatus.FINISHED_STOPPED,
                                                                          RequestStatus.FINISHED_LENGTH_CAPPED)
        return sent, None

    # the worker side: no forward pass runs, nothing to load or save
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
