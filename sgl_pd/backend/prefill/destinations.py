"""The decode ranks of a request: which may ask for it, what this rank writes into each
(its `Destination`s), and whether the prompt they expect is the one this prefill computes.

Functions on one `Room`, called by `PrefillRooms` with its lock held; no I/O.
"""

from __future__ import annotations

from sgl_pd.backend.prefill.room_types import Destination, Room
from sgl_pd.backend.state_slots import slot_mismatch
from sgl_pd.core.counting import links_into
from sgl_pd.core.layout import KvLayout
from sgl_pd.core.sharding import ShardingScheme, link_shards
from sgl_pd.core.state_slices import region_blocks
from sgl_pd.core.wire import StateSlots, TransferRequest


def join(
    room: Room,
    request: TransferRequest,
    *,
    rank: int,
    layout: KvLayout,
    scheme: ShardingScheme,
    state: tuple[StateSlots, ...] = (),
) -> str | None:
    """Adds a decode rank's request to the room, and the destination this rank writes
    into (`rank`: this prefill rank; `state`: its state slots besides the KV). Returns
    why it is refused (the room unchanged), or None (also for a copy of what that decode
    rank asked: nothing changes)."""
    decoder = request.decoder
    if room.error is not None:
        return room.error
    why = slot_mismatch(decoder.state, decoder.scheme, state, scheme)
    if why is not None:
        return why
    if decoder.instance in room.aborted_early:
        return f"decode rank {decoder.rank} aborted request {room.room} before it asked"
    held = room.requests.get(decoder.rank)
    if held == request:
        return None
    if held is not None and held.decoder.instance != decoder.instance:
        return (
            f"decode rank {decoder.rank} of another instance already asked for request {room.room}"
        )
    if room.decoder_tp not in (None, decoder.scheme.tp_size):
        return f"decode ranks disagree on TP ({room.decoder_tp} vs {decoder.scheme.tp_size})"
    others = {q.held_tokens for r, q in room.requests.items() if r != decoder.rank}
    if others and others != {request.held_tokens}:
        return (
            f"decode ranks disagree on the prefix they hold ({sorted(others)} vs"
            f" {request.held_tokens} tokens)"
        )
    fixed = room.held_read or room.chunks
    if fixed and request.held_tokens != room.held_tokens:
        return (
            f"the held prefix changed from {room.held_tokens} to"
            f" {request.held_tokens} tokens after the prefill fixed where it sends from"
        )
    links = links_into(
        link_shards(layout, scheme, decoder.scheme, request.request_id), decoder.rank
    )
    mine = frozenset(i for i, link in enumerate(links) if link.src_rank == rank)
    first = min(links, key=lambda link: (link.head_lo, link.src_rank))
    # this rank's share of each state component's slots, region by region (TP splits
    # state as it splits heads, yet a few KV heads are replicated over the ranks: a
    # rank may write some of a decode rank's state and none of its KV)
    state_blocks = tuple(
        region_blocks(c, scheme.tp_size, rank, d, decoder.scheme.tp_size, decoder.rank)
        for c, d in zip(state, decoder.state, strict=True)
    )
    writes_state = any(any(regions) for regions in state_blocks)
    room.requests[decoder.rank] = request
    room.decoder_tp = decoder.scheme.tp_size
    room.held_tokens = request.held_tokens
    if not room.chunks:
        room.tokens_planned = request.held_tokens
    if mine or writes_state:
        room.destinations[decoder.rank] = Destination(
            request, links, mine, first.src_rank == rank, state_blocks if writes_state else ()
        )
    return None


def every_rank_asked(room: Room) -> bool:
    return len(room.requests) == room.decoder_tp


def destination_or_notice(room: Room, rank: int) -> Destination:
    """Decode rank `rank`'s destination; one this rank writes nothing to still gets the
    last chunk's notice."""
    existing = room.destinations.get(rank)
    if existing is not None:
        return existing
    request = room.requests[rank]
    return Destination(request, (), frozenset(), False)


def prompt_mismatch(room: Room) -> str | None:
    """Why the decode ranks that asked cannot be served the prompt this prefill computes,
    or None (also while that is not known yet): a decoder expecting the KV of other
    tokens would decode from the wrong one (`TransferRequest.kv_tokens`), and one holding
    more than are computed would never get the last send."""
    computed = room.prompt_tokens
    if computed is None:
        return None
    if room.held_tokens > computed:
        return (
            f"the decoder holds {room.held_tokens} tokens of a prompt whose prefill computes"
            f" {computed}: start the decode server through sgl_pd.launch_server with the"
            " installed patches (launch/install.sh)"
        )
    expected = {r.kv_tokens for r in room.requests.values() if r.kv_tokens is not None}
    if expected and expected != {computed}:
        return (
            f"the prefill server computes the KV of {computed} prompt tokens and the decoder"
            f" expects {', '.join(str(t) for t in sorted(expected))}: the two servers read"
            " the request's prompt differently"
        )
    return None
