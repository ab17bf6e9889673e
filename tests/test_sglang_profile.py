"""The ``sglang-profile`` reference scheduler (``reference/sglang_profile.py``) on states worked out by hand
from SGLang 0.5.23's source (the rule numbers are the module docstring's), and its refinement of the spec
(a Hypothesis machine on the configs and shapes ``schedspec diff`` compares it on). No SGLang needed: the
diff against SGLang itself is in ``tests/test_engine_sglang_profile.py``."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from schedspec.reference import sglang_profile as sp
from schedspec.reference.engine import Engine, finished_set_mismatches
from schedspec.reference.scheduler import UnsupportedFeature, make_scheduler
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.workload import RequestSpec
from schedspec.testing import SchedulerStateMachine


def _run(config: SchedulerConfig, specs: list[RequestSpec], max_steps: int = 60):
    profile = make_scheduler("sglang-profile", config)
    result = Engine(profile, config).run(specs, mode="steps", max_steps=max_steps)
    assert result.ok, [str(v) for v in result.violations[:3]]
    steps = [{i.request_id: (i.num_computed_tokens, i.num_tokens, len(r.blocks_allocated.get(i.request_id, ())))
              for i in r.scheduled} for r in result.records]
    return profile, result, steps


def test_arrival_clipping_by_hand() -> None:
    # rule 1: 16 pages of 4 (64 tokens), max_model_len 128: max_req_len = min(127, 63) = 63
    config = SchedulerConfig(block_size=4, num_kv_blocks=16, max_num_batched_tokens=64, max_num_seqs=4,
                             max_model_len=128)
    assert sp.max_req_len(config) == 63 and sp.max_req_input_len(config) == 58
    # 40-token prompt: min(20, 63 - 40 - 1 = 22) = 20, then 64 - 40 - 4 - 1 = 19 (the finding's case)
    assert sp.clipped_max_new_tokens(40, 20, config) == 19
    # 10-token prompt, max_model_len 32: max_req_len 31 -> 31 - 10 - 1 = 20; the pool allows 64 - 12 - 4 - 1 = 47
    small = config.with_changes(max_model_len=32)
    assert sp.clipped_max_new_tokens(10, 100, small) == 20
    # a prompt whose pages and one more page fill the pool: 0 (and SGLang never admits it, rule 7)
    assert sp.clipped_max_new_tokens(57, 3, config) == 0
    assert not sp.admissible_alone(60, 3, config) and sp.admissible_alone(40, 19, config)


def test_the_estimate_stops_the_pass_and_a_merged_prefill_batch_clears_batch_is_full() -> None:
    """Rules 3, 4, 7: 16 pages of 4, budget 64. Step 0: A (8 + 20 + one page = 32 < 64) is admitted and
    reserves 8 + 4 + 20 = 32, leaving rem_total_tokens 32; B needs 32 < 32: NO_TOKEN, the pass ends
    (batch_is_full set), although B's 28 tokens fit the 56 free ones. Step 1: the prefill batch [A]
    becomes the running batch with a new batch's clear flag, so a prefill is tried: A's offset is
    (20 - 1) * 0.7 = 13.3, rem_total_tokens 56 - 13.3 = 42.7 > 32: B is admitted and A does not decode."""
    config = SchedulerConfig(block_size=4, num_kv_blocks=16, max_num_batched_tokens=64, max_num_seqs=4,
                             max_model_len=128)
    _, _, steps = _run(config, [RequestSpec("A", 8, 20, arrival_step=0), RequestSpec("B", 8, 20, arrival_step=0)])
    assert steps[0] == {"A": (0, 8, 2)}
    assert steps[1] == {"B": (0, 8, 2)}
    assert steps[2] == {"A": (8, 1, 1), "B": (8, 1, 1)}  # then one decode batch


def test_one_chunked_request_then_its_last_chunk_with_others() -> None:
    """Rules 5, 6, 7: budget 8, pages of 4. A's 10-token prompt is cut to 8 (its 12 paged tokens exceed the
    chunk) and becomes the chunked request; the spent chunk budget (OTHER) leaves B waiting. Step 1: A's
    last 2 tokens first (paged: 4 of the chunk budget), then B's 3 tokens (paged 4 <= 4)."""
    config = SchedulerConfig(block_size=4, num_kv_blocks=16, max_num_batched_tokens=8, max_num_seqs=4,
                             max_model_len=128)
    _, _, steps = _run(config, [RequestSpec("A", 10, 5, arrival_step=0), RequestSpec("B", 3, 2, arrival_step=0)])
    assert steps[0] == {"A": (0, 8, 2)}
    assert steps[1] == {"A": (8, 2, 1), "B": (0, 3, 1)}


