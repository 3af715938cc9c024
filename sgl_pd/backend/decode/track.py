"""One request's transfer as this decode rank sees it: the record the decode modules
share (`messenger`, `completion`, `staging_grants`, `release`, `timeline`), read and
written only under the messenger's lock, and how it is made from the request."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sgl_pd.core.counting import CompletionCounter, expectation_for, links_into
from sgl_pd.core.relayout import ReceivePlacement
from sgl_pd.core.sharding import ShardingScheme, ShardLink, link_shards
from sgl_pd.core.state_slices import writers_into
from sgl_pd.core.wire import ShardRegistration, StateSlots, TransferRequest


@dataclass
class Track:
    room: int
    slot: int
    sources: tuple[int, ...]  # prefill ranks whose count words this rank reads (KV, state)
    counter: CompletionCounter
    metadata_source: int  # the prefill rank that writes word 0
    prefills: dict[int, str]  # every prefill rank asked -> its inbox (where aborts go)
    sessions: dict[str, str]  # inbox -> that rank's transfer session (for liveness probes)
    instances: dict[int, int]  # every prefill rank asked -> its instance (who may report)
    reply_to: str  # this rank's inbox, where drain acks come back
    started_s: float
    num_pages: int
    links: tuple[ShardLink, ...]  # every link into this rank, in counting order
    dst_pages: np.ndarray  # (request pages,) this rank's page per logical page
    # receive staging: where the request's blocks go, and its part of the area (offset)
    placement: ReceivePlacement | None = None
    staging_offset: int | None = None
    unsent: TransferRequest | None = None  # waiting for receive staging to come free
    held_tokens: int = 0  # the prompt's first tokens this rank's prefix cache holds
    # staged whole because its pages are fragmented (`core.relayout.fragmented`)
    whole: bool = False
    # ... which it may do without (no link needs staging otherwise): sent unstaged
    # rather than wait for staging space
    whole_optional: bool = False
    prompt_tokens: int = 0  # tokens whose KV the prefiller computed, from its last notice
    kv_tokens: int | None = None  # tokens whose KV this request needs (None: not known)
    error: str | None = None
    metadata_seen: bool = False
    abort_sent: bool = False
    drained: set[int] = field(default_factory=set)  # prefill ranks that stopped writing
    done_s: float | None = None
    # bootstrap: the receiver made, the prefiller's ranks known (monotonic s; None when
    # the caller did not stamp them)
    seen_s: float | None = None
    found_s: float | None = None
    traced: bool = False  # its timeline went out (once per request)
    owner: object | None = None  # the receiver that asked for it (SGLang's)
    # --pd-kv-checksum: prefill rank -> its sums of what it wrote here (per region)
    sums: dict[int, tuple[int, ...]] = field(default_factory=dict)
    summed_sources: frozenset[int] = frozenset()  # the prefill ranks with links here
    arrival: int = 0  # this rank's count of requests asked before it: grants go in this order


def new_track(
    room: int,
    prefills: list[ShardRegistration],
    reply_to: str,
    to: tuple[ShardingScheme, int],
    dst_pages: np.ndarray,
    slot: int,
    now: float,
    *,
    held_tokens: int,
    kv_tokens: int | None,
    owner: object | None,
    state: tuple[StateSlots, ...] = (),
) -> Track:
    """The track of a request asked of `prefills` (every rank of its prefiller) into
    this rank, `to` (its scheme, its rank): the links into it and the count they owe.
    `reply_to`: this rank's inbox. `now`: monotonic s. `state`: this rank's state
    besides the KV (whose writers count a group each)."""
    prefill = prefills[0]
    layer_groups = len(prefill.layout.layer_groups(prefill.layer_group_size))
    links = links_into(link_shards(prefill.layout, prefill.scheme, to[0], room), to[1])
    writers = writers_into(prefill.state, prefill.scheme.tp_size, state, to[0].tp_size, to[1])
    expectation = expectation_for(links, layer_groups, writers)
    return Track(
        room,
        slot,
        expectation.sources,
        CompletionCounter(expectation, expect_kv=len(dst_pages) > 0),
        expectation.metadata_source,
        {peer.rank: peer.inbox for peer in prefills},
        {peer.inbox: peer.session for peer in prefills},
        {peer.rank: peer.instance for peer in prefills},
        reply_to,
        now,
        len(dst_pages),
        links,
        dst_pages,
        held_tokens=held_tokens,
        kv_tokens=kv_tokens,
        owner=owner,
        summed_sources=frozenset(link.src_rank for link in links),
    )
