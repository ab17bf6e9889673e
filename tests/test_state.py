"""The speed-only containers of spec/persistent.py behave as their plain versions: the shared map of
terminal requests as a read-only dict, ``evolve_request`` as ``attrs.evolve``."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedspec.spec.persistent import EndedIds, TerminalRequests, evolve_request
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.state import SchedulerState


def _request(request_id: str, max_tokens: int = 1) -> Request:
    return Request(request_id, 0, (1, 2), max_tokens)


@given(st.lists(st.lists(st.tuples(st.sampled_from("abcdefghij"), st.integers(1, 9)), max_size=6), max_size=40))
def test_with_added_matches_a_dict(batches):
    mirror: dict[str, Request] = {}
    terminal = TerminalRequests()
    history = []
    for batch in batches:
        entries = {request_id: _request(request_id, n) for request_id, n in batch}
        terminal = terminal.with_added(entries)
        mirror.update(entries)
        history.append((dict(mirror), terminal))
        assert dict(terminal.items()) == mirror
        assert len(terminal) == len(mirror)
        assert list(terminal) == list(dict.fromkeys(list(terminal)))  # no id twice
        assert all(request_id in terminal for request_id in mirror)
        assert "zz" not in terminal
        assert terminal == mirror and mirror == terminal and terminal == TerminalRequests(mirror)
        assert terminal != {**mirror, "zz": _request("zz")} and terminal != TerminalRequests({**mirror, "zz": _request("zz")})
        if mirror:
            changed = {**mirror, next(iter(mirror)): _request("other")}
            assert terminal != changed and terminal != TerminalRequests(changed)
    for snapshot, older in history:
        # later additions never change an older map (states share structure)
        assert dict(older.items()) == snapshot


_IDS = st.one_of(
    st.builds(lambda p, n: f"{p}{n}", st.sampled_from(["r", "r0", "cmpl-", "", "x-1-"]), st.integers(0, 5000)),
    st.builds(lambda p, n: f"{p}{n:04d}", st.sampled_from(["r", ""]), st.integers(0, 99)),  # leading zeros
    st.text(max_size=6),
)


@given(st.lists(_IDS, max_size=80), st.lists(_IDS, max_size=40))
def test_ended_ids_are_exactly_a_set(added, probes):
    """EndedIds stores numbered ids as bits: it answers ``in`` exactly as a set of the same strings (never a
    false present: a reused id would be reported for a fresh one), counts each id once, lists them all."""
    ids, mirror = EndedIds(), set()
    for request_id in added:
        ids.add(request_id)
        mirror.add(request_id)
        assert len(ids) == len(mirror)
    for request_id in [*added, *probes, "r01", "r1", "r001", "1", "01", "", "r", 7]:
        assert (request_id in ids) == (request_id in mirror), request_id
    assert sorted(ids) == sorted(mirror)


def test_ended_ids_keep_a_run_of_numbered_ids_in_bits():
    ids = EndedIds(f"r{n}" for n in range(100_000))
    assert len(ids) == 100_000 and "r99999" in ids and "r100000" not in ids and "r099" not in ids
    assert len(ids._chunks) == 98 and not ids._other  # 100,000 / 1,024 bitmaps of 128 bytes, no strings



@given(st.lists(st.tuples(st.sampled_from(["r", "cmpl-", "a1b-"]), st.integers(0, 5_000)), max_size=300),
       st.lists(st.tuples(st.sampled_from(["r", "cmpl-", "x"]), st.integers(0, 5_000)), max_size=50))
def test_ended_ids_are_exactly_a_set_across_promotion_to_bitmaps(added, probes):
    """Past PROMOTE numbers of one prefix the ids move from a small set to bitmaps: still exactly a set
    (PROMOTE lowered to 4 so that the examples cross it)."""

    class Promoting(EndedIds):
        PROMOTE = 4

    ids, mirror = Promoting(), set()
    for prefix, number in added:
        ids.add(f"{prefix}{number}")
        mirror.add(f"{prefix}{number}")
        assert len(ids) == len(mirror)
    for prefix, number in [*added, *probes]:
        assert (f"{prefix}{number}" in ids) == (f"{prefix}{number}" in mirror)
    assert sorted(ids) == sorted(mirror)


def test_ended_ids_of_distinct_prefixes_make_no_bitmaps():
    """vLLM's ids (``cmpl-<hex>-0``: every id a prefix of its own) cost a small int each, not a 128-byte bitmap."""
    ids = EndedIds(f"cmpl-{n:032x}-0" for n in range(2_000))
    assert len(ids) == 2_000 and "cmpl-" + f"{7:032x}" + "-0" in ids and "cmpl-" + f"{7:032x}" + "-1" not in ids
    assert not ids._chunks and not ids._other

