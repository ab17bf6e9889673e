"""Tests that kill mutants of spec/incremental.py (issue 28: scripts/mutmut.sh incremental).

Each test states the contract it checks and the mutants it kills. The verdicts are always compared with the
full check (:func:`~schedspec.spec.invariants.check_step`), the definition; the work the fast path does (how
many steps fell back to the full block checks, how many blocks of the published chains were checked, what the
ledger keeps of ended requests) is observed through the counters and the ledger the checker keeps.
"""

from __future__ import annotations

from collections import Counter

import attrs
import pytest

from schedspec.reference.fake_model import FakeModel
from schedspec.reference.scheduler import make_scheduler
from schedspec.spec.config import SchedulerConfig
from schedspec.spec.incremental import IncrementalChecker
from schedspec.spec.invariants import check_step
from schedspec.spec.rules import violated_rules
from schedspec.spec.workload import RequestSpec
from tests.test_incremental import (
    CONFIG,
    FAULTS,
    NOT_BREACHES,
    SPECS,
    _advance,
    _CountingChecker,
    _Flat,
    _pool_size,
    _step_inputs,
    _takes_and_releases,
)


def _verdict(violations):
    """Every field of each violation, the detail included (the message a user reads), as a multiset."""
    return Counter((v.name, v.detail, v.kind, v.step, v.request_id, v.code) for v in violations)


def _fallback_steps(checker):
    """(step, plan, after) of each step on which a :class:`_CountingChecker` fell back to the full checks."""
    return [(after.step - 1, plan, after) for plan, after in checker.fallback_steps]


def _run_on(config, specs, fault=None, fault_step=-1, checker=None, steps=200, states=None, longest=None):
    """Run fcfs on ``specs``; after step ``fault_step`` the state is broken by ``fault`` (a name in FAULTS, or a
    function as they are) and the scheduler goes on FROM THE BROKEN STATE, so the breach persists (or heals as
    the run moves on). At every step the incremental rules and invariants must equal the definitions', every
    field of every violation (its detail too). Stops when the scheduler cannot go on from the broken state (it is
    not built for one: an id past the pool) or the run ends. Returns the full check's verdict counts per step
    from the fault step on (every step without a fault), or None when the fault could not be made; appends to
    ``states`` the states the checker followed (the initial one first), and keeps in ``longest`` the longest
    table each request had."""
    scheduler = make_scheduler("fcfs", config)
    model = FakeModel(config, cost_model=_Flat())
    checker = checker if checker is not None else IncrementalChecker(config)
    states = [] if states is None else states
    longest = {} if longest is None else longest
    states.append(scheduler.state)
    checked: frozenset[str] = frozenset()
    reports: list[int] = []
    for step in range(steps):
        if not _step_inputs(scheduler, specs, step):
            break
        before = scheduler.state
        checker.sync(before)
        try:
            plan = scheduler.schedule()
            sampled, _ = model.execute(plan, before)
            scheduler.update(plan, sampled)
        except (IndexError, KeyError):  # the reference scheduler and the spec's cache index their pool and their
            # reference counts with a block id past it (a state no transition makes)
            assert fault is not None and step > fault_step
            break
        assert _verdict(checker.rules(before, plan)) == _verdict(violated_rules(before, plan, config)), (fault, step)
        after = scheduler.state
        if fault is not None and step == fault_step:
            broken = (FAULTS[fault] if isinstance(fault, str) else fault)(after, before, checked)
            if broken is None:
                return None
            # the state it broke stays referenced: its cache is the base of the broken one's change log
            correct, after = after, broken  # noqa: F841
            scheduler.state = broken
        full = check_step(before, plan, after, config)
        assert _verdict(checker.invariants(before, plan, after)) == _verdict(full), (fault, step)
        if step >= fault_step:
            reports.append(len(full))
        checked = frozenset(after.finished)
        states += [before, after]
        for request_id, request in after.requests.items():
            longest[request_id] = max(longest.get(request_id, 0), len(request.block_ids))
    return reports


# "aborted request not terminal" needs an abort before any step; a reordered free queue is no breach (its own test)
PERSISTENT = sorted(set(FAULTS) - {"aborted request not terminal"} - NOT_BREACHES)


