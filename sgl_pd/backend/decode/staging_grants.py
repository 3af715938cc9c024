"""A decode rank's receive staging, per request: how much it needs, the grant of its
part of the area (in arrival order; a request that finds no space waits unsent:
back-pressure), the scatter of its blocks into the pool at hand-off, and giving the part
back.

Under mismatched TP, prefill ranks that each hold fewer heads than this rank write
re-laid-out blocks into this rank's receive staging (`core.relayout`); a request whose
pages are fragmented may be staged whole (`core.relayout.fragmented`). Everything here
runs under the messenger's lock, except `scatter`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import msgspec
import numpy as np

from sgl_pd.backend.decode.release import nothing_can_land
from sgl_pd.backend.decode.track import Track
from sgl_pd.backend.staging_area import MIB, Staging
from sgl_pd.core.bounds import DEFAULT_DEFERRED_RELEASE_S
from sgl_pd.core.clock import Clock
from sgl_pd.core.layout import KvLayout, PageLayout
from sgl_pd.core.relayout import ReceivePlacement, fragmented, receive_placement
from sgl_pd.core.states import DecodeState, RequestTracker
from sgl_pd.core.wire import TransferRequest
from sgl_pd.log_limits import LogLimiter

logger = logging.getLogger("sgl_pd.decode")
_log = LogLimiter(logger)
# Seconds the receive staging of a request forgotten before its pages were safe is held:
# as long as SGLang's deferred release holds the pages themselves (`core.bounds`)
ORPHAN_STAGING_HOLD_S = DEFAULT_DEFERRED_RELEASE_S
SCATTER_LINE_PREFIX = "sgl_pd scatter done:"  # one line per re-laid-out request


class StagingGrants:
    """`tracks` and `states`: the messenger's, read under its lock. `staging`: None on
    a rank without receive staging (every request goes at once, unstaged)."""

    def __init__(
        self,
        staging: Staging | None,
        tracks: Mapping[int, Track],
        states: RequestTracker[DecodeState],
        clock: Clock,
        hold_s: float,
    ) -> None:
        self._staging = staging
        self._tracks = tracks
        self._states = states
        self._clock = clock
        self._hold_s = hold_s
        # staging of requests forgotten before nothing could land in it: (until, offset)
        self._orphans: list[tuple[float, int]] = []

    @property
    def used(self) -> int:
        """Bytes of the area held now."""
        return 0 if self._staging is None else self._staging.area.used

    def starved(self, timeout_s: float) -> str:
        """Why a request that waited `timeout_s` for its grant fails."""
        assert self._staging is not None
        return (
            f"no receive staging came free for {timeout_s:g} s "
            f"({self._staging.area.used / MIB:.1f} of "
            f"{self._staging.area.capacity / MIB:.1f} MiB held): raise --pd-staging-mb"
        )

    def place(self, track: Track, prefill_layout: KvLayout) -> None:
        """Sets how much receive staging the request needs (`track.placement`, None for
        none) and whether it is staged whole; before it is tracked (no lock needed)."""
        pages = np.asarray(track.dst_pages, dtype=np.int64)
        whole = (
            self._staging is not None
            and prefill_layout.page_layout is PageLayout.NHD
            and fragmented(pages)
        )
        track.placement = self._placement(track, prefill_layout, whole)
        if track.placement is None and whole:  # too large for the area: as unfragmented
            whole = False
            track.placement = self._placement(track, prefill_layout, False)
        track.whole = whole
        track.whole_optional = (
            whole and not receive_placement(prefill_layout, track.links, len(pages)).total
        )

    def _placement(
        self, track: Track, prefill_layout: KvLayout, whole: bool
    ) -> ReceivePlacement | None:
        """The request's receive staging, if its links need it (`whole`: every link, its
        pages being fragmented) and this rank's area can ever hold it (a request larger
        than the area is written one token slot at a time)."""
        if self._staging is None:
            return None
        placement = receive_placement(prefill_layout, track.links, track.num_pages, all_links=whole)
        if not placement.total:
            return None
        if whole and not self._staging.area.fits(placement.total):
            return None
        if not self._staging.area.fits(placement.total):
            _log.warning(
                "staging",
                "request %d needs %.1f MiB of receive staging, more than the %.1f MiB "
                "area: it is written one token slot at a time (raise --pd-staging-mb)",
                track.room,
                placement.total / MIB,
                self._staging.area.capacity / MIB,
            )
            return None
        return placement

    def grant(self, track: Track) -> TransferRequest | None:
        """The request's message, with its staging grant, once it may go.

        Grants go in arrival order: a request that needs staging waits behind every
        earlier one that waits for it. The decode ranks of a server ask for the same
        requests in the same order (SGLang's scheduler is the same on each), so the
        requests granted on any rank are a prefix of that order: a request holding
        staging on one rank is granted (or was failed) on every rank, every prefill
        rank hears from all its decode ranks, it completes or fails, and its staging
        comes back. First-fit would let rank 0 grant B but not A while rank 1 grants A
        but not B: each waits for the other rank until both time out (and a large
        request could starve behind ever smaller later ones)."""
        message = track.unsent
        if message is None or track.error is not None:
            return None
        if track.placement is not None:
            assert self._staging is not None
            waiting = [
                t
                for t in self._tracks.values()
                if t is not track
                and t.unsent is not None
                and t.error is None
                and t.placement is not None
                and not t.whole_optional
            ]
            # staging only fragmentation asked for waits behind every request that
            # cannot go without it; a request that needs it, behind earlier ones
            if track.whole_optional:
                behind = bool(waiting)
            else:
                behind = any(t.arrival < track.arrival for t in waiting)
            offset = None if behind else self._staging.area.try_take(track.placement.total)
            if offset is None and track.whole_optional:
                # only fragmentation asked for staging: sent as it is, a run at a time
                track.placement, track.whole = None, False
            elif offset is None:
                return None  # back-pressure: asked again at the next poll
            else:
                track.staging_offset = offset
                message = msgspec.structs.replace(
                    message,
                    staging_base=self._staging.area.base + offset,
                    stage_all=track.whole,
                )
        track.unsent = None
        if self._states.state(track.room) is DecodeState.REQUESTED:
            self._states.progressed(track.room)  # no progress is due before it is sent
        return message

    def scatter(self, track: Track, offset: int) -> None:
        """Copies the complete request's staged blocks (its part at `offset`) into its
        pages; without the lock (the scheduler thread, which alone lets go of it)."""
        assert self._staging is not None and track.placement is not None
        started = self._clock.monotonic()
        self._staging.copies.scatter(
            self._staging.area.view(offset, track.placement.total),
            track.placement,
            track.links,
            track.dst_pages,
        )
        logger.info(
            "%s room=%d bytes=%d ms=%.3f",
            SCATTER_LINE_PREFIX,
            track.room,
            track.placement.total,
            (self._clock.monotonic() - started) * 1e3,
        )

    def drop(self, track: Track) -> None:
        """The request lets go of its staging: given back at once when nothing can land
        in it any more (`release.nothing_can_land`), else held `hold_s` as an orphan.

        Staging give-back: a request is forgotten before nothing can land when SGLang's
        deferred release gave up on a rank that is only hung; a write that rank posted
        before the hang may still land in the staging. `hold_s`
        (`TimingBounds.staging_hold_s`) is at least the deferred release SGLang holds
        pages for, past the engine's transfer timeout and the hang timeout: by then that
        write ended, and the space may be granted to another request."""
        offset, track.staging_offset = track.staging_offset, None
        if offset is None:
            return
        if nothing_can_land(track):
            self._give_back(offset)
        else:
            self._orphans.append((self._clock.monotonic() + self._hold_s, offset))

    @property
    def orphans(self) -> int:
        """Staging blocks of ended requests held until no write can land in them."""
        return len(self._orphans)

    def release_orphans(self, now: float) -> None:
        """Gives back the orphans whose hold ended by `now` (monotonic s)."""
        due = [offset for until, offset in self._orphans if until <= now]
        self._orphans = [(until, offset) for until, offset in self._orphans if until > now]
        for offset in due:
            self._give_back(offset)

    def _give_back(self, offset: int) -> None:
        """Staging came free: requests waiting for it are not stalled, they queue (their
        deadline bounds how long no staging comes free, not how long they wait)."""
        assert self._staging is not None
        self._staging.area.give_back(offset)
        for waiting in self._tracks.values():
            if waiting.unsent is not None and self._states.state(waiting.room) is (
                DecodeState.REQUESTED
            ):
                self._states.progressed(waiting.room)
