"""Reference schedulers that refine the spec, the engine loop, the fake model and the cost model.

- :mod:`~schedspec.reference.policies`: pure ``plan(state, config)`` functions (fcfs, static,
  shortest-prompt-first, priority).
- :mod:`~schedspec.reference.scheduler`: the ``Scheduler`` protocol and the ``--scheduler`` registry.
- :mod:`~schedspec.reference.fake_model`: the token-source interface and the default fake model.
- :mod:`~schedspec.reference.engine`: the loop that drives a scheduler and checks it against the spec.
- :mod:`~schedspec.reference.scenarios`: the bundled fault scenarios and their replay.
- :mod:`~schedspec.reference.cost_model`: step times (the linear cost model and its profiles).

Traces, metrics and the lab that replays traces live above, in :mod:`schedspec.lab`.

Imports nothing from ``schedspec.engines`` or ``schedspec.gpu_backend`` (a backend is passed in).
"""