def test_max_running_requests_stops_admission() -> None:
    """Rule 6: one request slot; B waits until A ends, although the estimate has room."""
    config = SchedulerConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=64, max_num_seqs=1,
                             max_model_len=128)
    _, _, steps = _run(config, [RequestSpec("A", 4, 2, arrival_step=0), RequestSpec("B", 4, 2, arrival_step=0)])
    assert steps[:4] == [{"A": (0, 4, 1)}, {"A": (4, 1, 1)}, {"B": (0, 4, 1)}, {"B": (4, 1, 1)}]


def test_over_admission_retraction_order_ratio_and_readmission() -> None:
    """Rules 4 and 7 to 10, pages of one token, 30 tokens, three requests of 2 + 10 tokens at step 0.

    Step 0: A (2 + 10 + 1 = 13 < 30) reserves 13; B (13 < 17) reserves 13; C (13 < 4) NO_TOKEN.
    Step 1: [A, B] is the running batch; offset 2 * 9 * 0.7 = 12.6, free 26: C (13 < 13.4) is admitted.
    Steps 2-9: decodes of [A, B, C] (3 pages each step, 24 -> 0 free), the ratio decays by 8 steps.
    Step 10: no page for the decode: all three have 9 outputs and 2-token prompts (equal keys), so the
    stable sort keeps running order and C, the last, is retracted (its 10 pages are enough for A and B);
    the ratio becomes min(1, (9 + 9 + 20 * 2) / (10 + 10 + 1)) = 1. A and B end with their 10th token.
    Step 11: C comes back with its 9 outputs: it computes 11 tokens and ends."""
    config = SchedulerConfig(block_size=1, num_kv_blocks=30, max_num_batched_tokens=64, max_num_seqs=4,
                             max_model_len=64)
    specs = [RequestSpec(name, 2, 10, arrival_step=0) for name in "ABC"]
    profile = make_scheduler("sglang-profile", config)
    engine = Engine(profile, config)
    ratios: list[float] = []
    engine.on_step = lambda record: ratios.append(profile.ratio)
    result = engine.run(specs, mode="steps", max_steps=40)
    assert result.ok, [str(v) for v in result.violations[:3]]
    steps = [({i.request_id: (i.num_computed_tokens, i.num_tokens) for i in r.scheduled}, r.preempted)
             for r in result.records]
    assert steps[0] == ({"A": (0, 2), "B": (0, 2)}, ())
    assert steps[1] == ({"C": (0, 2)}, ())
    for k in range(2, 10):
        assert steps[k] == ({"A": (k, 1), "B": (k, 1), "C": (k, 1)}, ()), k
    assert steps[10] == ({"A": (10, 1), "B": (10, 1)}, ("C",))
    assert steps[11] == ({"C": (0, 11)}, ())
    assert len(steps) == 12
    assert ratios[9] == pytest.approx(0.7 - 8 * (0.7 - 0.098) / 600)
    assert ratios[10] == 1.0


def test_a_fully_idle_step_resets_the_ratio() -> None:
    """Rule 10: A decodes (the ratio decays); once nothing is running, waiting or chunked, an idle step
    resets it to 0.7 (Scheduler.on_idle)."""
    config = SchedulerConfig(block_size=4, num_kv_blocks=16, max_num_batched_tokens=64, max_num_seqs=4,
                             max_model_len=128)
    profile = make_scheduler("sglang-profile", config)
    seen: list[float] = []
    engine = Engine(profile, config)
    engine.on_step = lambda record: seen.append(profile.ratio)
    engine.run([RequestSpec("A", 4, 3, arrival_step=0), RequestSpec("B", 4, 1, arrival_step=6)], mode="steps", max_steps=20)
    assert seen[2] == pytest.approx(0.7 - 2 * (0.7 - 0.098) / 600)  # two decode steps of A
    assert seen[4] == 0.7  # steps 3.. are idle until B arrives at step 6


