"""Adapters that drive real engines' schedulers through the ``Scheduler`` protocol of
:mod:`schedspec.reference.scheduler`, so that every step they take is checked against the spec.

- :mod:`schedspec.engines.vllm`: vLLM V1's scheduler, 0.32 or 0.33 (``--scheduler vllm``, ``vllm-priority``,
  ``vllm-async``, ...), its worker half ``engines/vllm_worker.py`` run in vLLM's own environment.
- :mod:`schedspec.engines.nanovllm`: ``nano-vllm-fork==20260210`` (``--scheduler nanovllm``).
- :mod:`schedspec.engines.sglang`: SGLang 0.5.23's scheduler (``--scheduler sglang``), its worker half
  ``engines/sglang_worker.py`` run in SGLang's own environment (``.venv-sglang``, built on request).
- :mod:`schedspec.engines.recording`: whole-engine traces recorded by ``engines/recorder/schedspec_vllm_recorder.py``
  (loaded by a running vLLM through ``scheduler_cls``) replayed through the ``vllm`` adapter.

Adapters are imported only when chosen (``reference.scheduler.REGISTRY``); this package imports
none of them.
"""
