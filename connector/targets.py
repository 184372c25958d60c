"""Where one prefill rank's push goes: the target's checks and the decode ranks it writes.

A target read from Redis is hostile until checked: it must fit the decode engine it names
(``check_target``). Under heterogeneous TP a prefill rank writes a head slice of every
block into each decode rank that holds those heads (``tp_mapping``); ``peers_for`` turns
decode's published layouts into one prepared transport peer per decode rank written.
"""

from __future__ import annotations

from collections.abc import Callable

from kvpush.common.wire import KVLayout
from kvpush.connector import integrity, page_layout, tp_mapping
from kvpush.connector.groups import NULL_BLOCK
from kvpush.connector.metadata import SendTarget
from kvpush.connector.registry import AgentRegistry
from kvpush.connector.transport import (
    LayoutMismatch,
    Peer,
    Transport,
    check_compatible,
    geometry_of,
)


class TargetRejected(ValueError):
    """A push target read from Redis does not fit the decode engine it names."""


def check_target(target: SendTarget, layout: KVLayout, block_size: int) -> None:
    """Refuse a target that could make prefill write outside the blocks decode reserved:
    one block list and skip per KV cache group of decode's layout, one block per
    ``block_size`` prompt tokens in each, every pushed block id inside decode's registered
    cache, none of them vLLM's null block and none twice (the groups share one tensor)."""
    want = -(-target.num_tokens // block_size) if target.num_tokens > 0 else 0
    if layout.block_size != block_size:
        raise TargetRejected(f"decode block size {layout.block_size} != {block_size}")
    groups = max(layout.layer_groups, default=0) + 1
    if len(target.block_ids) != groups or len(target.skip_blocks) != groups:
        raise TargetRejected(f"{len(target.block_ids)} block lists and "
                             f"{len(target.skip_blocks)} skips for {groups} KV cache groups")
    pushed: list[int] = []
    for g, (ids, skip) in enumerate(zip(target.block_ids, target.skip_blocks, strict=True)):
        if len(ids) != want:
            raise TargetRejected(f"{len(ids)} block ids in group {g} for "
                                 f"{target.num_tokens} tokens (want {want})")
        if not 0 <= skip <= want:
            raise TargetRejected(f"skip_blocks {skip} of group {g} outside 0..{want}")
        pushed.extend(ids[skip:])
    if any(not 0 <= b < layout.num_blocks for b in pushed):
        raise TargetRejected(f"block id outside decode's {layout.num_blocks} blocks")
    if NULL_BLOCK in pushed:
        raise TargetRejected("a pushed block is vLLM's null block")
    if len(set(pushed)) != len(pushed):
        raise TargetRejected("repeated block id")


def write_runs(local: KVLayout, remote: KVLayout, write: tp_mapping.RankWrite
               ) -> tuple[page_layout.Runs, page_layout.Runs]:
    """The byte runs of a local page and of the remote page that carry ``write``'s
    heads, piece for piece (``page_layout.pair``); raises :class:`LayoutMismatch` naming
    both layouts when they cannot be paired."""
    try:
        return page_layout.pair(geometry_of(local), geometry_of(remote),
                                (write.local.first, write.local.count),
                                (write.remote.first, write.remote.count))
    except page_layout.UnmappableLayouts as exc:
        raise LayoutMismatch(f"cannot push: {exc}") from exc


def peers_for(target: SendTarget, local: KVLayout, registry: AgentRegistry,
              transport: Transport, block_size: int
              ) -> list[tuple[Peer, tp_mapping.HeadSlice]]:
    """The decode ranks this rank writes ``target`` into, prepared, each with the local
    heads it carries; empty when another prefill rank writes every head this rank holds.
    Raises ``LookupError`` (a peer not in Redis), :class:`TargetRejected`,
    :class:`~kvpush.connector.transport.TransportError` or ``redis.RedisError``."""
    return engine_peers(target.decode_engine, target.decode_generation, local, registry,
                        transport, check=lambda layout: check_target(target, layout,
                                                                     block_size))


def engine_peers(engine_id: str, generation: int | None, local: KVLayout,
                 registry: AgentRegistry, transport: Transport,
                 check: Callable[[KVLayout], None] | None = None
                 ) -> list[tuple[Peer, tp_mapping.HeadSlice]]:
    """The ranks of decode ``engine_id`` (``generation``; None: the newest) this rank
    writes into, prepared, each with the local heads it carries; ``check`` runs on each
    rank's layout first. Raises as :func:`peers_for`."""
    first = registry.fetch(engine_id, 0, generation)
    check_compatible(local, first.layout)
    mla = local.page == integrity.LATENT
    try:
        writes = tp_mapping.writes_of(local.tp_rank, local.tp_size, first.layout.tp_size,
                                      local.total_kv_heads, mla)
    except tp_mapping.UnsupportedTP as exc:
        raise LayoutMismatch(f"cannot push: {exc}") from exc
    out = []
    for w in writes:
        info = first if w.decode_rank == 0 else registry.fetch(
            engine_id, w.decode_rank, first.generation)
        if check is not None:
            check(info.layout)
        peer = transport.peer(info, *write_runs(local, info.layout, w))
        out.append((peer, w.local))
    return out


def unpairable_peers(local: KVLayout, registry: AgentRegistry, engine_ids: list[str]
                     ) -> dict[str, str]:
    """Of the engines ``engine_ids`` already registered, those whose rank-0 layout this
    rank cannot push into or receive from, each with why (both layouts named). Engines
    without agent metadata (not started, or no connector) are left out."""
    out: dict[str, str] = {}
    for engine_id in engine_ids:
        try:
            peer = registry.fetch(engine_id, 0)
        except LookupError:
            continue
        try:
            check_compatible(local, peer.layout)
            mla = local.page == integrity.LATENT
            writes = tp_mapping.writes_of(local.tp_rank, local.tp_size, peer.layout.tp_size,
                                          local.total_kv_heads, mla)
            for w in writes[:1]:
                write_runs(local, peer.layout, w)
        except (LayoutMismatch, tp_mapping.UnsupportedTP) as exc:
            out[engine_id] = str(exc)
    return out