def test_a_request_sglang_can_never_admit_blocks_the_queue() -> None:
    """docs/findings/sglang-unadmittable-request-blocks-queue.md: 2 pages of 8; A (9 + 1 tokens) fits the
    pool and passes validate_input_length (9 < min(63, 15) - 5 = 10), but its clipped max_new_tokens is 0
    (16 - 16 - 8 - 1 < 0) and 9 + 0 + 8 = 17 >= 16: never admitted; B waits behind it."""
    config = SchedulerConfig(block_size=8, num_kv_blocks=2, max_num_batched_tokens=16, max_num_seqs=2,
                             max_model_len=64)
    profile = make_scheduler("sglang-profile", config)
    result = Engine(profile, config, properties=()).run([RequestSpec("A", 9, 1, arrival_step=0), RequestSpec("B", 2, 2, arrival_step=1)],
                                                        mode="steps", max_steps=30)
    assert not any(r.scheduled for r in result.records)
    assert set(result.state.requests) == {"A", "B"}


def test_refused_configs_and_requests() -> None:
    config = SchedulerConfig(block_size=4, num_kv_blocks=16, max_num_batched_tokens=64, max_num_seqs=4,
                             max_model_len=128)
    with pytest.raises(UnsupportedFeature, match="prefix caching"):
        make_scheduler("sglang-profile", config.with_changes(enable_prefix_caching=True))
    profile = make_scheduler("sglang-profile", config)
    with pytest.raises(UnsupportedFeature, match="LoRA"):
        profile.add_request(RequestSpec("A", 4, 2, arrival_step=0, lora_int_id=1).to_request(0))


def test_requests_without_eos_take_the_ignore_eos_estimate() -> None:
    """Rule 13, worked by hand: 16 pages of 4, budget 64; A and B (8 + 19, clipped to min(19, 63 - 8 - 1,
    64 - 8 - 4 - 1) = 19). With an end-of-sequence id (rule 7) A reserves 8 + 4 + 19 = 31 and B needs 8 + 19
    + 4 = 31 < 33: both at step 0. Without one (ignore_eos), B's input fits (12 <= min(52, 33)), but the end
    simulation does not: states [(19, 8), (19, 8)] (B inserted before A's equal one), 64 - 12 - 12 = 40 free
    tokens, 40 - 19 * 2 = 2 <= 1 * 2: NO_TOKEN. Step 1: A decoded once is counted at ratio 1 ((19 - 1) * 1 =
    18 offset, rem_total_tokens 56 - 18 = 38 >= 12); states [(18, 9), (19, 8)]: 44 - 36 = 8 > 2, then 44 + 9
    - 19 = 34 > 1: B is admitted."""
    config = SchedulerConfig(block_size=4, num_kv_blocks=16, max_num_batched_tokens=64, max_num_seqs=4,
                             max_model_len=128)
    _, _, with_eos = _run(config, [RequestSpec("A", 8, 19, arrival_step=0), RequestSpec("B", 8, 19, arrival_step=0)])
    assert with_eos[0] == {"A": (0, 8, 2), "B": (0, 8, 2)}
    _, _, steps = _run(config, [RequestSpec("A", 8, 19, arrival_step=0, eos_token_id=None),
                                RequestSpec("B", 8, 19, arrival_step=0, eos_token_id=None)])
    assert steps[0] == {"A": (0, 8, 2)}
    assert steps[1] == {"B": (0, 8, 2)}
    assert sp.ignores_eos(RequestSpec("A", 8, 19, eos_token_id=None).to_request(0))
    assert not sp.ignores_eos(RequestSpec("A", 8, 19, eos_token_id=None, stop_token_ids=(5,)).to_request(0))


class SglangProfileMachine(SchedulerStateMachine):
    """The state machine of :mod:`schedspec.testing` on ``sglang-profile``: every plan allowed, every
    invariant, its own state equal to the spec's, every request ended, on the configs and shapes
    ``schedspec diff`` compares it with SGLang on (``comparable_config``, ``comparable_request`` with the
    clipping undone): outside them it keeps SGLang's stalls (the findings), which the machine's drain
    would report."""

    scheduler_name = "sglang-profile"

    @classmethod
    def configs(cls):
        return super().configs().map(sp.comparable_config).filter(lambda c: c is not None)

    def add_request(self, prompt_len, max_tokens, eos_at_output=None, priority=0, prefix_group=None, prefix_len=0):
        if prompt_len > 0 and max_tokens > 0:
            moved = sp.comparable_request(RequestSpec("x", prompt_len, max_tokens), self.config, unclip=True)
            prompt_len, max_tokens = moved.prompt_len, moved.max_tokens
        return super().add_request(prompt_len, max_tokens, eos_at_output, priority)


