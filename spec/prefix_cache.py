"""Prefix caching (automatic prefix caching, vLLM "APC"): cached KV blocks, their hashes and reference
counts, and the lookup at admission.

With ``enable_prefix_caching`` a full KV block is identified by a **chained hash** of its token ids and
the hash of the block before it (vLLM 0.32 ``vllm/v1/core/kv_cache_utils.py`` ``hash_block_tokens``),
so equal hashes mean equal prefixes. A block is **published** (gets its hash) at the end of the step
that computed its last token; from then on a request admitted with the same prefix may reuse it instead
of computing it again (a **hit**). Blocks are **shared**: a block's reference count is the number of
live block tables holding it (vLLM ``KVCacheBlock.ref_cnt``). A block whose count drops to 0 keeps its
hash and becomes **evictable**: it sits in the free queue and is counted as free, and a hit takes it
back out (vLLM ``BlockPool.touch``); handing it out as a new block drops its hash (an **eviction**,
vLLM ``BlockPool.get_new_blocks`` -> ``_maybe_evict_cached_block``).

Every block is in exactly one of: **free** (in the free queue, no hash), **evictable** (in the free
queue, with a hash), **held** (reference count >= 1, not in the free queue).

The free queue is :attr:`SchedulerState.free_block_ids`; its order with caching on is vLLM's
(``BlockPool.free_blocks``): a released block table is walked last block first
(``SingleTypeKVCacheManager.free``); blocks reaching count 0 **without** a hash go to the **front**
(LIFO, ``prepend_n``), blocks **with** a hash to the **back** (``append_n``, "FIFO reuse of cached
blocks for LRU eviction behavior"). Allocation takes from the front. So never-cached blocks are handed
out first, then cached blocks least recently released first, and of one request's cached blocks the
tail blocks before the head blocks (they are the least likely to be hit). Without any hash this is
exactly the caching-off order.

Where the spec differs from vLLM 0.32, on purpose:

- **Publication time.** vLLM publishes at scheduling time (``KVCacheManager.allocate_slots`` calls
  ``cache_blocks`` for the computed plus scheduled tokens before the forward pass), so a request
  admitted later in the same step can hit blocks that are being computed in that step. The spec
  publishes at the end of the step (:meth:`CacheUpdate.publish`): a block is reused only once its KV
  exists. The hash table after each step is the same; only such same-step hits differ.
- **Hash function.** blake2b (16-byte digest, hex) over the parent hash and the token ids, with a fixed
  root, so traces are reproducible across processes (vLLM seeds ``NONE_HASH`` at random unless
  ``PYTHONHASHSEED`` is set, and hashes with sha256 of a pickle or CBOR encoding). No extra keys
  (LoRA, multimodal, cache salt): the spec has none of them.

Two requests that compute the same new prefix in the same step (or one before the other's blocks are
published) each compute and publish their own copy: the spec allows **duplicate** cached blocks for one
hash, as vLLM does (``block_pool.py`` ``BlockHashToBlockMap``, NOTE #1: no de-duplication, so that
block tables stay append-only). A lookup takes the first published copy (``get_one_block``).

**SGLang's publication** (``SchedulerConfig.prefix_cache_publication == "sglang-radix"``, SGLang 0.5.23
``mem_cache/radix_cache.py`` ``RadixCache``): a prefill chunk's blocks are published at the end of its step, a
decode's only when its request finishes (:func:`publishes_at_step`), and a prefill chunk's publication may
**de-duplicate** (``ScheduledRequest.deduplicated_block_ids``: the request's copy freed, the cached block in its
place, as ``RadixCache.checkpoint`` does). SGLang's tree holds one page per prefix; the spec's cache holds at
least what the tree holds: at a finish SGLang frees the request's copies of tokens its tree holds, which the
spec keeps cached (evictable, counted free either way, so no count differs: the table is released at once), and
SGLang evicts whole leaves when it allocates (``RadixCache.evict``), where the spec drops a hash only when its
block is handed out. So a hit is bounded by the spec's cache, not equal to the longest chain in it
(``prefix-hit-longest`` does not apply), and a de-duplication names a cached block of the spec's.

With hybrid KV cache groups (:mod:`~schedspec.spec.kv_cache_groups`) the cache is keyed by group, as vLLM keys it
(``BlockHashWithGroupId``): a block of group ``g > 0`` is published under :func:`group_cache_key` of its chained
hash and ``g``, so the maps below hold every group's blocks, each under its own key.

The data here is plain and immutable (:class:`PrefixCache`); :class:`CacheUpdate` is the working copy
one transition (or a policy planning one step) edits and then freezes.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType

import attrs
import numpy as np

from schedspec.spec.persistent import request_memo
from schedspec.spec.request import Request, RequestStatus
from schedspec.spec.workload import token_ids

ROOT_HASH = ""
"""The parent hash of a request's first block (vLLM ``NONE_HASH``, fixed here)."""

