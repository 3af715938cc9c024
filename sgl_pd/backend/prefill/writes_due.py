"""Which writes a request has due, and when: its chunks (noticed before the forward
layer by layer, or handed over at SGLang's send after it), the draft model's layers of
each, and its metadata job (`core.states.MetadataWait`), which follows every layer of the
last chunk on each destination's queue (D9).

Called by `PrefillRooms` with its lock held; no I/O. The room's pins, deadline and state
stay with `PrefillRooms`.
"""

from __future__ import annotations

import numpy as np

from sgl_pd.backend.prefill.room_types import Chunk, Room
from sgl_pd.core.layout import KvLayout
from sgl_pd.core.page_ids import PageIds
from sgl_pd.core.plan import TokenRange
from sgl_pd.core.states import METADATA_DUE, MetadataWait

Writes = list[tuple[Chunk, range]]  # (chunk, its layers) to queue for every destination


class WritesDue:
    def __init__(self, layout: KvLayout, layerwise: bool, draft_layers: range) -> None:
        self.layout = layout
        self.layerwise = layerwise
        # the draft model's layers (the layout's last ones); layer-wise mode sends them
        # at SGLang's send, after the draft forward, and the rest as the target runs
        self.draft_layers = draft_layers

    def expect(self, room: Room, num_pages: int) -> None:
        if num_pages == 0:
            # the decoder holds every token computed here: no chunk will carry KV,
            # so the metadata waits for SGLang's last send only
            room.metadata &= ~(MetadataWait.TARGET_LAYERS | MetadataWait.DRAFT_LAYERS)

    def notice(self, room: Room, src_pages: PageIds, end_token: int, is_last: bool) -> Chunk | None:
        """Layer-wise mode, before the forward (D7): the chunk up to `end_token`, or None
        when it covers no token not planned yet."""
        if end_token <= room.tokens_planned:
            return None
        chunk = Chunk(
            room.room,
            room.chunks,
            TokenRange(room.tokens_planned, end_token),
            src_pages,
            is_last,
        )
        room.chunks += 1
        room.tokens_planned = end_token
        if self.draft_layers:
            room.awaiting_draft.append(chunk)
            room.metadata |= MetadataWait.DRAFT_LAYERS
        return chunk

    def sent(self, room: Room, pages: np.ndarray, num_tokens: int) -> tuple[Writes, bool]:
        """SGLang's `send` of `pages` holding `num_tokens` new tokens: the writes due now,
        and whether this send was the last. After-forward mode: the chunk SGLang hands
        over, every layer; layer-wise mode: the draft model's layers of the chunks
        forwarded so far (the target's went as the forward ran)."""
        room.pages_sent += len(pages)
        is_last = room.num_pages is not None and room.pages_sent >= room.num_pages
        due: Writes = []
        page_size = self.layout.page_size
        if not self.layerwise and num_tokens > 0:
            # SGLang's sends start at the held prefix (whole pages)
            start = room.held_tokens + len(room.src_pages) * page_size
            room.src_pages.extend(int(p) for p in pages)
            chunk = Chunk(
                room.room,
                room.chunks,
                TokenRange(start, start + num_tokens),
                PageIds.ready(room.src_pages),
                is_last,
                src_first_page=room.held_tokens // page_size,
            )
            room.chunks += 1
            room.tokens_planned = start + num_tokens
            due.append((chunk, range(self.layout.num_layers)))
        elif self.layerwise:
            # a chunk's draft KV exists once SGLang sends the pages that chunk filled
            sent_tokens = room.held_tokens + room.pages_sent * page_size
            forwarded = [c for c in room.awaiting_draft if is_last or c.tokens.stop <= sent_tokens]
            room.awaiting_draft = room.awaiting_draft[len(forwarded) :]  # in order
            due.extend((c, self.draft_layers) for c in forwarded)
        if is_last:
            room.metadata &= ~MetadataWait.LAST_SEND
        return due, is_last

    def queued(self, room: Room, writes: Writes) -> None:
        """The writes `sent` returned are queued for every destination."""
        for chunk, layers in writes:
            if not chunk.is_last:
                continue
            if len(layers) == self.layout.num_layers:  # after-forward: all of them
                room.metadata &= ~(MetadataWait.TARGET_LAYERS | MetadataWait.DRAFT_LAYERS)
            elif layers == self.draft_layers:
                room.metadata &= ~MetadataWait.DRAFT_LAYERS

    def target_queued(self, room: Room, chunk: Chunk) -> None:
        """Layer-wise mode: every target layer of `chunk` is queued for its destinations."""
        if chunk.is_last:
            room.metadata &= ~MetadataWait.TARGET_LAYERS

    def take_metadata(self, room: Room) -> bool:
        """Whether the metadata job is due now: once, after every layer of the last chunk
        is queued and SGLang has filled the metadata row (its last send). Counts the
        destinations' metadata jobs in `metadata_pending` when it is."""
        if room.metadata != METADATA_DUE:
            return False
        room.metadata = MetadataWait.QUEUED
        room.metadata_pending = len(room.requests)
        return True