def test_the_profile_refines_the_spec() -> None:
    run_state_machine_as_test(SglangProfileMachine, settings=settings(max_examples=60, stateful_step_count=30,
                                                                      deadline=None))


def test_the_clipped_finish_is_recognized_only_where_it_holds() -> None:
    """``schedspec diff``'s documented finding for an ``sglang`` run (``diff._sglang_finding``): the case of
    docs/findings/sglang-clips-max-tokens.md (16 pages of 4; A: 40 + 20, clipped to 19). After A's 19th
    output SGLang has ended it: recognized; with A not at its clipped count, with another request ended, or
    with another rule broken, not."""
    from schedspec.commands import diff
    from schedspec.spec.rules import Violation

    config = SchedulerConfig(block_size=4, num_kv_blocks=16, max_num_batched_tokens=64, max_num_seqs=4,
                             max_model_len=128)
    profile = make_scheduler("sglang-profile", config)
    states = {}
    engine = Engine(profile, config)
    engine.on_step = lambda record: states.setdefault(record.step, profile.state)
    engine.run([RequestSpec("A", 40, 20, arrival_step=0)], mode="steps", max_steps=40)
    ended, = finished_set_mismatches(["A"], [], 18)  # SGLang ended A, the spec runs it on
    view = Violation("state-mismatch", "num_free_blocks: engine 16, spec 5", 18, kind="mismatch")
    assert states[18].requests["A"].num_output_tokens == 19
    assert diff._sglang_finding(config, [ended, view], states[18]) == diff.CLIPPED_MAX_TOKENS
    assert diff._sglang_finding(config, [ended], states[17]) is None  # 18 outputs: not the clipped count
    other = finished_set_mismatches(["A", "B"], [], 18)  # B is not clipped
    assert diff._sglang_finding(config, other, states[18]) is None
    spec_only = finished_set_mismatches([], ["A"], 18)  # the other side: not this finding
    assert diff._sglang_finding(config, spec_only, states[18]) is None
    budget = Violation("token-budget", "65 tokens scheduled > max_num_batched_tokens=64", 18, kind="rule")
    assert diff._sglang_finding(config, [ended, budget], states[18]) is None
    assert diff._sglang_finding(config, [view], states[18]) is None  # no refinement: not this finding



def test_a_request_clipped_to_no_new_token_that_stops_on_its_first_output_is_the_clipping_finding():
    """A 1-token prompt whose max_new_tokens SGLang clips to 0 (a 2-page pool of 4 tokens: 8 - 4 - 4 - 1 < 0),
    its first output the EOS: the spec ends it with stop, SGLang with length. Only a finish-reason mismatch of
    such a request is the finding; the same code for a request not clipped to 0, or a request the spec ended with
    length, is not."""
    import attrs

    from schedspec.commands import diff
    from schedspec.reference.engine import FINISH_REASON_MISMATCH
    from schedspec.spec.rules import Violation

    config = SchedulerConfig(block_size=4, num_kv_blocks=2, max_num_batched_tokens=8, max_num_seqs=2, max_model_len=8)
    assert sp.clipped_max_new_tokens(1, 3, config) == 0
    result = Engine(make_scheduler("fcfs", config), config).run(
        [RequestSpec("A", 1, 3, arrival_step=0, eos_at_output=1), RequestSpec("B", 1, 1, arrival_step=0)])
    state = result.state
    assert state.finished["A"].finish_reason == "stop" and state.finished["B"].finish_reason == "length"
    mismatch = Violation("refinement", "SGLang finished request A with reason length; the spec ends it with stop",
                         0, "A", kind="mismatch", code=FINISH_REASON_MISMATCH)
    assert diff._sglang_finding(config, [mismatch], state) == diff.CLIPPED_MAX_TOKENS
    other = attrs.evolve(mismatch, request_id="B")  # ended with length by the spec: not this case
    assert diff._sglang_finding(config, [other], state) is None
    roomy = config.with_changes(num_kv_blocks=8)  # not clipped to 0
    assert diff._sglang_finding(roomy, [mismatch], state) is None


PRIORITY_POOL = SchedulerConfig(block_size=4, num_kv_blocks=32, max_num_batched_tokens=128, max_num_seqs=2,
                                max_model_len=128)
"""32 pages of 4 (128 tokens), two request slots: the case of
docs/findings/sglang-priority-preemption-takes-too-many.md."""