_EMPTY: Mapping = MappingProxyType({})

NULL_BLOCK = -1
"""The table entry of a block a sliding window freed (vLLM ``BlockPool.null_block``, never handed out, never
counted among the ``num_kv_blocks``; :mod:`~schedspec.spec.kv_cache_groups`). No cache operation touches it."""


def group_cache_key(hash_value: str, group: int) -> str:
    """The key under which a block of KV cache group ``group`` is cached: the chained hash itself for group 0 (so
    a config without groups keys as before), ``"<hash>@<group>"`` for groups 1.. . vLLM ``kv_cache_utils.py``
    ``make_block_hash_with_group_id`` (the hash followed by the group id): a lookup in one group never finds a
    block of another (:mod:`~schedspec.spec.kv_cache_groups`)."""
    return hash_value if group == 0 else f"{hash_value}@{group}"


def block_hash(parent: str, token_ids: Sequence[int] | np.ndarray) -> str:
    """The hash of one full block: blake2b (16-byte digest) over the parent block's hash and the block's
    token ids as little-endian int64 (whatever integer type holds them), as a 32-character hex string.

    Args:
        parent: the hash of the block before it in the request's sequence, :data:`ROOT_HASH` for block 0.
        token_ids: the block's ``block_size`` token ids.

    Source: vLLM 0.32 ``kv_cache_utils.py`` ``hash_block_tokens(hash_function, parent_block_hash,
    curr_block_token_ids)`` (chained; differences in the module docstring).
    """
    digest = hashlib.blake2b(parent.encode(), digest_size=16)  # a hash is hex (plus "|lora:<id>"): ASCII
    digest.update(b"|")
    digest.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return digest.hexdigest()


def request_block_hashes(request: Request, num_blocks: int, block_size: int) -> list[str]:
    """The chained hashes of the request's first ``num_blocks`` blocks (:func:`request_block_hash` from
    :data:`ROOT_HASH`), in order: the one definition of "the hashes of a request's prefix" that the hit and
    publication checks of KV cache groups and SGLang's de-duplication read."""
    hashes: list[str] = []
    parent = ROOT_HASH
    for index in range(num_blocks):
        parent = request_block_hash(request, index, parent, block_size)
        hashes.append(parent)
    return hashes


def request_block_hash(request: Request, index: int, parent: str, block_size: int) -> str:
    """The hash of block ``index`` of the request's sequence (prompt plus output), given its parent's:
    ``block_hash(parent, token ids of positions [index * block_size, (index + 1) * block_size))``, with the
    request's LoRA adapter (``lora_int_id``, when set) in the first block's key, as vLLM keys blocks by adapter.

    Memoized per request (:func:`~schedspec.spec.persistent.request_memo`, speed only): a request's token
    ids at a position never change (outputs are only appended, and kept through a preemption), so every
    later version of the request shares the memo (keyed by block size and index, checked against the
    parent)."""
    memo = request_memo(request, "prefix_block_hashes")
    key = (block_size, index)
    found = memo.get(key)
    if found is not None and found[0] == parent:
        return found[1]
    start = index * block_size
    # a LoRA adapter is part of the first block's key, so no prefix is shared across adapters (vLLM puts
    # ("lora", name, path) into every block's extra keys: kv_cache_utils.py generate_block_hash_extra_keys;
    # the chain carries the first block's key into every later one)
    keyed = f"{parent}|lora:{request.lora_int_id}" if index == 0 and request.lora_int_id else parent
    value = block_hash(keyed, token_ids(request, start, start + block_size))
    memo[key] = (parent, value)
    return value


