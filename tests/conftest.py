"""Hypothesis profiles for the test suite; choose one with ``HYPOTHESIS_PROFILE`` (default ``default``).

- ``default``: fast local runs (30 examples, stateful runs of up to 30 rules).
- ``ci``: derandomized (a fixed seed sequence, no example database) so CI never flakes; 500 examples
  of 50 rules per stateful test, i.e. per reference policy.
- ``mutmut``: derandomized like ``ci`` but with the default's 30 examples, so that a mutant's verdict does
  not depend on the run (scripts/mutmut.sh).
- ``nightly``: long randomized campaigns (10,000 examples of 100 rules), failures kept in the local
  example database for replay.

See ``docs/testing.md`` for the measured runtimes.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "default",
    max_examples=30,
    stateful_step_count=30,
    deadline=None,
)
settings.register_profile(
    "ci",
    max_examples=500,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "mutmut",
    max_examples=30,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "nightly",
    max_examples=10_000,
    stateful_step_count=100,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(scope="module")
def exact_fp32_one_thread():
    """For a module of fp32 comparisons (``pytestmark = pytest.mark.usefixtures("exact_fp32_one_thread")``):
    TF32 matmuls off (on a GPU they would exceed a 1e-4 tolerance) and one CPU thread (tiny matmuls run faster
    and steadier on a shared machine); both restored after the module."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.set_num_threads(threads)
    torch.backends.cuda.matmul.allow_tf32 = tf32
