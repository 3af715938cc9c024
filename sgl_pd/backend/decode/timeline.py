"""A decode request's timeline for tracing (`core.timeline.decode_timeline`), sent out
once per request: at its hand-off, or when SGLang lets go of it after a failure."""

from __future__ import annotations

from sgl_pd.backend.decode.track import Track
from sgl_pd.backend.tracing import RequestTracing
from sgl_pd.core.timeline import decode_timeline


def emit_timeline(tracing: RequestTracing, track: Track, rank: int, end_s: float) -> None:
    """`end_s`: monotonic s, when the request left this rank's transfer."""
    if track.traced or not tracing.wanted:
        return
    track.traced = True
    staged = 0 if track.placement is None else track.placement.total  # bytes
    tracing.emit(
        decode_timeline(
            room=track.room,
            rank=rank,
            seen_s=track.seen_s,
            found_s=track.found_s,
            requested_s=track.started_s,
            complete_s=track.done_s,
            end_s=end_s,
            attrs=(
                ("sgl_pd.pages", track.num_pages),
                ("sgl_pd.staged_bytes", staged),
                ("sgl_pd.held_tokens", track.held_tokens),
            ),
            error=track.error,
        )
    )
