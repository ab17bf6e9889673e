"""Containers the spec uses for speed only; nothing here is part of what the spec says.

A reader of the spec can skip this module: :class:`TerminalRequests` behaves as a read-only ``dict``
of terminal requests (and :class:`ArrivedRequests` of live ones after arrivals), :func:`evolve_request` as :func:`attrs.evolve` on a
:class:`~schedspec.spec.request.Request`, and :func:`request_memo` is a cache of values derived from a
request's token ids (never part of its value: not compared, not printed), and :class:`FreeQueue` as the
``tuple`` of free block ids it stands for. Each is tested equal to its plain version
(``tests/test_state.py``). They exist because the lab replays hours of traffic through the spec's
transitions: copying the map of ended requests at every step would make a run quadratic,
``attrs.evolve`` re-runs ``Request.__init__`` (about four times slower) for every scheduled request of
every step, and copying a free queue of tens of thousands of blocks at every step costs more than the
rest of the step.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType

import attrs

from schedspec.spec.request import Request

_NUMBERED = re.compile(r"(.*?)(0|[1-9][0-9]{0,17})")
"""An id as a prefix and a decimal number without leading zeros (``r12`` is ``("r", 12)``, ``r012`` is
``("r0", 12)``): ``prefix + str(number) == id``, so the pair names exactly one id."""


_PROMOTED = object()
"""The mark of a prefix whose numbers are kept in bitmaps (:class:`EndedIds`)."""


@functools.lru_cache(maxsize=4096)
def _numbered(request_id: str) -> tuple[str, int] | None:
    """``(prefix, number)`` of a numbered id (:data:`_NUMBERED`), else ``None``; memoized (the live
    requests' ids are looked up at every step of a check)."""
    found = _NUMBERED.fullmatch(request_id)
    return None if found is None else (found.group(1), int(found.group(2)))


class EndedIds:
    """A set of request ids that only grows, in little memory: the ids of the requests a trace check has
    forgotten (:meth:`TerminalRequests.forgetting`), for ``in`` (the spec refuses a reused id,
    :func:`~schedspec.spec.transitions.add_request`).

    An id that is a prefix and a decimal number (``r17``, ``cmpl-42``: engines and generators number
    their requests) is kept by its prefix: the first :data:`PROMOTE` numbers of a prefix as a small set
    of ints, and from then on as bits of bitmaps of :data:`CHUNK` numbers, so a long run of numbered ids
    costs about one bit each (a chunk of 1,024 bits is 128 bytes plus its dict entry), while ids that share
    no prefix (vLLM's ``cmpl-<hex>-0``, where every id is a prefix of its own) cost one small int each
    beside their prefix, never a bitmap each. Any other id is kept as its string. Exact: no id is ever
    reported present that was not added.
    """

    __slots__ = ("_chunks", "_small", "_other", "_len")

    CHUNK = 1024
    """Numbers per bitmap (bits)."""

    PROMOTE = 64
    """Numbers of one prefix kept as a set of ints before the prefix moves to bitmaps."""

    def __init__(self, ids: Iterable[str] = ()) -> None:
        self._chunks: dict[tuple[str, int], bytearray] = {}
        self._small: dict[str, int | set[int] | object] = {}
        """prefix -> its number, or its numbers while it has fewer than PROMOTE, or _PROMOTED (its bitmaps)."""
        self._other: set[str] = set()
        self._len = 0
        for request_id in ids:
            self.add(request_id)

    def _set_bit(self, prefix: str, number: int) -> bool:
        key, bit = (prefix, number // self.CHUNK), number % self.CHUNK
        chunk = self._chunks.get(key)
        if chunk is None:
            chunk = self._chunks[key] = bytearray(self.CHUNK // 8)
        if chunk[bit >> 3] & (1 << (bit & 7)):
            return False
        chunk[bit >> 3] |= 1 << (bit & 7)
        return True

    def add(self, request_id: str) -> None:
        """Add ``request_id`` (a ``str``; adding one twice keeps one)."""
        found = _numbered(request_id)
        if found is None:
            if request_id not in self._other:
                self._other.add(request_id)
                self._len += 1
            return
        prefix, number = found
        held = self._small.get(prefix)
        if held is _PROMOTED:
            self._len += self._set_bit(prefix, number)
        elif held is None:
            self._small[prefix] = number
            self._len += 1
        elif isinstance(held, int):
            if held != number:
                self._small[prefix] = {held, number}
                self._len += 1
        elif number not in held:
            held.add(number)
            self._len += 1
            if len(held) >= self.PROMOTE:
                self._small[prefix] = _PROMOTED
                for each in held:
                    self._set_bit(prefix, each)

    def __contains__(self, request_id: object) -> bool:
        if not isinstance(request_id, str):
            return False
        found = _numbered(request_id)
        if found is None:
            return request_id in self._other
        prefix, number = found
        held = self._small.get(prefix)
        if held is None:
            return False
        if held is _PROMOTED:
            chunk = self._chunks.get((prefix, number // self.CHUNK))
            bit = number % self.CHUNK
            return chunk is not None and bool(chunk[bit >> 3] & (1 << (bit & 7)))
        return held == number if isinstance(held, int) else number in held

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[str]:
        """The ids, numbered ones by prefix and number, then the others (for tests; a check never lists them)."""
        for prefix, held in sorted(self._small.items(), key=lambda item: item[0]):
            if held is _PROMOTED:
                numbers = (index * self.CHUNK + bit for (p, index), chunk in sorted(self._chunks.items()) if p == prefix
                           for bit in range(self.CHUNK) if chunk[bit >> 3] & (1 << (bit & 7)))
            else:
                numbers = [held] if isinstance(held, int) else sorted(held)
            for number in numbers:
                yield f"{prefix}{number}"
        yield from sorted(self._other)


class TerminalRequests(Mapping[str, Request]):
    """The read-only map of terminal requests, shared between successive states.

    Requests only ever join it, and a run ends tens of thousands of them, so copying it whenever one
    ends would make a run quadratic. :meth:`with_added` returns a new map that shares the old one's
    large base dict (never mutated) and copies only a small dict of recent additions, merged into a new
    base when it grows past the square root of the base: O(sqrt(n)) amortized per addition.

    A trace check of millions of steps cannot hold every ended request either: :meth:`forgetting` gives
    the map with the requests ended so far **forgotten**, their ids kept in an :class:`EndedIds`. Then
    ``len`` and ``in`` count every request that ever ended (``no-request-lost`` counts them, a reused id
    is refused), while indexing and iteration see the requests held, those ended since (the invariants
    look at those; a forgotten request was checked in the step it ended, and no transition of the spec
    changes a terminal request).
    """

    __slots__ = ("_base", "_recent", "_len", "_ended")

    def __init__(self, entries: Mapping[str, Request] | None = None, *,
                 _base: dict[str, Request] | None = None, _recent: dict[str, Request] | None = None,
                 _len: int | None = None, _ended: EndedIds | None = None) -> None:
        self._base = dict(entries) if entries is not None else (_base if _base is not None else {})
        self._recent = _recent if _recent is not None else {}
        self._len = _len if _len is not None else len(self._base) + sum(1 for r in self._recent if r not in self._base)
        self._ended = _ended

    def with_added(self, entries: Mapping[str, Request]) -> TerminalRequests:
        """A new map with ``entries`` added (ids already present are replaced)."""
        if not entries:
            return self
        size = self._len + sum(1 for r in entries if r not in self)
        recent = {**self._recent, **entries}
        if len(recent) ** 2 > len(self._base) + 256:
            return type(self)(_base={**self._base, **recent}, _len=size, _ended=self._ended)
        return type(self)(_base=self._base, _recent=recent, _len=size, _ended=self._ended)

    def forgetting(self) -> TerminalRequests:
        """This map with every request it holds forgotten (class docstring): the same ``len`` and ``in``,
        nothing held. O(held requests). The :class:`EndedIds` is shared with this map and every map made
        from the result, and only grows: ``in`` on a map made before a later :meth:`forgetting` also
        answers ``True`` for ids forgotten after it (:func:`~schedspec.spec.checker.check_trace` forgets
        only while no step has failed, so the states its report keeps are never asked)."""
        if not self._base and not self._recent:
            return self
        ended = self._ended if self._ended is not None else EndedIds()
        for request_id in self:
            ended.add(request_id)
        return TerminalRequests(_len=self._len, _ended=ended)

    @property
    def num_held(self) -> int:
        """The requests held (those iteration and indexing see): ``len`` less those forgotten."""
        return self._len - (len(self._ended) if self._ended is not None else 0)

    def __getitem__(self, request_id: str) -> Request:
        found = self._recent.get(request_id)
        if found is None:
            return self._base[request_id]
        return found

    def __contains__(self, request_id: object) -> bool:
        return (request_id in self._recent or request_id in self._base
                or (self._ended is not None and request_id in self._ended))

    def __iter__(self):
        yield from self._base
        for request_id in self._recent:
            if request_id not in self._base:
                yield request_id

    def __len__(self) -> int:
        return self._len

    def __eq__(self, other: object) -> bool:
        """``Mapping``'s equality (the same entries, in any order), comparing the two plain dicts at C speed
        instead of iterating item by item (states are compared at every step of a checked run)."""
        if other is self:
            return True
        if isinstance(other, TerminalRequests):
            return self._len == other._len and self.as_dict() == other.as_dict()
        if isinstance(other, Mapping):  # forgotten requests count in len but are not held: compare both
            return self._len == len(other) and self.as_dict() == dict(other.items())
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # a mapping, as Mapping says

    def __repr__(self) -> str:
        forgotten = f", forgotten={len(self._ended)}" if self._ended is not None else ""
        return f"{type(self).__name__}({dict(self.items())!r}{forgotten})"

    def as_dict(self) -> dict[str, Request]:
        """A new plain ``dict`` of the same entries, in the same order."""
        return {**self._base, **self._recent}


class ArrivedRequests(TerminalRequests):
    """The read-only map of live requests after arrivals, shared with the map before them.

    :func:`~schedspec.spec.transitions.add_request` adds one request to the live map; copying the map
    at every arrival would make a burst of ``n`` arrivals cost O(n^2) (a scenario whose requests all
    arrive at step 0). Arrivals only add, so the map is a :class:`TerminalRequests`; a step or an abort,
    which also change and remove requests, build a plain map again.
    """

    __slots__ = ()


SHARED_FROM = 512
"""Live maps of at least this many requests are extended by sharing (:func:`with_arrival`); smaller
ones are copied (a copy of a few hundred entries is cheaper than a shared map's slower lookups)."""


def with_arrival(requests: Mapping[str, Request], request: Request) -> Mapping[str, Request]:
    """``{**requests, request.request_id: request}``, read-only: a new ``MappingProxyType`` for a small
    map, an :class:`ArrivedRequests` sharing ``requests``' entries for a large one (O(sqrt(n))
    amortized per arrival instead of O(n))."""
    if isinstance(requests, ArrivedRequests):
        return requests.with_added({request.request_id: request})
    if len(requests) < SHARED_FROM:
        return MappingProxyType({**requests, request.request_id: request})
    return ArrivedRequests(requests).with_added({request.request_id: request})


def live_copy(requests: Mapping[str, Request]) -> dict[str, Request]:
    """A new plain ``dict`` of the live map ``requests`` (``dict(requests)``; an :class:`ArrivedRequests`
    copies its two parts at C speed instead of iterating), for an action that changes or removes requests."""
    return requests.as_dict() if isinstance(requests, ArrivedRequests) else dict(requests)


def terminal_requests(mapping: Mapping[str, Request]) -> TerminalRequests:
    """``mapping`` as a :class:`TerminalRequests` (itself if it already is one)."""
    return mapping if isinstance(mapping, TerminalRequests) else TerminalRequests(mapping)


_FIXED = frozenset({"prompt_token_ids", "prompt_len", "num_tokens"})
_SETTABLE = frozenset(field.name for field in attrs.fields(Request)) - _FIXED


def evolve_request(request: Request, **changes: object) -> Request:
    """``attrs.evolve(request, **changes)`` without re-running ``Request.__init__``: a copy of the
    request's fields with ``changes`` applied. The prompt cannot be changed this way (its derived
    ``prompt_len`` would go stale); nor does a request's prompt ever change. The derived ``num_tokens``
    follows ``output_token_ids``.

    Raises:
        TypeError: a name that is not a field, or ``prompt_token_ids``/``prompt_len``/``num_tokens``.
    """
    if not _SETTABLE.issuperset(changes):
        name = next(name for name in changes if name not in _SETTABLE)
        raise TypeError(f"evolve_request: cannot set {name!r}")
    fields = request.__dict__
    new = object.__new__(Request)
    values = new.__dict__
    values.update(fields)
    values.update(changes)
    if "output_token_ids" in changes:
        values["num_tokens"] = fields["prompt_len"] + len(changes["output_token_ids"])
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


class FreeQueue(Sequence[int]):
    """The free queue of a state without prefix caching: an immutable sequence of block ids that behaves
    as the ``tuple`` it stands for (``==`` and ``hash`` as that tuple, slices return tuples, ``repr`` is
    the tuple's) and shares structure with the queue it was made from.

    A step takes blocks from the front of the free queue and puts released blocks back at its front;
    copying a queue of tens of thousands of blocks at every step (``tuple(...)``) would cost more than the
    rest of the step. A ``FreeQueue`` is ``front + base[offset:]``: a short tuple of blocks put back,
    then a long tuple shared with the earlier queues. Taking ``k`` blocks from the front moves ``offset``
    (O(1) once ``front`` is used up), putting ``k`` blocks back copies ``front`` only; ``front`` is merged
    into a new base when it grows past the square root of the queue (O(sqrt(n)) amortized per block), and
    the base is cut when more than half of it is used up (O(1) amortized).
    """

    __slots__ = ("_front", "_base", "_offset")

    def __init__(self, blocks: Iterable[int] = ()) -> None:
        self._front: tuple[int, ...] = ()
        self._base: tuple[int, ...] = tuple(blocks)
        self._offset = 0

    @classmethod
    def _make(cls, front: tuple[int, ...], base: tuple[int, ...], offset: int) -> FreeQueue:
        size = len(front) + len(base) - offset
        if offset and offset * 2 > len(base):
            front, base, offset = (), front + base[offset:], 0
        elif len(front) > 64 and len(front) ** 2 > size:
            front, base, offset = (), front + base[offset:], 0
        queue = object.__new__(cls)
        queue._front, queue._base, queue._offset = front, base, offset
        return queue

    @classmethod
    def of(cls, blocks: Sequence[int]) -> FreeQueue:
        """``blocks`` as a ``FreeQueue`` (itself if it already is one)."""
        return blocks if isinstance(blocks, FreeQueue) else cls(blocks)

    def pushed_front(self, blocks: Sequence[int]) -> FreeQueue:
        """``tuple(blocks) + self``."""
        if not blocks:
            return self
        return FreeQueue._make(tuple(blocks) + self._front, self._base, self._offset)

    def without(self, taken: Sequence[int]) -> FreeQueue:
        """This queue less the blocks in ``taken`` (usually its first ``len(taken)`` blocks, as allocation
        takes from the front: then nothing is copied but the front)."""
        if not taken:
            return self
        count = len(taken)
        if self[:count] == tuple(taken):
            front = self._front
            if count <= len(front):
                return FreeQueue._make(front[count:], self._base, self._offset)
            return FreeQueue._make((), self._base, self._offset + count - len(front))
        gone = set(taken)
        return FreeQueue(block_id for block_id in self if block_id not in gone)

    def shares_suffix_with(self, previous: FreeQueue) -> tuple[int, int] | None:
        """``(n, start)`` such that ``self == self[:n] + previous[start:]`` by shared structure (the same
        base, no element compared), or ``None`` when the two share no base this way."""
        if self._base is not previous._base or self._offset < previous._offset:
            return None
        return len(self._front), len(previous._front) + self._offset - previous._offset

    def __len__(self) -> int:
        return len(self._front) + len(self._base) - self._offset

    def __iter__(self) -> Iterator[int]:
        yield from self._front
        base = self._base
        for index in range(self._offset, len(base)):
            yield base[index]

    def __getitem__(self, index):
        front, base, offset = self._front, self._base, self._offset
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return tuple(self)[index]
            if stop <= start:
                return ()
            split = len(front)
            if stop <= split:
                return front[start:stop]
            if start >= split:
                return base[offset + start - split:offset + stop - split]
            return front[start:] + base[offset:offset + stop - split]
        if index < 0:
            index += len(self)
            if index < 0:
                raise IndexError("FreeQueue index out of range")
        if index < len(front):
            return front[index]
        position = offset + index - len(front)
        if position >= len(base):
            raise IndexError("FreeQueue index out of range")
        return base[position]

    def index(self, value: object, start: int = 0, stop: int | None = None) -> int:
        if start or stop is not None:
            return tuple(self).index(value, start, *(() if stop is None else (stop,)))
        front = self._front
        if value in front:
            return front.index(value)
        try:
            return self._base.index(value, self._offset) - self._offset + len(front)
        except ValueError:
            raise ValueError(f"{value!r} is not in the free queue") from None

    def __contains__(self, value: object) -> bool:
        try:
            self.index(value)
        except ValueError:
            return False
        return True

    def count(self, value: object) -> int:
        return self._front.count(value) + (self._base[self._offset:].count(value) if self._offset else self._base.count(value))

    def _as_tuple(self) -> tuple[int, ...]:
        if not self._front and not self._offset:
            return self._base
        return self._front + self._base[self._offset:]

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        if isinstance(other, FreeQueue):
            if len(other) != len(self):
                return False
            if other._base is self._base and other._offset == self._offset and other._front == self._front:
                return True
            return self._as_tuple() == other._as_tuple()
        if isinstance(other, tuple):
            return len(other) == len(self) and self._as_tuple() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._as_tuple())

    def __add__(self, other: object):
        if isinstance(other, (tuple, FreeQueue)):
            return self._as_tuple() + tuple(other)
        return NotImplemented

    def __radd__(self, other: object):
        if isinstance(other, tuple):
            return self.pushed_front(other)
        return NotImplemented

    def __reduce__(self):
        return (FreeQueue, (self._as_tuple(),))

    def __repr__(self) -> str:
        return repr(self._as_tuple())