@pytest.mark.parametrize("caching", [False, True], ids=["no-caching", "prefix-caching"])
@pytest.mark.parametrize("fault", PERSISTENT)
def test_a_breach_that_persists_is_reported_at_every_step_as_the_full_check_reports_it(fault, caching):
    """A breach the run carries on with (the scheduler goes on from the broken state) is reported by the
    incremental checker at every later step exactly as by the full check, and once the run has healed (the broken
    request ended, the leaked block came back) the ledger proves steps again. This is the module docstring's
    promise that a persistent breach is reported as often as the full check reports it: after a fallback that
    found a breach the ledger was rebuilt FROM THE BROKEN STATE, so it must not prove the next step
    (``invariants``: ``sound`` from the fallback's breaches; ``sync``: ``and`` made ``or``, the flag left True;
    ``_follow``/``_follow_cached``: a check of the ledger loosened, which a rebuilt ledger of a broken state
    passes)."""
    config = CONFIG.with_changes(num_kv_blocks=10, enable_prefix_caching=caching)
    specs = [attrs.evolve(s, prefix_group="p", prefix_len=8) for s in SPECS] if caching else SPECS
    made = [reports for step in range(2, 8)
            if (reports := _run_on(config, specs, fault, step)) is not None and any(reports)]
    if not made:
        # the cache faults cannot be made without prefix caching
        assert not caching and fault not in _PLAIN_FAULTS, fault
        return
    assert any(len([n for n in reports if n]) > 1 for reports in made) or fault in _ONE_STEP, (fault, made)


# Faults the full check reports on their own step only: the run does not carry them on (the scheduler overwrote
# the broken part at the next step).
_ONE_STEP = {"held block loses its hash", "published block in a second table", "uncomputed block published",
             "uncomputed block published, then another working copy"}
_PLAIN_FAULTS = {"block owned twice", "block leaked", "block out of range", "block one past the pool",
                 "terminal holds blocks", "ended request keeps its freed table", "owned block in the free queue",
                 "owned block in the middle of the free queue", "duplicate in the free queue",
                 "out-of-range id in the free queue"}


@pytest.mark.parametrize("caching", [False, True], ids=["no-caching", "prefix-caching"])
def test_after_a_harmless_reordering_the_ledger_proves_steps_again(caching):
    """A free queue reordered (no breach: the full check finds nothing) cannot be followed by the shared-block
    ledger, so that step falls back; the scheduler goes on from the reordered queue, and from then on the ledger proves every
    step again but those where a request got blocks and ended in the step (``invariants``: the ledger left
    unsound after a fallback that found nothing, so every later step pays for the full checks; ``sync``: the
    flag set False on a step it followed)."""
    config = CONFIG.with_changes(num_kv_blocks=10, enable_prefix_caching=caching)
    specs = [attrs.evolve(s, prefix_group="p", prefix_len=8) for s in SPECS] if caching else SPECS
    checker = _CountingChecker(config)
    reports = _run_on(config, specs, "free queue reordered", 3, checker=checker)
    assert reports is not None and not any(reports) and len(reports) > 8
    late = [(step, plan, after) for step, plan, after in _fallback_steps(checker) if step != 3]
    assert all(_takes_and_releases(plan, after) for _, plan, after in late), [s for s, _, _ in late]
    # the shared-block ledger wants the queue's kept blocks in their order; the owner ledger's search takes the
    # reversed queue as the old one less all but its last block, those put back in front (a proof all the same)
    assert (3 in {step for step, _, _ in _fallback_steps(checker)}) == caching


def _middle_swapped(state, before, checked):
    """The free queue with its second and third blocks swapped: no breach, but not the old queue less a front
    part with blocks added at its ends, so the owner ledger cannot follow it either."""
    queue = tuple(state.free_block_ids)
    if len(queue) < 4:
        return None
    return attrs.evolve(state, free_block_ids=queue[:1] + queue[2:0:-1] + queue[3:])


@pytest.mark.parametrize("caching", [False, True], ids=["no-caching", "prefix-caching"])
def test_the_ledger_rebuilt_after_a_fallback_proves_the_next_steps(caching):
    """After a step the ledger cannot follow but that breaks nothing (the free queue's middle reordered), the full
    check runs once and the ledger is rebuilt from that state; it must then prove every later step but those
    where a request got blocks and ended in the step (``_rebuild``/``_rebuild_cached``: a table's blocks recorded
    under no owner or holder, so the next release of them fails and falls back)."""
    config = CONFIG.with_changes(num_kv_blocks=16, enable_prefix_caching=caching)
    specs = [attrs.evolve(s, prefix_group="p", prefix_len=8) for s in SPECS] if caching else SPECS
    made = 0
    for fault_step in range(1, 8):
        checker = _CountingChecker(config)
        reports = _run_on(config, specs, _middle_swapped, fault_step, checker=checker)
        if reports is None:
            continue
        assert not any(reports) and len(reports) > 5
        steps = [step for step, plan, after in _fallback_steps(checker) if not _takes_and_releases(plan, after)]
        # (no fallback at all where the swapped blocks were released in the step: then they are blocks added)
        assert steps in ([], [fault_step]), fault_step
        made += steps == [fault_step]
    assert made >= 2