def test_forgetting_keeps_len_and_membership_and_holds_nothing():
    terminal = TerminalRequests().with_added({"r1": _request("r1"), "a": _request("a")})
    forgot = terminal.forgetting()
    assert len(forgot) == 2 and forgot.num_held == 0 and list(forgot) == [] and "r1" in forgot and "a" in forgot
    assert "r2" not in forgot and forgot.get("r1") is None
    later = forgot.with_added({"r2": _request("r2")})
    assert len(later) == 3 and later.num_held == 1 and list(later) == ["r2"] and "r1" in later
    again = later.forgetting()
    assert len(again) == 3 and again.num_held == 0 and all(r in again for r in ("r1", "r2", "a"))
    assert dict(terminal.items()) == {"r1": _request("r1"), "a": _request("a")}  # the map forgotten is unchanged
    assert forgot.forgetting() is forgot  # nothing held: nothing to do


def test_older_states_keep_their_map():
    first = TerminalRequests().with_added({"a": _request("a")})
    second = first.with_added({"b": _request("b")})
    assert set(first) == {"a"} and set(second) == {"a", "b"}


def test_state_converts_plain_dicts_and_compares_by_content():
    state = SchedulerState(finished={"a": _request("a")})
    assert isinstance(state.finished, TerminalRequests)
    assert state == SchedulerState(finished=TerminalRequests().with_added({"a": _request("a")}))
    assert state != SchedulerState()


_CHANGES = st.fixed_dictionaries({}, optional={
    "status": st.sampled_from(list(RequestStatus)),
    "finish_reason": st.none() | st.text(max_size=5),
    "num_computed_tokens": st.integers(0, 50),
    "output_token_ids": st.lists(st.integers(0, 9), max_size=4).map(tuple),
    "block_ids": st.lists(st.integers(0, 9), max_size=4).map(tuple),
    "num_preemptions": st.integers(0, 3),
    "admitted_step": st.none() | st.integers(0, 9),
    "first_token_step": st.none() | st.integers(0, 9),
})


@given(_CHANGES)
def test_evolve_request_equals_attrs_evolve(changes):
    request = Request("a", 3, (5, 6, 7), 4, stop_token_ids=(9,), min_tokens=1)
    fast = evolve_request(request, **changes)
    plain = attrs.evolve(request, **changes)
    assert fast == plain
    assert {f.name: getattr(fast, f.name) for f in attrs.fields(Request)} == {
        f.name: getattr(plain, f.name) for f in attrs.fields(Request)}
    assert request == Request("a", 3, (5, 6, 7), 4, stop_token_ids=(9,), min_tokens=1)  # the original is unchanged


def test_evolve_request_refuses_the_prompt_and_unknown_names():
    request = Request("a", 0, (1, 2), 1)
    for name in ("prompt_token_ids", "prompt_len", "no_such_field"):
        with pytest.raises(TypeError, match=name):
            evolve_request(request, **{name: 1})


