"""The Hypothesis agreement tests kill the encoding mutants of issue 14 (deliberate breaks).

Each test applies one mutant (monkeypatch) and runs the agreement property it should break with the
agreement test's budget under the ``ci`` profile (200 examples, derandomized: the same verdict in every
run, no shrinking), and asserts that the property fails. The mutants are those of
``tests/test_proofs_exhaustive.py`` (which kills each of them by enumeration), plus one of the
block-id layer:

- the free pool ignoring blocks released by this step's preemptions (the rules);
- a strict fits-alone (``<`` for ``<=`` on the blocks a request needs: the rules);
- the preemption order reversed (the fcfs policy encoding);
- Python admitting past ``max_num_seqs`` (the Python policy, against the encoding);
- the policy encoding not returning a victim's blocks to the pool;
- the id rule taking every block for free (``tests/test_proofs_blocks.py``).

Cost: each stops at the first failing example (a few seconds each; see ``docs/proofs.md``).
"""

from __future__ import annotations

import pytest

z3 = pytest.importorskip("z3")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from test_proofs_blocks import cases as block_cases  # noqa: E402
from test_proofs_blocks import check_block_ids  # noqa: E402
from test_proofs_encoding import as_rule_case, check_rules_and_update, double_preemption_case, pressure_case  # noqa: E402
from test_proofs_encoding import cases as rule_cases  # noqa: E402
from test_proofs_exhaustive import MUTANTS  # noqa: E402
from test_proofs_policy import cases as policy_cases  # noqa: E402
from test_proofs_policy import check_fcfs_step  # noqa: E402

from schedspec.spec.proofs import blocks  # noqa: E402

BUDGET = 200
"""The agreement tests' examples under the ``ci`` profile."""


def falsified(strategy, check, explicit=()) -> str | None:
    """Run ``check`` on the agreement test's explicit examples, then on ``BUDGET`` derandomized examples
    of ``strategy``; the first failure, or None."""
    for case in explicit:
        try:
            check(case)
        except AssertionError as error:
            return str(error)[:300]

    @settings(max_examples=BUDGET, derandomize=True, database=None, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(case):
        check(case)

    try:
        run()
    except AssertionError as error:  # the property's own assertion: a disagreement with the Python spec
        return str(error)[:300]
    return None


RULE_EXAMPLES = [as_rule_case(pressure_case()), as_rule_case(double_preemption_case())]
POLICY_EXAMPLES = [pressure_case(), double_preemption_case()]
"""The agreement tests' explicit examples (``@example``)."""

AGREEMENT = {
    "free pool ignores released blocks": (rule_cases(), check_rules_and_update, RULE_EXAMPLES),
    "strict fits-alone": (rule_cases(), check_rules_and_update, RULE_EXAMPLES),
    "reversed preemption order": (policy_cases("fcfs"), check_fcfs_step, POLICY_EXAMPLES),
    "Python admits past max_num_seqs": (policy_cases("fcfs"), check_fcfs_step, POLICY_EXAMPLES),
    "released blocks not returned in the policy encoding": (policy_cases("fcfs"), check_fcfs_step, POLICY_EXAMPLES),
}


@pytest.mark.parametrize("name", sorted(AGREEMENT))
def test_the_agreement_test_kills_the_mutant(name, monkeypatch):
    strategy, check, explicit = AGREEMENT[name]
    MUTANTS[name](monkeypatch)
    assert falsified(strategy, check, explicit) is not None, f"mutant {name!r} escaped {check.__name__}"


def test_the_block_agreement_test_kills_an_id_rule_that_takes_every_block_for_free(monkeypatch):
    original = blocks.ids_rule

    def mutant(s, plan, owner, h):
        return original(s, plan, [z3.IntVal(blocks.FREE)] * len(owner), h)

    monkeypatch.setattr(blocks, "ids_rule", mutant)
    import test_proofs_blocks

    monkeypatch.setattr(test_proofs_blocks, "ids_rule", mutant)
    assert falsified(block_cases(), check_block_ids) is not None