def max_hit_blocks(request: Request, block_size: int) -> int:
    """Most blocks a hit may cover: ``(num_tokens - 1) // block_size``, so that at least one token is
    still computed and the model produces logits to sample from (vLLM 0.32 ``kv_cache_manager.py``
    ``KVCacheManager.get_computed_blocks``: ``max_cache_hit_length = request.num_tokens - 1``; "when all
    tokens hit the cache, we must recompute the last token to obtain logits", which with a block-aligned
    hit recomputes the whole last block)."""
    return max(request.num_tokens - 1, 0) // block_size


def publishes_at_step(request: Request, config) -> bool:
    """Whether a scheduled item of ``request`` (as it was before the step) publishes its full computed blocks at
    the end of its step, by ``config.prefix_cache_publication``: always with vLLM's (``BlockPool.cache_full_blocks``
    for every scheduled request); with SGLang's (``"sglang-radix"``) for a prefill chunk only, not for a decode
    (the request runs and its one pending token is a sampled output), whose blocks are published when it finishes
    (SGLang 0.5.23 ``Scheduler.process_batch_result_prefill`` -> ``RadixCache.cache_unfinished_req``;
    ``process_batch_result_decode`` inserts nothing until ``cache_finished_req``). A running request whose last
    prefill chunk is a single token counts as a decode here (SGLang's extend would publish it)."""
    if config.prefix_cache_publication == "vllm":
        return True
    return not (request.status is RequestStatus.RUNNING and request.output_token_ids
                and request.num_computed_tokens == request.num_tokens - 1)


@attrs.frozen(slots=True)
class CacheChanges:
    """What one :class:`CacheUpdate` changed: the new cache equals ``base`` (a weak reference: the cache
    it was made from, or ``None`` once that is gone) but possibly at these keys of each mapping.
    Recorded by the working copy's only writers (:meth:`CacheUpdate._set_count`,
    :meth:`CacheUpdate._set_hash`, :meth:`CacheUpdate._set_listed`: each logs the key it writes in the
    statement that writes it), so that a checker can follow the cache in O(changed keys) per step
    (:class:`~schedspec.spec.incremental.IncrementalChecker`) without trusting what a transition says
    it did: whatever value a write puts there, its key is logged.

    Attributes:
        base: weak reference to the :class:`PrefixCache` the changes are relative to.
        block_hashes: block ids whose entry of ``block_hashes`` may differ from ``base``'s.
        hash_to_blocks: hashes whose entry of ``hash_to_blocks`` may differ.
        ref_counts: block ids whose entry of ``ref_counts`` may differ.
    """

    base: weakref.ref
    block_hashes: frozenset[int]
    hash_to_blocks: frozenset[str]
    ref_counts: frozenset[int]


@attrs.frozen(slots=True, weakref_slot=True)
class PrefixCache:
    """The prefix cache's bookkeeping in a :class:`~schedspec.spec.state.SchedulerState` (caching on).

    Attributes:
        block_hashes: block id -> its hash, for every published block (held or evictable). A block with
            no entry has no hash (vLLM ``KVCacheBlock.block_hash``).
        hash_to_blocks: hash -> the blocks carrying it, in the order they were published (duplicates
            allowed; vLLM ``BlockPool.cached_block_hash_to_block``).
        ref_counts: block id -> number of live block tables holding it; a block with no entry has 0
            (vLLM ``KVCacheBlock.ref_cnt``).
        changes: how this cache differs from the one it was made from (:class:`CacheChanges`; ``None``
            for a cache not made by :meth:`CacheUpdate.freeze_cache`). Not part of the value: equality
            ignores it; not an argument of the constructor, so that a copy made by ``attrs.evolve`` (whose
            mappings may differ at keys never logged) starts with ``None`` and a checker following the log
            rechecks it whole.
    """

    block_hashes: Mapping[int, str] = _EMPTY
    hash_to_blocks: Mapping[str, tuple[int, ...]] = _EMPTY
    ref_counts: Mapping[int, int] = _EMPTY
    changes: CacheChanges | None = attrs.field(default=None, init=False, eq=False, repr=False)

    def cached_block(self, hash_value: str, excluded: frozenset[int] | set[int] = frozenset()) -> int | None:
        """The first published block carrying ``hash_value`` and not in ``excluded``, or ``None``."""
        for block_id in self.hash_to_blocks.get(hash_value, ()):
            if block_id not in excluded:
                return block_id
        return None

    def longest_hit(self, request: Request, block_size: int,
                    excluded: frozenset[int] | set[int] = frozenset()) -> tuple[int, ...]:
        """The longest chain of cached blocks equal to the start of the request's sequence, at most
        :func:`max_hit_blocks` long: the blocks a request admitted now reuses (vLLM
        ``KVCacheManager.get_computed_blocks`` -> ``find_longest_cache_hit``).

        Args:
            request: a waiting request (fresh or preempted).
            block_size: tokens per block.
            excluded: blocks not to use (e.g. handed out earlier in the same step, so evicted).

        Returns:
            Block ids, logical order; ``len(result) * block_size`` tokens are the hit.
        """
        if not self.hash_to_blocks:
            return ()
        found: list[int] = []
        parent = ROOT_HASH
        for index in range(max_hit_blocks(request, block_size)):
            parent = request_block_hash(request, index, parent, block_size)
            block_id = self.cached_block(parent, excluded)
            if block_id is None:
                break
            found.append(block_id)
        return tuple(found)

    def is_evictable(self, block_id: int) -> bool:
        """Published and held by no block table."""
        return block_id in self.block_hashes and not self.ref_counts.get(block_id)


