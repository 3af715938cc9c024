"""Why a request's transfer failed, as one of a few causes an operator can act on.

The set is closed on purpose: it is a metric label (`sgl_pd_transfer_failures_total`),
and a label with unbounded values would grow the server's /metrics without limit.
"""

from __future__ import annotations

import enum


class FailureCause(enum.Enum):
    ABORT = "abort"  # a client went away, or SGLang or the decoder's scheduler gave up
    TIMEOUT = "timeout"  # a deadline passed (bootstrap, transfer) with no progress
    PEER_LOST = "peer_lost"  # liveness: a peer is gone or hung, or this process froze
    REFUSED = "refused"  # a peer turned the request down (owner, TP, capacity, config)
    WRITE_FAILURE = "write_failure"  # a KV or metadata write failed, or its count is wrong
    CHECKSUM = "checksum"  # the KV that landed is not what was sent (--pd-kv-checksum)
