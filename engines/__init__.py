"""Adapters that drive real engines' schedulers through the ``Scheduler`` protocol of
:mod:`schedspec.reference.scheduler`, so that every step they take is checked against the spec.

- :mod:`schedspec.engines.nanovllm`: ``nano-vllm-fork==20260210`` (``--scheduler nanovllm``).

Adapters are imported only when chosen (``reference.scheduler.REGISTRY``); this package imports
none of them.
"""