def test_request_memo_is_shared_by_later_versions_and_is_not_part_of_the_value():
    from schedspec.spec.persistent import request_memo

    request = Request("a", 0, (1, 2, 3), 4)
    request_memo(request, "x")["k"] = 1
    later = evolve_request(request, num_computed_tokens=2)
    assert request_memo(later, "x") == {"k": 1}
    assert request == Request("a", 0, (1, 2, 3), 4)  # the memo is not compared
    assert "_memo_" not in repr(request)
    assert request_memo(attrs.evolve(request), "x") == {}  # a plain copy starts a new memo


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 300), st.lists(st.tuples(st.sampled_from(["push", "take", "without", "flat"]),
                                               st.integers(0, 80)), max_size=40), st.randoms())
def test_free_queue_behaves_as_its_tuple(size: int, operations, rng) -> None:
    """FreeQueue (spec.persistent) is the tuple it stands for under every operation a step applies, and
    for every read (len, items, slices, index, membership, ==, hash, repr, +, pickle)."""
    import pickle

    from schedspec.spec.persistent import FreeQueue

    plain = tuple(range(size))
    queue = FreeQueue(plain)
    next_block = size
    earlier = []
    for name, amount in operations:
        if name == "push":
            blocks = tuple(range(next_block, next_block + amount))
            next_block += amount
            plain, queue = blocks + plain, queue.pushed_front(blocks)
        elif name == "take":
            taken = plain[:amount]
            plain, queue = plain[len(taken):], queue.without(list(taken))
        elif name == "without":
            taken = rng.sample(plain, min(amount, len(plain)))
            plain, queue = tuple(b for b in plain if b not in set(taken)), queue.without(taken)
        else:
            plain, queue = plain, FreeQueue.of(tuple(queue))
        earlier.append((plain, queue))
        assert queue == plain and plain == queue and not (queue != plain)
        assert len(queue) == len(plain) and tuple(queue) == plain and list(queue) == list(plain)
        assert hash(queue) == hash(plain) and repr(queue) == repr(plain)
        for start in (0, 1, amount, len(plain) // 2, -3):
            for stop in (None, start + amount, len(plain), -1):
                assert queue[start:stop] == plain[start:stop]
        assert queue[::2] == plain[::2]
        if plain:
            index = amount % len(plain)
            assert queue[index] == plain[index] and queue[-1 - index] == plain[-1 - index]
            assert queue.index(plain[index]) == index and plain[index] in queue
        assert -1 not in queue and queue.count(0) == plain.count(0)
        assert (7, 8) + queue == (7, 8) + plain and queue + (7,) == plain + (7,)
        assert pickle.loads(pickle.dumps(queue)) == plain
    for plain, queue in earlier:  # older versions are unchanged by later operations
        assert queue == plain
    with pytest.raises(IndexError):
        FreeQueue(range(3))[3]


def test_free_queue_compares_unequal_when_it_differs() -> None:
    from schedspec.spec.persistent import FreeQueue

    queue = FreeQueue(range(10)).without([0, 1]).pushed_front((1,))
    assert queue != tuple(range(10)) and queue != (1, *range(3, 10)) and queue == (1, *range(2, 10))
    assert queue.shares_suffix_with(FreeQueue(range(10))) is None


def test_num_tokens_follows_the_outputs() -> None:
    """``Request.num_tokens`` is kept, not computed: it must follow ``output_token_ids`` through
    ``attrs.evolve`` and ``evolve_request`` (spec.persistent) alike."""
    request = Request("a", 0, [1, 2, 3], 10)
    assert request.num_tokens == 3
    for evolve in (attrs.evolve, evolve_request):
        grown = evolve(request, output_token_ids=(4, 5))
        assert grown.num_tokens == 5 == grown.prompt_len + len(grown.output_token_ids)
        assert evolve(grown, num_computed_tokens=4).num_tokens == 5
    with pytest.raises(TypeError):
        evolve_request(request, num_tokens=7)