def _swap_last(after, queue):
    """r0's last block (freed by nobody) swapped for the queue's first block, the queue left as it was."""
    r0 = after.requests["r0"]
    return {"r0": attrs.evolve(r0, block_ids=r0.block_ids[:-1] + (queue[0],))}


def _take_and_drop(after, queue):
    """r0 takes the queue's first block on top of its table, and r1's one block leaves its table for nowhere, the
    queue left as it was: no block taken by r0 was released in the step."""
    r0, r1 = after.requests["r0"], after.requests["r1"]
    return {"r0": attrs.evolve(r0, block_ids=r0.block_ids + (queue[0],)), "r1": attrs.evolve(r1, block_ids=())}


@pytest.mark.parametrize("edit", [_swap_last, _take_and_drop], ids=["swap-last", "take-and-drop"])
def test_a_block_taken_from_an_unchanged_free_queue_is_found(edit):
    """A request takes a free block while the free queue stays the same object (the block was never removed from
    it) and another block leaves a table without joining the queue: the counts still agree, so only the comparison
    of the queue with the old one sees that a block is both free and owned. The ledger once skipped that comparison
    when the queue object was unchanged and passed this breach (``_follow``: the queue check skipped or loosened,
    the blocks taken fresh from the queue (not released in the step) not listed; ``_queue_follows``: a block taken
    from the old queue's kept part not refused)."""
    config = SchedulerConfig(block_size=4, num_kv_blocks=10, max_num_batched_tokens=16, max_num_seqs=3,
                             max_model_len=32)
    for shared in (True, False):
        scheduler = make_scheduler("fcfs", config)
        model = FakeModel(config, cost_model=_Flat())
        checker = IncrementalChecker(config)
        for name, prompt in (("r0", 5), ("r1", 3)):
            scheduler.add_request(RequestSpec(name, prompt, 4, arrival_step=0).to_request(0))
        for _ in range(2):
            before = scheduler.state if shared else attrs.evolve(scheduler.state,
                                                                  free_block_ids=tuple(scheduler.state.free_block_ids))
            checker.sync(before)
            plan = scheduler.schedule()
            sampled, _ = model.execute(plan, before)
            scheduler.update(plan, sampled)
            after = scheduler.state
            if before.step == 0:
                assert checker.invariants(before, plan, after) == []
        queue = before.free_block_ids
        assert len(after.requests["r1"].block_ids) == 1
        broken = attrs.evolve(after, free_block_ids=queue, requests={**after.requests, **edit(after, queue)})
        full = check_step(before, plan, broken, config)
        assert {(v.name, v.request_id) for v in full} >= {("block-conservation", "r0")}
        assert _verdict(checker.invariants(before, plan, broken)) == _verdict(full)
        assert checker.fallbacks == 1


def test_every_step_of_a_lasting_leak_falls_back():
    """A block leaked (gone from the free queue, in no table) and never given back: every step from then on
    falls back to the full check, which reports it each time, and the checker counts each of those steps
    (``invariants``: the count of fallbacks set instead of increased)."""
    checker = IncrementalChecker(CONFIG)
    reports = _run_on(CONFIG, SPECS, "block leaked", 3, checker=checker)
    assert len(reports) > 5 and all(reports)
    assert checker.fallbacks == len(reports)


@pytest.mark.parametrize("caching", [False, True], ids=["no-caching", "prefix-caching"])
def test_the_ledger_keeps_nothing_of_ended_requests(caching):
    """The ledger keeps per request only what live requests need: after a run (finishes, an abort, preemptions)
    its tables, its memo of requests seen and its memo of published chains name live requests only, so a trace of
    an hour does not grow the checker with every request that ever ran (``_follow_cached``: the ended request's
    entry left in the memos)."""
    config = CONFIG.with_changes(num_kv_blocks=8, enable_prefix_caching=caching)
    specs = [attrs.evolve(s, prefix_group="p", prefix_len=8, max_tokens=12) for s in SPECS]
    specs += [RequestSpec("aborted", 6, 4, arrival_step=1, abort_at_step=3, prefix_group="p", prefix_len=8)]
    checker = _MemoryWatch(config)
    _plain_run(config, specs, checker)
    assert checker.ended == len(specs)


