"""--pd-kv-checksum on the decode side: whether a complete request's pages hold what its
prefill ranks wrote, checked before SGLang decodes from them (`core.kv_checksum`)."""

from __future__ import annotations

import logging

from sgl_pd.backend.decode.track import Track
from sgl_pd.backend.kv_sums import KvSums, token_slots
from sgl_pd.core.layout import KvLayout

logger = logging.getLogger("sgl_pd.decode")


def checked(sums: KvSums, layout: KvLayout, track: Track, rank: int) -> str | None:
    """`verify`, where a failure to compute the sums (device memory, a bug) fails the
    request, never SGLang's scheduler."""
    try:
        return verify(sums, layout, track, rank)
    except Exception as e:
        logger.exception("request %d: KV checksum not computed", track.room)
        return f"the KV checksum could not be computed: {e!r}"[:500]


def verify(sums: KvSums, layout: KvLayout, track: Track, rank: int) -> str | None:
    """Why the request's pages do not hold what its prefill ranks wrote, or None: per
    prefill rank, the keyed sums of its links' heads over the tokens it sent here,
    against those its last notice carried (`track.sums`). `rank`: this decode rank."""
    start, stop = track.held_tokens, track.prompt_tokens
    if stop <= start:
        return None
    slots = token_slots(track.dst_pages, start // layout.page_size, start, stop, layout.page_size)
    regions = list(range(layout.num_regions))
    for source in sorted(track.summed_sources):
        found = sums.zeros()
        for link in track.links:
            if link.src_rank == source:
                offset = link.dst_head_offset
                sums.add_link(found, track.room, regions, link, offset, (start, stop), slots)
        got, sent = sums.read(found), track.sums[source]
        bad = [r for r in regions if got[r] != sent[r]]
        if bad:
            layer, part = divmod(bad[0], len(layout.parts))
            return (
                f"KV checksum mismatch: layer {layer} ({layout.parts[part].value}) of"
                f" tokens [{start}, {stop}) from prefill rank {source} into decode rank"
                f" {rank} ({len(bad)} of {len(regions)} regions differ): the KV"
                " that landed is not what was sent"
            )
    return None
