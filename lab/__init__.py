"""The lab: replay real traces through a scheduler and measure what it did (imported as ``schedspec.lab``).

- Workloads, each turned into a list of :class:`~schedspec.spec.workload.RequestSpec`:
  :mod:`~schedspec.lab.trace_formats` (real traces: Azure 2023/2024, BurstGPT, Mooncake, the packaged
  traces and their attribution), :mod:`~schedspec.lab.windows` (``select_window``),
  :mod:`~schedspec.lab.synthetic` (synthetic arrival processes and the ``--synthetic`` form), and
  :mod:`~schedspec.lab.workload_checks` (``WorkloadError`` and the limits all three check).
- :mod:`~schedspec.lab.run`: :func:`~schedspec.lab.run.run_lab`, one scheduler on one window through
  the reference engine loop, in time mode, and the ``--compare`` variants.
- :mod:`~schedspec.lab.metrics`: per-request timelines, TTFT / ITL / TPOT / E2E, efficiency, goodput.
- :mod:`~schedspec.lab.plots`: PNG plots of lab runs.
- :mod:`~schedspec.lab.run_record`: run records (one run's conditions and figures as JSON,
  ``run-record-schema.json`` beside it).
- :mod:`~schedspec.lab.sweep`, :mod:`~schedspec.lab.capacity`: ``--sweep`` over configurations and the
  ``--capacity`` search for the highest rate that meets an SLO.
- :mod:`~schedspec.lab.calibrate`: fitting the cost model to the PyTorch backend's measured step times.

Layering: the lab sits above ``schedspec.spec`` and ``schedspec.reference`` and may use
``schedspec.engines`` and ``schedspec.gpu_backend``; it imports nothing of the CLI (``schedspec.cli``,
``schedspec.cli_common``, ``schedspec.commands``) or of ``schedspec.testing``, and nothing below it
imports the lab (``tests/test_layering.py``). The CLI commands (``schedspec/commands/``) import it.

What stays in ``schedspec.reference`` and why: the cost model
(:mod:`schedspec.reference.cost_model`) and the fake model (:mod:`schedspec.reference.fake_model`).
The engine loop (``reference/engine.py``) drives :class:`~schedspec.reference.fake_model.FakeModel` by
default, and the fake model prices each step with the cost model's default profile (``PROFILES``, built
from the datasheet derivation ``derive``, ``GPUS`` and ``MODELS``); the PyTorch backend
(``gpu_backend/runner.py``) describes each step with ``step_shape``. Those are most of the module, so
splitting the profile file loader and ``default_scheduler_config`` off into the lab would leave two
halves of one model in two packages for no layering gain; the whole cost model stays in reference.
"""