class _MemoryWatch(IncrementalChecker):
    """An incremental checker that asserts, after each step, that its ledger names live requests only."""

    ended = 0

    def invariants(self, before, plan, after):
        found = super().invariants(before, plan, after)
        live = set(after.requests)
        assert set(self.tables) <= live
        if self.cached:
            assert set(self.seen) == live and set(self.chains) <= live
        self.ended = len(after.finished)
        return found


def _plain_run(config, specs, checker, states=None):
    """Run fcfs on ``specs`` with ``checker`` (:func:`_run_on` without a fault); the run is correct, so every
    check finds nothing. Returns the longest table each request had."""
    longest: dict[str, int] = {}
    assert not any(_run_on(config, specs, checker=checker, states=states, longest=longest))
    return longest


def test_ended_requests_are_found_without_scanning_every_ended_request(monkeypatch):
    """Terminal requests are collected from the requests that left the live set; the map of every request that
    ever ended is scanned only on a step where some arrived and ended before the checker saw them live (here two
    arrivals aborted in the step they arrived, the second in the step a live request is aborted), never
    otherwise, though requests end in the same step as others; and each ended request is handed to the checks
    once, in the step it ended, whether found by the scan or not (``_collect_terminal``: the count of those
    found wrong or compared wrong, so the scan runs at every step (O(every ended request) per step over an hour's
    trace) or not when it must; the ids collected not kept, so a later scan collects them again)."""
    import schedspec.spec.incremental as incremental

    handed, last = [], set()  # per step, the requests handed over that did not end since the last step

    def recording(before, plan, after, config, terminal=None, skip=frozenset()):
        handed.append(set(terminal) - (set(after.finished) - last))
        last.clear()
        last.update(after.finished)
        return check_step(before, plan, after, config, terminal=terminal, skip=skip)

    monkeypatch.setattr(incremental, "check_step", recording)
    specs = [*SPECS, RequestSpec("gone", 3, 2, arrival_step=1, abort_at_step=1),
             RequestSpec("gone-too", 3, 2, arrival_step=7, abort_at_step=7),
             RequestSpec("aborted", 6, 16, arrival_step=1, abort_at_step=7)]
    together = [RequestSpec(f"t{i}", 5, 4, arrival_step=0) for i in range(3)]  # three finish in one step
    for run, scans in ((specs, 2), (together, 0), (SPECS, 0)):
        checker = IncrementalChecker(CONFIG)
        handed.clear()
        last.clear()
        _plain_run(CONFIG, run, checker)
        assert checker.scans == scans, [s.request_id for s in run]
        assert not any(handed), handed


class _NoChainMemo(IncrementalChecker):
    """The incremental checker without its memo of published chains: every chain is checked from its first block."""

    def _chain_known(self, request_id, request, hashed):
        from schedspec.spec.prefix_cache import ROOT_HASH

        return 0, ROOT_HASH


def test_the_chain_memo_spares_checking_published_blocks_again():
    """With prefix caching each changed request's published chain is checked from the prefix known right at its
    last check: on a run with long decodes the checker checks at least every block of every table once, and fewer
    than half the blocks the same checker checks without its memo, with the same verdicts (``_chain_known``
    and ``_follow_cached``: the memo never used, or restarted from the first block)."""
    config = CONFIG.with_changes(num_kv_blocks=24, block_size=2, max_model_len=64, enable_prefix_caching=True)
    specs = [RequestSpec(f"r{i}", 5 + i, 20, arrival_step=i, prefix_group="p", prefix_len=4) for i in range(4)]
    memo, plain = IncrementalChecker(config), _NoChainMemo(config)
    longest = _plain_run(config, specs, memo)
    assert _plain_run(config, specs, plain) == longest
    assert memo.fallbacks == plain.fallbacks == 0
    assert sum(longest.values()) <= memo.chain_blocks < plain.chain_blocks / 2, (memo.chain_blocks, plain.chain_blocks)


