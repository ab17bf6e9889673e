"""Containers the spec uses for speed only; nothing here is part of what the spec says.

A reader of the spec can skip this module: :class:`TerminalRequests` behaves as a read-only ``dict``
of terminal requests, :func:`evolve_request` as :func:`attrs.evolve` on a
:class:`~schedspec.spec.request.Request`, and :func:`request_memo` is a cache of values derived from a
request's token ids (never part of its value: not compared, not printed). Both are tested equal to those plain versions
(``tests/test_state.py``). They exist because the lab replays hours of traffic through the spec's
transitions: copying the map of ended requests at every step would make a run quadratic, and
``attrs.evolve`` re-runs ``Request.__init__`` (about four times slower) for every scheduled request of
every step.
"""

from __future__ import annotations

from collections.abc import Mapping

from schedspec.spec.request import Request


class TerminalRequests(Mapping[str, Request]):
    """The read-only map of terminal requests, shared between successive states.

    Requests only ever join it, and a run ends tens of thousands of them, so copying it whenever one
    ends would make a run quadratic. :meth:`with_added` returns a new map that shares the old one's
    large base dict (never mutated) and copies only a small dict of recent additions, merged into a new
    base when it grows past the square root of the base: O(sqrt(n)) amortized per addition.
    """

    __slots__ = ("_base", "_recent", "_len")

    def __init__(self, entries: Mapping[str, Request] | None = None, *,
                 _base: dict[str, Request] | None = None, _recent: dict[str, Request] | None = None,
                 _len: int | None = None) -> None:
        self._base = dict(entries) if entries is not None else (_base if _base is not None else {})
        self._recent = _recent if _recent is not None else {}
        self._len = _len if _len is not None else len(self._base) + sum(1 for r in self._recent if r not in self._base)

    def with_added(self, entries: Mapping[str, Request]) -> TerminalRequests:
        """A new map with ``entries`` added (ids already present are replaced)."""
        if not entries:
            return self
        size = self._len + sum(1 for r in entries if r not in self)
        recent = {**self._recent, **entries}
        if len(recent) ** 2 > len(self._base) + 256:
            return TerminalRequests(_base={**self._base, **recent}, _len=size)
        return TerminalRequests(_base=self._base, _recent=recent, _len=size)

    def __getitem__(self, request_id: str) -> Request:
        found = self._recent.get(request_id)
        if found is None:
            return self._base[request_id]
        return found

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._recent or request_id in self._base

    def __iter__(self):
        yield from self._base
        for request_id in self._recent:
            if request_id not in self._base:
                yield request_id

    def __len__(self) -> int:
        return self._len

    def __repr__(self) -> str:
        return f"TerminalRequests({dict(self.items())!r})"


def terminal_requests(mapping: Mapping[str, Request]) -> TerminalRequests:
    """``mapping`` as a :class:`TerminalRequests` (itself if it already is one)."""
    return mapping if isinstance(mapping, TerminalRequests) else TerminalRequests(mapping)


_FIXED = frozenset({"prompt_token_ids", "prompt_len"})


def evolve_request(request: Request, **changes: object) -> Request:
    """``attrs.evolve(request, **changes)`` without re-running ``Request.__init__``: a copy of the
    request's fields with ``changes`` applied. The prompt cannot be changed this way (its derived
    ``prompt_len`` would go stale); nor does a request's prompt ever change.

    Raises:
        TypeError: a name that is not a field, or ``prompt_token_ids``/``prompt_len``.
    """
    fields = request.__dict__
    for name in changes:
        if name not in fields or name in _FIXED:
            raise TypeError(f"evolve_request: cannot set {name!r}")
    new = object.__new__(Request)
    new.__dict__.update(fields)
    new.__dict__.update(changes)
    return new


def request_memo(request: Request, name: str) -> dict:
    """A memo dict named ``name`` carried by ``request`` and shared by every later version of it made by
    :func:`evolve_request` (which copies the request's attributes). For values that depend only on token
    positions the request already has (they never change: outputs are only appended). Not a field:
    ``==``, ``repr`` and :func:`attrs.evolve` ignore it (a plain copy merely starts a new memo)."""
    key = "_memo_" + name
    memo = request.__dict__.get(key)
    if memo is None:
        memo = request.__dict__[key] = {}
    return memo