def _run_priority(specs: list[RequestSpec], config: SchedulerConfig = PRIORITY_POOL):
    profile = make_scheduler("sglang-profile-priority", config)
    result = Engine(profile, config).run(specs, mode="steps", max_steps=200)
    assert result.ok, [str(v) for v in result.violations[:3]]
    return profile, result


def test_priority_preemption_takes_more_than_it_needs() -> None:
    """Rule 12, worked by hand (the finding). Step 0, priority order A (2) then B (3): A needs 8 + 60 + 4 =
    72 < 128 and reserves 72; B needs 40 + 6 + 4 = 50 < 56 and reserves 50. Step 1 decodes both (ratio
    0.7 - 0.001003). Step 2: C (priority 0, 12 + 40) finds no slot; rem_total_tokens = 72 free - (58 + 4) *
    0.698997 = 28.66, so preempt_to_schedule must free 0 (C's fill ids: never reached) + 40 - 28.66 = 11.34
    of offsets: B (least urgent) frees 4 * 0.698997 = 2.80, not enough, so A (58 * 0.698997 = 40.54) goes
    too. B alone gave back its 11 pages (44 tokens): rem_total_tokens 28.66 + 2.80 + 44 = 75.46 > 12 + 40
    + 4 = 56, enough for C."""
    profile, result = _run_priority([RequestSpec("A", 8, 60, arrival_step=0, priority=2),
                                     RequestSpec("B", 40, 6, arrival_step=0, priority=3),
                                     RequestSpec("C", 12, 40, arrival_step=2, priority=0)])
    step2 = result.records[2]
    assert set(step2.preempted) == {"A", "B"}
    assert [(i.request_id, i.prefill_tokens) for i in step2.scheduled] == [("C", 12)]
    # A (priority 2) is re-admitted first, recomputing its 8 prompt and 2 output tokens
    assert [(i.request_id, i.num_computed_tokens, i.prefill_tokens) for i in result.records[3].scheduled] == [
        ("A", 0, 10)]
    assert profile.excess_preemptions == [sp.ExcessPreemption(2, "C", ("B", "A"), 1)]


def test_priority_preemption_needs_a_strictly_more_urgent_request_and_orders_the_queue() -> None:
    """Rule 12: A and B (priority 1) hold both slots; C, D, E (priorities 2, 3, 2, arriving in steps 1, 2, 3)
    are less urgent, so nothing is preempted; when A and B end, C and E (priority 2, C the older) are admitted
    before D, which arrived before E (``_sort_by_priority_and_fcfs``); D, the least urgent, preempts neither."""
    profile, result = _run_priority([RequestSpec("A", 8, 6, arrival_step=0, priority=1),
                                     RequestSpec("B", 8, 6, arrival_step=0, priority=1),
                                     RequestSpec("C", 8, 6, arrival_step=1, priority=2),
                                     RequestSpec("D", 8, 6, arrival_step=2, priority=3),
                                     RequestSpec("E", 8, 6, arrival_step=3, priority=2)])
    assert not any(record.preempted for record in result.records)
    admitted = [i.request_id for r in result.records for i in r.scheduled if i.num_computed_tokens == 0]
    assert admitted == ["A", "B", "C", "E", "D"]
    assert profile.excess_preemptions == []


class SglangPriorityProfileMachine(SglangProfileMachine):
    """:class:`SglangProfileMachine` on ``sglang-profile-priority`` (rule 12: priorities from the machine's
    draws, 0..3)."""

    scheduler_name = "sglang-profile-priority"


def test_the_priority_profile_refines_the_spec() -> None:
    run_state_machine_as_test(SglangPriorityProfileMachine, settings=settings(max_examples=30, stateful_step_count=30,
                                                                              deadline=None))


def test_priority_preemption_refuses_when_the_offsets_fall_short() -> None:
    """Rule 12, the other face of the finding: C at priority 2 may take only B (3; A at 2 differs by 0, not
    more than the threshold 0). B's offset (2.80) does not cover the 11.34 to free, so nothing is
    preempted, although B's 11 pages alone would have let C in (75.46 > 56): C waits for a slot."""
    _, result = _run_priority([RequestSpec("A", 8, 60, arrival_step=0, priority=2),
                               RequestSpec("B", 40, 6, arrival_step=0, priority=3),
                               RequestSpec("C", 12, 40, arrival_step=2, priority=2)])
    assert not any(record.preempted for record in result.records)
    first_c = next(k for k, r in enumerate(result.records) if any(i.request_id == "C" for i in r.scheduled))
    assert first_c > 2 and any(r.finished for r in result.records[:first_c])  # after B ended