def test_the_screen_spares_the_screened_rules_on_correct_plans(monkeypatch):
    """Without prefix caching every plan of a correct run passes the screen, so the rules it screens are skipped
    (``violated_rules`` is called with them in ``skip``); with prefix caching the screen, which knows no prefix
    hits, is never used (``rules``: the screen left off, or used with caching)."""
    import schedspec.spec.incremental as incremental
    from schedspec.spec.incremental import FREE_POOL, SCREENED

    skips = []

    def recording(state, plan, config, skip=frozenset()):
        skips.append(frozenset(skip))
        return violated_rules(state, plan, config, skip=skip)

    from schedspec.spec.rules import violated_rules

    monkeypatch.setattr(incremental, "violated_rules", recording)
    for caching in (False, True):
        config = CONFIG.with_changes(enable_prefix_caching=caching)
        skips.clear()
        _plain_run(config, SPECS, IncrementalChecker(config))
        assert len(skips) > 10
        assert all(skip == (FREE_POOL if caching else SCREENED | FREE_POOL) for skip in skips), caching


def test_a_terminal_request_is_checked_once_when_it_ends(monkeypatch):
    """The full invariants are asked about the terminal requests that ended in the step only (and those found
    broken), never about every request that ever ended: on the proved path (``check_step``) and on a fallback
    (``check_state``), the map of terminal requests passed holds only requests that ended in the step
    (``invariants``: the map left out, so every ended request is checked at every step); and what the ledger
    proved is skipped there (``__init__``: the invariants it proves with prefix caching run in full as well)."""
    import schedspec.spec.incremental as incremental
    from schedspec.spec.incremental import CACHE_SCREENED, STATE_NAMES
    from schedspec.spec.invariants import check_state

    seen_step, seen_state, skips = [], [], set()

    def step_recording(before, plan, after, config, terminal=None, skip=frozenset()):
        seen_step.append((set(before.finished), set(after.finished), terminal))
        skips.add(("step", frozenset(skip)))
        return check_step(before, plan, after, config, terminal=terminal, skip=skip)

    def state_recording(state, config, terminal=None, skip=frozenset(), step=None):
        seen_state.append(terminal)
        skips.add(("state", frozenset(skip)))
        return check_state(state, config, terminal, skip=skip, step=step)

    monkeypatch.setattr(incremental, "check_step", step_recording)
    monkeypatch.setattr(incremental, "check_state", state_recording)
    config = CONFIG.with_changes(num_kv_blocks=8)
    _plain_run(config, SPECS, IncrementalChecker(config))
    assert not seen_state
    for before, after, terminal in seen_step:
        assert terminal is not None and set(terminal) <= after - before
    assert sum(len(terminal) for _, _, terminal in seen_step) == len(SPECS)
    # what the ledger proves is skipped from check_step: block-conservation alone without prefix caching
    assert skips == {("step", frozenset({"block-conservation"}))}
    skips.clear()
    # a fallback (the shared-block ledger cannot follow a reordered free queue) after two requests ended
    config = config.with_changes(num_kv_blocks=10, enable_prefix_caching=True)
    specs = [attrs.evolve(s, prefix_group="p", prefix_len=8) for s in SPECS]
    fallbacks = 0
    for fault_step in range(2, 12):
        seen_step.clear()
        seen_state.clear()
        if _run_on(config, specs, "free queue reordered", fault_step) is None:
            continue
        fallbacks += len(seen_state)
        assert all(terminal is not None for terminal in seen_state)
        assert sum(len(terminal) for _, _, terminal in seen_step) == len(SPECS)
        if seen_state:
            assert set(seen_state[0]) <= seen_step[fault_step][1] - seen_step[fault_step][0]
    assert fallbacks
    # with prefix caching check_step skips every invariant the shared-block ledger proves, and a fallback's
    # check_state runs exactly those (``__init__``: only block-conservation skipped, the others run in full)
    assert skips == {("step", CACHE_SCREENED), ("state", STATE_NAMES - CACHE_SCREENED)}


