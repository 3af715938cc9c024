"""The decode rank's one release rule: may anything still land in a request's pages or
its receive staging? Pure: it reads the request's `Track` and nothing else.

Asked for the pages by SGLang's deferred release (`DecodeMessenger.is_release_safe`),
for the receive staging when the request lets go of it (`StagingGrants.drop`), and for a
room's earlier request when a new one arrives with that room (`DecodeMessenger.request`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sgl_pd.backend.decode.track import Track


def nothing_can_land(track: Track) -> bool:
    """The release rule: no write into the request's pages or staging is in flight or
    can start, once

    - it completed: a full count proves every write landed (`Completion.check_done`);
    - or it was never sent (`track.unsent`): no prefill rank learnt where to write;
    - or every prefill rank asked has drained. A rank drains when it acks the `Abort`
      (none of its writes is in flight and none can start: the prefill side's drain
      rule, `prefill.drain.Drain.settle`) or is provably gone (its inbox and its
      transfer engine both refuse connections: the process, and its posted writes,
      ended; `DecodeMessenger.peer_lost`). A rank that is only hung is neither: the
      pages wait for its ack or for SGLang's deferred release to give up (`core.bounds`,
      held there by the backend: past the engine's transfer timeout and the hang
      timeout, so a write posted before the hang ended), the staging as long
      (`StagingGrants.drop`).

    Every rank asked, by rank, not a count of acks: each prefill rank of the prefiller
    is asked (`DecodeMessenger.request`) and may write here. SGLang's `required_acks`
    (``DecodeTransferQueue._defer_release``: ``len(kv_receiver.bootstrap_infos)``, the
    ranks asked, or 0 when this rank's receiver notified none and holds the pages only
    because a peer decode rank must) is therefore not used: a count below the ranks
    asked - 0 for a room whose track is an earlier request's (`DuplicateRequest`), or
    any caller that counts fewer - would free pages a rank still writes into."""
    if track.done_s is not None or track.unsent is not None:
        return True
    return track.prefills.keys() <= track.drained
