"""The scheduler's engines kept in placement order, so a pick does not look at every engine."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from sortedcontainers import SortedList

from kvpush.common.engine_view import DECODE_ROLES, PREFILL_ROLES, EngineView
from kvpush.services.scheduler.placement import Policy

# A key's last element is the engine id: keys are unique and ties break as in placement.py.
_DecodeKey = tuple[float, int, str]
_PrefillKey = tuple[int, int, str]
_FitKey = tuple[int, str]


class EngineIndex:
    """Decode and prefill engines sorted by the keys of :func:`.placement.best_decode`
    and :func:`.placement.pick_prefill`; picks agree with those scans (a property
    test checks it) in O(log N) instead of O(N).

    The views are the scheduler's own objects. Whoever changes a number a key is made of
    (reserved blocks, pending prompt tokens) calls :meth:`update` for that engine; a refresh
    calls :meth:`rebuild`. Fit is still checked on the live numbers at pick time, so a
    forgotten update costs ordering, never capacity (the reserve script has the last word).
    """

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._decoders: dict[str, EngineView] = {}
        self._prefillers: dict[str, EngineView] = {}
        # least_loaded: one order by (-free share, requests, id).
        self._dkeys: dict[str, _DecodeKey] = {}
        self._dorder: SortedList = SortedList()
        # best_fit: per block size, an order by (available blocks, id): the tightest hole
        # that fits is the first at or after the need.
        self._fkeys: dict[str, tuple[int, _FitKey]] = {}
        self._forder: dict[int, SortedList] = {}
        self._pkeys: dict[str, _PrefillKey] = {}
        self._porder: SortedList = SortedList()

    def rebuild(self, decoders: Iterable[EngineView], prefillers: Iterable[EngineView]) -> None:
        """Index exactly these engines (after a refresh or a change of the usable set)."""
        self._decoders = {e.engine_id: e for e in decoders if e.role in DECODE_ROLES}
        self._prefillers = {e.engine_id: e for e in prefillers if e.role in PREFILL_ROLES}
        if self.policy is Policy.BEST_FIT:
            self._fkeys = {i: (e.block_size, _fit_key(e)) for i, e in self._decoders.items()}
            groups: dict[int, list[_FitKey]] = {}
            for size, key in self._fkeys.values():
                groups.setdefault(size, []).append(key)
            self._forder = {size: SortedList(keys) for size, keys in groups.items()}
        else:
            self._dkeys = {i: _decode_key(e) for i, e in self._decoders.items()}
            self._dorder = SortedList(self._dkeys.values())
        self._pkeys = {i: _prefill_key(e) for i, e in self._prefillers.items()}
        self._porder = SortedList(self._pkeys.values())

    def update(self, e: EngineView) -> None:
        """Re-sort ``e`` after its numbers changed (no-op for an engine not indexed)."""
        i = e.engine_id
        if self._decoders.get(i) is e:
            if self.policy is Policy.BEST_FIT:
                size, old = self._fkeys[i]
                new = _fit_key(e)
                if new != old:
                    order = self._forder[size]
                    order.remove(old)
                    order.add(new)
                    self._fkeys[i] = (size, new)
            else:
                old_d = self._dkeys[i]
                new_d = _decode_key(e)
                if new_d != old_d:
                    self._dorder.remove(old_d)
                    self._dorder.add(new_d)
                    self._dkeys[i] = new_d
        if self._prefillers.get(i) is e:
            old_p = self._pkeys[i]
            new_p = _prefill_key(e)
            if new_p != old_p:
                self._porder.remove(old_p)
                self._porder.add(new_p)
                self._pkeys[i] = new_p

    def best_decode(self, prompt_tokens: int, max_tokens: int,
                    skip: Collection[str] = frozenset()) -> tuple[EngineView, int] | None:
        """What :func:`.placement.best_decode` picks among the indexed engines."""
        tokens = max(0, prompt_tokens) + max(0, max_tokens)
        if self.policy is Policy.BEST_FIT:
            return self._best_fit(tokens, skip)
        for _, _, i in self._dorder:
            if i in skip:
                continue
            e = self._decoders[i]
            need = max(1, -(-tokens // e.block_size))
            if need <= min(e.total_blocks - e.reserved_blocks, e.free_blocks):
                return e, need
        return None

    def _best_fit(self, tokens: int, skip: Collection[str]) -> tuple[EngineView, int] | None:
        best: tuple[EngineView, int] | None = None
        best_key: _FitKey | None = None
        for size, order in self._forder.items():
            need = max(1, -(-tokens // size))
            for _, i in order.islice(order.bisect_left((need, ""))):
                if i in skip:
                    continue
                e = self._decoders[i]
                avail = min(e.total_blocks - e.reserved_blocks, e.free_blocks)
                if need > avail:
                    continue  # its key is stale (an update was missed): look further
                key = (avail - need, i)
                if best_key is None or key < best_key:
                    best, best_key = (e, need), key
                break
        return best

    def decoder(self, engine_id: str) -> EngineView | None:
        """The indexed (usable) decode engine ``engine_id``, if it is one."""
        return self._decoders.get(engine_id)

    def prefiller(self, engine_id: str) -> EngineView | None:
        """The indexed (usable) prefill engine ``engine_id``, if it is one."""
        return self._prefillers.get(engine_id)

    def pick_prefill(self, exclude: Collection[str] = ()) -> EngineView | None:
        """What :func:`.placement.pick_prefill` picks among the indexed engines."""
        for _, _, i in self._porder:
            if i not in exclude:
                return self._prefillers[i]
        return None


def _decode_key(e: EngineView) -> _DecodeKey:
    avail = min(e.total_blocks - e.reserved_blocks, e.free_blocks)
    return (-avail / max(1, e.total_blocks), e.running + e.waiting, e.engine_id)


def _fit_key(e: EngineView) -> _FitKey:
    return (min(e.total_blocks - e.reserved_blocks, e.free_blocks), e.engine_id)


def _prefill_key(e: EngineView) -> _PrefillKey:
    return (e.prefill_load, e.running + e.waiting, e.engine_id)