def test_a_rehashed_block_of_a_request_that_did_not_change_is_found():
    """A published block held by a request that did not change (the same request object as in the last state
    followed) gets another hash, listed consistently under it, in a step that schedules nothing: no table changed,
    the counts and the free queue are as before, the hash map agrees with the blocks' hashes; only the holder's
    published chain is now wrong (``prefix-published-computed``). The ledger must send the holders of every block
    whose hash changed to the chain check (``_follow_cached``: the holders of rehashed blocks left out)."""
    from schedspec.spec.state import StepPlan
    from tests.test_incremental import _cache_fault, _rehash

    config = CONFIG.with_changes(num_kv_blocks=10, enable_prefix_caching=True)
    scheduler = make_scheduler("fcfs", config)
    model = FakeModel(config, cost_model=_Flat())
    checker = IncrementalChecker(config)
    for spec in SPECS[:2]:
        scheduler.add_request(spec.to_request(0))
    found = 0
    for _ in range(4):
        before, plan, after = _advance(scheduler, model, checker)
        assert checker.invariants(before, plan, after) == []
        broken = _cache_fault(after, _rehash)
        if broken is None:
            continue
        assert all(broken.requests[r] is after.requests[r] for r in after.requests)
        probe = IncrementalChecker(config)  # a copy of the checker that followed the run so far
        probe.__dict__.update({k: (v.copy() if hasattr(v, "copy") else v) for k, v in checker.__dict__.items()})
        probe.holders = {b: set(h) for b, h in checker.holders.items()}
        full = check_step(after, StepPlan(), broken, config)
        assert "prefix-published-computed" in {v.name for v in full}
        assert _verdict(probe.invariants(after, StepPlan(), broken)) == _verdict(full)
        found += 1
    assert found


def test_the_screen_passes_a_speculative_decode_whose_table_fits_its_drafts_exactly():
    """A decode verifying two drafts with the block its tokens, drafts and lookahead slots need (13 slots in 4
    blocks of 4: the table neither short nor in excess) breaks no rule, and the screen passes it; a screen that
    counted the sequence less its drafts would see an excess block and make every such step of a speculative run
    pay for the full rules (``screened_rules_hold``: ``num_tokens - drafts``)."""
    from schedspec.spec.incremental import screened_rules_hold
    from schedspec.spec.rules import violated_rules
    from schedspec.spec.state import ScheduledRequest

    config = SchedulerConfig(block_size=4, num_kv_blocks=12, max_num_batched_tokens=16, max_num_seqs=3,
                             max_model_len=32, num_speculative_tokens=2, num_lookahead_tokens=2)
    scheduler = make_scheduler("fcfs", config)
    model = FakeModel(config, cost_model=_Flat())
    scheduler.add_request(RequestSpec("a", 8, 6, arrival_step=0).to_request(0))
    plan = scheduler.schedule()
    sampled, _ = model.execute(plan, scheduler.state)
    scheduler.update(plan, sampled)
    state = scheduler.state
    a = state.requests["a"]
    assert (a.num_tokens, a.num_computed_tokens, len(a.block_ids)) == (9, 8, 3)
    state = attrs.evolve(state, requests={"a": attrs.evolve(a, spec_token_ids=(5, 5))})
    plan = attrs.evolve(plan, scheduled=(ScheduledRequest("a", 8, 3, state.free_block_ids[:1], spec_token_ids=(5, 5)),))
    assert violated_rules(state, plan, config) == []
    assert screened_rules_hold(state, plan, config)


def _followed_states(config, specs):
    """The states an incremental checker follows on a correct fcfs run (each step's ``before``, after arrivals
    and aborts, then its ``after``), with the checker that followed them."""
    checker, states = IncrementalChecker(config), []
    _plain_run(config, specs, checker, states=states)
    return states, checker


def test_the_chain_memo_resumes_at_the_prefix_published_at_the_last_state():
    """Between two states the checker follows, a request that changed has its published chain checked from the
    prefix that was published right in the earlier state (:func:`~schedspec.spec.invariants.published_chain`,
    the definition, run here on that state), so the blocks checked are at most, summed over the changed
    requests, their tables' blocks past that prefix (``_chain_known``: the memo dropped when the published
    prefix exactly fills the computed tokens, or when no output token lies in it)."""
    from schedspec.spec.invariants import published_chain

    for block_size, prompt in ((2, 5), (4, 7), (4, 8)):
        config = CONFIG.with_changes(num_kv_blocks=40, block_size=block_size, max_model_len=64,
                                     max_num_batched_tokens=32, enable_prefix_caching=True)
        specs = [RequestSpec(f"r{i}", prompt + i, 16, arrival_step=i, prefix_group="p", prefix_len=4)
                 for i in range(3)]
        states, checker = _followed_states(config, specs)
        bound = 0
        for old, new in zip(states, states[1:], strict=False):
            for request_id, request in new.requests.items():
                known = old.requests.get(request_id)
                if known is request:
                    continue
                published = 0 if known is None else published_chain(
                    known, old.prefix_cache.block_hashes, block_size)[1]
                bound += max(0, len(request.block_ids) - published)
        assert 0 < checker.chain_blocks <= bound, (block_size, prompt, checker.chain_blocks, bound)