class CacheUpdate:
    """A mutable working copy of the free queue and the :class:`PrefixCache` for one transition (or for a
    policy simulating one step's allocations); :meth:`freeze` returns the new immutable values.

    Operations, each as vLLM 0.32 ``block_pool.py``:

    - :meth:`release`: a block table is given back (``SingleTypeKVCacheManager.free`` ->
      ``BlockPool.free_blocks``);
    - :meth:`touch`: a hit's blocks are referenced (``BlockPool.touch``);
    - :meth:`take` / :meth:`take_front`: new blocks are handed out, evicting their hashes
      (``BlockPool.get_new_blocks``);
    - :meth:`publish`: a request's fully computed blocks get their hashes (``BlockPool.cache_full_blocks``,
      but at the end of the step: module docstring).
    """

    def __init__(self, cache: PrefixCache, free: Sequence[int]) -> None:
        self.free: list[int] = list(free)
        self.cache = cache
        # the source cache's own mappings until the first write copies them (_write_hashes, _write_counts: most
        # steps change no hash); a mapping that is not ``self.cache``'s is this update's copy
        self.block_hashes: Mapping[int, str] = cache.block_hashes
        self.hash_to_blocks: Mapping[str, tuple[int, ...]] = cache.hash_to_blocks
        self.ref_counts: Mapping[int, int] = cache.ref_counts
        self._counted: set[int] = set()
        self._hashed: set[int] = set()
        self._listed: set[str] = set()
        self.evicted: list[int] = []

    def _write_hashes(self) -> tuple[dict[int, str], dict[str, tuple[int, ...]]]:
        if self.block_hashes is self.cache.block_hashes:  # .copy(): a dict's (or a mappingproxy's dict's) fast copy
            self.block_hashes, self.hash_to_blocks = self.block_hashes.copy(), self.hash_to_blocks.copy()  # type: ignore[attr-defined]
        return self.block_hashes, self.hash_to_blocks  # type: ignore[return-value]

    def _write_counts(self) -> dict[int, int]:
        if self.ref_counts is self.cache.ref_counts:
            self.ref_counts = self.ref_counts.copy()  # type: ignore[attr-defined]
        return self.ref_counts  # type: ignore[return-value]

    # The only writers of the working copy's mappings: each logs its key (CacheChanges).

    def _set_count(self, block_id: int, count: int) -> None:
        """Block ``block_id``'s reference count becomes ``count`` (no entry for 0: a count reaches 0 only from 1,
        :meth:`free_blocks`)."""
        counts = self._write_counts()
        self._counted.add(block_id)
        if count > 0:
            counts[block_id] = count
        else:
            del counts[block_id]

    def _set_hash(self, block_id: int, value: str | None) -> None:
        """Block ``block_id``'s hash becomes ``value`` (``None``: no hash; only :meth:`_evict`, for a block that has
        one)."""
        block_hashes, _ = self._write_hashes()
        self._hashed.add(block_id)
        if value is None:
            del block_hashes[block_id]
        else:
            block_hashes[block_id] = value

    def _set_listed(self, value: str, blocks: tuple[int, ...]) -> None:
        """The hash map lists ``blocks`` under ``value`` (no entry when empty; emptied only by :meth:`_evict`, for
        the hash its block is listed under)."""
        _, hash_to_blocks = self._write_hashes()
        self._listed.add(value)
        if blocks:
            hash_to_blocks[value] = blocks
        else:
            del hash_to_blocks[value]

    def clone(self) -> CacheUpdate:
        """An independent copy (a policy trying a choice out)."""
        return CacheUpdate(self.freeze_cache(), self.free)

    @property
    def available(self) -> int:
        """Blocks that could be handed out now: free plus evictable (vLLM ``get_num_free_blocks``)."""
        return len(self.free)

    def num_evictable(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` are in the free queue now (a hit on them takes them out of it, so they
        count against the free blocks: vLLM ``get_num_blocks_to_allocate`` ``num_evictable_blocks``; null
        entries not counted, ``not blk.is_null``)."""
        return sum(1 for b in blocks if b != NULL_BLOCK and not self.ref_counts.get(b))

    def view(self) -> PrefixCache:
        """The cache as it is now (blocks handed out so far are evicted), to read; not a frozen value (later
        edits of this update may show through)."""
        return PrefixCache(self.block_hashes, self.hash_to_blocks, self.ref_counts)

    def longest_hit(self, request: Request, block_size: int) -> tuple[int, ...]:
        """:meth:`PrefixCache.longest_hit` on the cache as it is now (blocks handed out so far are evicted)."""
        return self.view().longest_hit(request, block_size)

    def release(self, table: Sequence[int]) -> None:
        """A block table is given back: last block first, each block's count drops by one; blocks reaching
        0 without a hash go to the front of the free queue, those with a hash to the back (a window's
        :data:`NULL_BLOCK` entries are skipped). vLLM ``SingleTypeKVCacheManager.free``."""
        self.free_blocks(table[::-1])

    def free_blocks(self, ordered: Sequence[int]) -> None:
        """Blocks are given back in this order (the first evicted first): each block's count drops by one;
        those reaching 0 without a hash go to the front of the free queue (in this order), those with a hash to
        the back (in this order); :data:`NULL_BLOCK` entries are skipped. vLLM ``BlockPool.free_blocks``
        (``prepend_n`` / ``append_n``).

        Raises:
            KeyError: a block held by no table (count 0): the spec gives back only the blocks of live tables, whose
                counts are at least 1 (invariant ``prefix-ref-counts``)."""
        front: list[int] = []
        back: list[int] = []
        for block_id in ordered:
            if block_id == NULL_BLOCK:
                continue
            count = self.ref_counts[block_id] - 1
            self._set_count(block_id, count)
            if count > 0:
                continue
            (back if block_id in self.block_hashes else front).append(block_id)
        if front:
            self.free[:0] = front
        self.free.extend(back)

    def touch(self, blocks: Sequence[int]) -> None:
        """A hit: each block's count rises by one; an evictable block leaves the free queue (:data:`NULL_BLOCK`
        entries skipped)."""
        for block_id in blocks:
            if block_id == NULL_BLOCK:
                continue
            count = self.ref_counts.get(block_id, 0)
            if count == 0 and block_id in self.free:
                self.free.remove(block_id)
            self._set_count(block_id, count + 1)

    def take(self, blocks: Sequence[int]) -> None:
        """Hand out these blocks (a plan's ``new_block_ids``): each leaves the free queue, loses its hash if
        it had one (recorded in :attr:`evicted`) and gets count 1."""
        if not blocks:
            return
        count = len(blocks)
        if self.free[:count] == list(blocks):
            del self.free[:count]
        else:
            gone = set(blocks)
            self.free = [b for b in self.free if b not in gone]
        for block_id in blocks:
            self._evict(block_id)
            self._set_count(block_id, self.ref_counts.get(block_id, 0) + 1)

    def take_front(self, count: int) -> tuple[int, ...]:
        """Hand out the first ``count`` blocks of the free queue (the caller checked :attr:`available`)."""
        blocks = tuple(self.free[:count])
        self.take(blocks)
        return blocks

    def _evict(self, block_id: int) -> None:
        old = self.block_hashes.get(block_id)
        if old is None:
            return
        self._set_hash(block_id, None)
        self.evicted.append(block_id)
        self._set_listed(old, tuple(b for b in self.hash_to_blocks[old] if b != block_id))

    def publish(self, request: Request, table: Sequence[int], num_computed_tokens: int, block_size: int,
                group: int = 0, replaced: dict[int, int] | None = None) -> tuple[int, ...]:
        """Give a hash to every block of ``table`` whose tokens the request has all computed and that has none
        yet (hashes of a table's first blocks are their parents). ``group``: the KV cache group of the table
        (:func:`group_cache_key`; a group past 0 publishes its blocks under their keys, its null entries
        skipped: vLLM ``BlockPool.cache_full_blocks`` skips ``blk.is_null``).

        **De-duplication** (SGLang's publication, ``replaced``: own block -> cached block; group 0 only): a
        block of ``replaced`` that would be published here is not: the cached block takes its place in the
        table (one reference more) and the own block is freed (count 0, no hash: to the front of the free
        queue). The pairs applied are removed from ``replaced``. SGLang 0.5.23 ``RadixCache._insert_cache``
        (``free_segment`` of the duplicates) and ``req_to_token_pool.write``.

        Returns:
            The table after the publication (``table`` itself without de-duplication).

        Raises:
            ValueError: a cached block of ``replaced`` does not carry the hash of the block it replaces (the
                rule ``deduplicate-at-publication`` refuses such a plan first).
        """
        full = min(num_computed_tokens // block_size, len(table))
        if group:
            parent = ROOT_HASH
            for index in range(full):
                parent = request_block_hash(request, index, parent, block_size)
                block_id = table[index]
                if block_id == NULL_BLOCK or block_id in self.block_hashes:
                    continue
                key = group_cache_key(parent, group)
                self._set_hash(block_id, key)
                self._set_listed(key, self.hash_to_blocks.get(key, ()) + (block_id,))
            return tuple(table)
        parent = ROOT_HASH
        after: list[int] | None = None
        for index in range(full):
            block_id = table[index]
            known = self.block_hashes.get(block_id)
            if known is None:
                known = request_block_hash(request, index, parent, block_size)
                if replaced and block_id in replaced:
                    cached = replaced.pop(block_id)
                    if self.block_hashes.get(cached) != known:
                        raise ValueError(f"block {block_id} replaced by block {cached}, which does not cache its tokens")
                    after = list(table) if after is None else after
                    after[index] = cached
                    self.touch((cached,))
                    self.free_blocks((block_id,))
                    parent = known
                    continue
                self._set_hash(block_id, known)
                self._set_listed(known, self.hash_to_blocks.get(known, ()) + (block_id,))
            parent = known
        return tuple(table) if after is None else tuple(after)

    def freeze_cache(self) -> PrefixCache:
        """The cache as it is now (the source cache itself when nothing changed). Later edits of this update
        copy again, so the value returned never changes."""
        hashes_copied = self.block_hashes is not self.cache.block_hashes
        counts_copied = self.ref_counts is not self.cache.ref_counts
        if not (hashes_copied or counts_copied):
            return self.cache
        if hashes_copied:  # read-only views of the copies; the new cache's own mappings, so the next write copies
            self.block_hashes = MappingProxyType(self.block_hashes)
            self.hash_to_blocks = MappingProxyType(self.hash_to_blocks)
        if counts_copied:
            self.ref_counts = MappingProxyType(self.ref_counts)
        changes = CacheChanges(weakref.ref(self.cache), frozenset(self._hashed), frozenset(self._listed),
                               frozenset(self._counted))
        self._hashed, self._listed, self._counted = set(), set(), set()
        self.cache = PrefixCache(self.block_hashes, self.hash_to_blocks, self.ref_counts)
        object.__setattr__(self.cache, "changes", changes)  # the only writer of the log (class docstring)
        return self.cache

    def freeze(self) -> tuple[PrefixCache, tuple[int, ...]]:
        """The new cache and free queue."""
        return self.freeze_cache(), tuple(self.free)


def evicted_blocks(before: PrefixCache, new_block_ids: Iterable[int]) -> list[int]:
    """Of the blocks handed out in a step, those that carried a hash before it (evicted from the cache)."""
    return [b for b in new_block_ids if b in before.block_hashes]
