"""One rank's staging area for re-layout (`core.relayout`): a buffer on the KV pool's
device, registered with the transfer engine, and who holds which bytes of it.

Prefill ranks hold gather blocks for one write job at a time (`take` waits for space:
back-pressure, bounded by the writes of the jobs holding it, each a few Mooncake batches);
decode ranks hold a request's receive blocks from its transfer request to its scatter,
or, when it ends early, until its pages may be freed (`try_take` never waits: a request
that finds no space waits in its own state, see `decode.staging_grants`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from sgl_pd.backend.pool import PoolDescription
from sgl_pd.backend.relayout_copies import PoolCopies
from sgl_pd.core.layout import AttnKind, PageLayout
from sgl_pd.core.staging_space import StagingSpace
from sgl_pd.core.wire import Role
from sgl_pd.errors import SglPdError
from sgl_pd.transfer.engine import TransferEngine

MIB = 1 << 20
# Tokens of KV a decode rank's receive staging holds by default: a request larger than
# the area is written one token slot at a time, so the default covers long prompts.
DECODE_STAGING_TOKENS = 16384
# ... on a decode rank whose slices are never strided (MLA, one head), where staging only
# serves fragmented pages: a longer request goes unstaged, a page run at a time. DeepSeek
# R1 (61 layers, 1152-byte rows): 288 MB a rank.
FRAGMENTED_STAGING_TOKENS = 4096


class StagingBusy(SglPdError):
    """No staging space came free in time (every holder is stuck)."""


class StagingArea:
    def __init__(self, nbytes: int, device: Any, engine: TransferEngine) -> None:
        import torch

        self._space = StagingSpace(nbytes)
        self.capacity = self._space.capacity  # bytes
        # (capacity,) uint8 on the pool's device; kept alive as long as the area
        self._buffer = torch.empty(max(self.capacity, 1), dtype=torch.uint8, device=device)
        self.base = int(self._buffer.data_ptr())  # absolute address of offset 0
        self._engine = engine
        if self.capacity:
            engine.register(self.base, self.capacity)
        self._cond = threading.Condition()

    @property
    def used(self) -> int:
        """Bytes held now (the pool line and the gauge report it)."""
        with self._cond:
            return self._space.used

    def fits(self, nbytes: int) -> bool:
        return self._space.fits(nbytes)

    def try_take(self, nbytes: int) -> int | None:
        """Offset of `nbytes` now held, or None while the area is full."""
        with self._cond:
            return self._space.take(nbytes)

    def take(self, nbytes: int, timeout_s: float) -> int:
        """Offset of `nbytes`, waiting for holders to give space back (`fits` first)."""
        taken: list[int] = []

        def grab() -> bool:
            offset = self._space.take(nbytes)
            if offset is not None:
                taken.append(offset)
            return bool(taken)

        with self._cond:
            if not self._cond.wait_for(grab, timeout_s):
                raise StagingBusy(
                    f"no {nbytes / MIB:.1f} MiB of staging came free in {timeout_s:g} s "
                    f"({self._space.used / MIB:.1f} of {self.capacity / MIB:.1f} MiB held)"
                )
            return taken[0]

    def give_back(self, offset: int) -> None:
        with self._cond:
            self._space.give_back(offset)
            self._cond.notify_all()

    def view(self, offset: int, nbytes: int) -> Any:
        """(nbytes,) uint8 tensor over held bytes."""
        return self._buffer[offset : offset + nbytes]

    def close(self) -> None:
        if self.capacity:
            self._engine.unregister(self.base)


@dataclass(frozen=True)
class Staging:
    """What a rank re-lays KV out with: its staging area and the copies on its pool."""

    area: StagingArea
    copies: PoolCopies


def staging_bytes(config_mb: float, role: Role, pool: PoolDescription, chunk_tokens: int) -> int:
    """Bytes of a rank's staging area: `config_mb` MiB, or when negative the default:
    prefill, four write jobs' gather blocks of one layer of a full chunk (a job of more
    layers is gathered and written a few layers at a time); decode, the receive blocks of
    `DECODE_STAGING_TOKENS` tokens of this rank's KV. Only NHD pools stage (HND pages
    hold a rank's slice contiguously). A slice strided under mismatched TP is staged on
    both sides; a chunk whose source pages are fragmented on the prefill, a request
    whose destination pages are on the decoder (`core.relayout.fragmented`) - so a
    decode rank whose slice can never be strided (MLA, or one head) gets a smaller
    receive area (`FRAGMENTED_STAGING_TOKENS`)."""
    layout = pool.layout
    if layout.page_layout is not PageLayout.NHD or config_mb == 0:
        return 0
    if config_mb > 0:
        return int(config_mb * MIB)
    never_strided = layout.kind is AttnKind.MLA or pool.local_heads == 1
    token_layer = len(layout.parts) * pool.local_heads * layout.row_bytes  # bytes
    if role is Role.PREFILL:
        return 4 * max(chunk_tokens, layout.page_size) * token_layer
    tokens = FRAGMENTED_STAGING_TOKENS if never_strided else DECODE_STAGING_TOKENS
    return tokens * layout.num_layers * token_layer