def _published(request, state, block_size):
    """How many leading blocks of the request's table are published right in ``state`` (the definition)."""
    from schedspec.spec.invariants import published_chain

    return published_chain(request, state.prefix_cache.block_hashes, block_size)[1]


def _rolled_back(request, published, size):
    """Its computed tokens rolled back into its last published block (``prefix-published-computed``)."""
    return attrs.evolve(request, num_computed_tokens=published * size - 1)


def _prompt_changed(request, published, size):
    """Its first prompt token changed (a new tuple): its published blocks hold the hashes of other tokens."""
    return attrs.evolve(request, prompt_token_ids=(request.prompt_token_ids[0] + 1, *request.prompt_token_ids[1:]))


def _output_changed(request, published, size):
    """Its first output token changed, when its published blocks hold it (else None)."""
    if published * size - request.prompt_len < 1:
        return None
    return attrs.evolve(request, output_token_ids=(request.output_token_ids[0] + 1, *request.output_token_ids[1:]))


@pytest.mark.parametrize("edit", [_rolled_back, _prompt_changed, _output_changed], ids=lambda f: f.__name__[1:])
def test_a_request_changed_under_its_published_blocks_is_found(edit):
    """A running request whose published blocks no longer match it (its computed tokens rolled back into them, a
    prompt or output token they hold changed) is reported by the incremental checker as by the full check, though
    its table, the cache and the free queue are as a correct step leaves them: the memo of its published chain
    must not be trusted past such a change (``_chain_known``: the tests of the computed tokens, of the prompt and
    of the output tokens, joined with ``and``, loosened, or skipped when the prefix holds one output token)."""
    size = 4
    config = CONFIG.with_changes(num_kv_blocks=40, max_model_len=64, max_num_batched_tokens=32,
                                 enable_prefix_caching=True)
    specs = [RequestSpec(f"r{i}", 7 + i, 12, arrival_step=i, prefix_group="p", prefix_len=4) for i in range(3)]
    made, outputs = 0, set()

    def fault(after, before, checked):
        # the request with the longest published prefix in ``before`` (the checker's memo of it starts there)
        request_id = max(before.requests, key=lambda r: _published(before.requests[r], before, size))
        published = _published(before.requests[request_id], before, size)
        broken = edit(after.requests[request_id], published, size) if published and request_id in after.requests else None
        if broken is None:
            return None
        outputs.add(published * size - before.requests[request_id].prompt_len)
        return attrs.evolve(after, requests={**after.requests, request_id: broken})

    for fault_step in range(1, 14):
        reports = _run_on(config, specs, fault, fault_step, steps=fault_step + 1)  # the fault's step is the last
        if reports is not None:
            assert reports[0]  # both checks found it (prefix-published-computed, and whatever else it breaks)
            made += 1
    assert made
    if edit is _output_changed:
        assert 1 in outputs  # the published prefix held exactly one output token


def test_the_owner_ledger_compares_shared_free_queues_by_their_structure(monkeypatch):
    """Without prefix caching the spec's free queues are :class:`~schedspec.spec.persistent.FreeQueue` values
    sharing their base, and the owner ledger compares each new queue with the old one by that shared structure
    (``FreeQueue.shares_suffix_with``, no Python loop over the kept blocks) on most states it follows, not by the
    general search that plain tuples need (``_queue_follows``: the shortcut left off)."""
    from schedspec.spec.persistent import FreeQueue

    shared = []
    original = FreeQueue.shares_suffix_with

    def recording(queue, previous):
        found = original(queue, previous)
        shared.append(found is not None)
        return found

    monkeypatch.setattr(FreeQueue, "shares_suffix_with", recording)
    states: list = []
    _plain_run(CONFIG, SPECS, IncrementalChecker(CONFIG), states=states)
    # most steps: a queue that a transition rebuilt (a new base) is compared by the search
    assert sum(shared) > len(states) // 2


