"""The shared map of terminal requests behaves as a read-only dict."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from schedspec.spec.request import Request
from schedspec.spec.state import SchedulerState, TerminalRequests


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
    for snapshot, older in history:
        # later additions never change an older map (states share structure)
        assert dict(older.items()) == snapshot


def test_older_states_keep_their_map():
    first = TerminalRequests().with_added({"a": _request("a")})
    second = first.with_added({"b": _request("b")})
    assert set(first) == {"a"} and set(second) == {"a", "b"}


def test_state_converts_plain_dicts_and_compares_by_content():
    state = SchedulerState(finished={"a": _request("a")})
    assert isinstance(state.finished, TerminalRequests)
    assert state == SchedulerState(finished=TerminalRequests().with_added({"a": _request("a")}))
    assert state != SchedulerState()