class _RefollowWatch(IncrementalChecker):
    """An incremental checker that, after each step, follows the state it just followed once more: nothing
    changed, so the ledger proves it again without checking any chain (asserted)."""

    refollowed = 0

    def invariants(self, before, plan, after):
        found = super().invariants(before, plan, after)
        chain_blocks = self.chain_blocks
        assert self._follow_any(after)
        assert self.chain_blocks == chain_blocks
        self.refollowed += any(len(r.block_ids) * self.config.block_size > r.num_computed_tokens
                               for r in after.requests.values())  # a request with a block not yet full
        return found


def test_requests_that_did_not_change_are_not_examined_again():
    """The shared-block ledger examines only the requests that are new values since the last state it followed
    (the memo ``seen``): following the same state twice checks no published chain the second time, though some
    request holds a block not yet full, which a chain check would visit (``_follow_cached``: the memo looked up
    or stored wrong, so every live request is examined at every step)."""
    config = CONFIG.with_changes(num_kv_blocks=16, enable_prefix_caching=True)
    checker = _RefollowWatch(config)
    _plain_run(config, [attrs.evolve(s, prefix_group="p", prefix_len=8) for s in SPECS], checker)
    assert checker.refollowed > 3


def _table_rewritten_past_the_pool(state, before, checked):
    """A request's one-block table (as in ``before``), its block not published, replaced by the id past the pool: the old block is
    released as a correct step releases it (its count dropped, put at the front of the free queue), the new id
    gets no count. Only the range check of the blocks a rewritten table holds sees it (with the reference count
    of the new id, which no changed count names)."""
    from schedspec.spec.prefix_cache import CacheUpdate

    cache = state.prefix_cache
    single = [r for r in state.requests.values() if len(r.block_ids) == 1 and r.block_ids[0] not in cache.block_hashes
              and cache.ref_counts.get(r.block_ids[0]) == 1
              and r.request_id in before.requests and before.requests[r.request_id].block_ids == r.block_ids]
    if not single:
        return None
    request, (block_id,) = single[0], single[0].block_ids
    update = CacheUpdate(cache, state.free_block_ids)
    update._set_count(block_id, 0)
    past = _pool_size(state)
    return attrs.evolve(state, prefix_cache=update.freeze_cache(), free_block_ids=(block_id, *state.free_block_ids),
                        requests={**state.requests, request.request_id: attrs.evolve(request, block_ids=(past,))})


def test_a_table_rewritten_with_an_id_past_the_pool_is_found():
    """With prefix caching a table that is not its old table plus new blocks (a rewrite) is dropped and added
    whole; the blocks added must be range-checked though the counts, the free queue and the hash map agree with
    the ledger (``_follow_cached``: the add skipped once the drop succeeded)."""
    config = CONFIG.with_changes(num_kv_blocks=10, enable_prefix_caching=True)
    specs = [RequestSpec("small", 2, 6, arrival_step=0), *SPECS[:2]]
    made = [reports for step in range(0, 4)
            if (reports := _run_on(config, specs, _table_rewritten_past_the_pool, step, steps=step + 1)) is not None]
    assert made and all(reports[0] for reports in made)


def _ended_keeps_table_and_queue_swapped(state, before, checked):
    """A request that ended in the step keeps its freed table in its record, and the free queue's middle is
    reordered (which the shared-block ledger cannot follow, so the step falls back)."""
    from tests.test_incremental import _ended_keeps_table

    broken = _ended_keeps_table(state, before)
    return None if broken is None else _middle_swapped(broken, before, checked)


def test_after_a_fallback_that_finds_only_an_ended_request_with_blocks_the_ledger_proves_again():
    """A fallback whose only breach is an ended request that still lists blocks (``block-conservation``'s
    terminal case) leaves the ledger sound: it matches the live tables and the free queue, so the next steps are
    proved (the ended request is re-checked on its own at each of them, and reported as the full check reports it)
    (``invariants``: the ledger left unsound after such a fallback, so every later step falls back)."""
    config = CONFIG.with_changes(num_kv_blocks=16, enable_prefix_caching=True)
    specs = [attrs.evolve(s, prefix_group="p", prefix_len=8) for s in SPECS]
    made = 0
    for fault_step in range(2, 10):
        checker = _CountingChecker(config)
        reports = _run_on(config, specs, _ended_keeps_table_and_queue_swapped, fault_step, checker=checker)
        if reports is None:
            continue
        assert all(reports) and len(reports) > 3  # the ended request is reported at every later step
        steps = [step for step, plan, after in _fallback_steps(checker) if not _takes_and_releases(plan, after)]
        assert steps in ([], [fault_step]), fault_step
        made += steps == [fault_step]
    assert made
