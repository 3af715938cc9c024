"""Maps what a request's transfer can end with (an error raised here, an error a peer
reported, the reason this side aborted) to its `FailureCause`."""

from __future__ import annotations

from sgl_pd.core.errors import LayoutError, PlanError, ShardingError, WireError
from sgl_pd.core.failures import FailureCause
from sgl_pd.core.wire import AbortReason, ErrorCode
from sgl_pd.messenger.errors import MessengerError
from sgl_pd.messenger.errors import PeerUnreachable as InboxUnreachable
from sgl_pd.transfer.errors import PeerUnreachable


def cause_of(error: BaseException) -> FailureCause:
    """The cause to count for `error`; an unexpected error (a bug in a writer) counts as
    a write failure, as the request's KV did not get written."""
    if isinstance(error, PeerUnreachable | InboxUnreachable):
        return FailureCause.PEER_LOST  # nothing was sent: the peer's engine or inbox is away
    if isinstance(error, TimeoutError):
        return FailureCause.TIMEOUT
    if isinstance(error, WireError | PlanError | ShardingError | LayoutError):
        return FailureCause.REFUSED  # the two sides disagree on what may be sent
    if isinstance(error, MessengerError):
        return FailureCause.REFUSED  # a registry answered, but not with what fits
    return FailureCause.WRITE_FAILURE  # TransferError, CountingError, a bug


# What a decoder learns from a prefill rank's `ErrorMsg`: the prefill side reports every
# failure of its own as TRANSFER_FAILED (its cause is counted there, under role="prefill").
_BY_CODE = {
    ErrorCode.BAD_REQUEST: FailureCause.REFUSED,
    ErrorCode.OVERLOADED: FailureCause.REFUSED,
    ErrorCode.UNKNOWN_REQUEST: FailureCause.REFUSED,
    ErrorCode.UNKNOWN_PEER: FailureCause.REFUSED,
    ErrorCode.NOT_READY: FailureCause.REFUSED,
    ErrorCode.CONFLICT: FailureCause.REFUSED,
    ErrorCode.NOT_OWNER: FailureCause.REFUSED,
    ErrorCode.TRANSFER_FAILED: FailureCause.WRITE_FAILURE,
    ErrorCode.INTERNAL: FailureCause.WRITE_FAILURE,
}

_BY_ABORT = {
    AbortReason.CLIENT: FailureCause.ABORT,
    AbortReason.SHUTDOWN: FailureCause.ABORT,
    AbortReason.TIMEOUT: FailureCause.TIMEOUT,
    AbortReason.ERROR: FailureCause.WRITE_FAILURE,
}


def cause_of_code(code: ErrorCode) -> FailureCause:
    """The cause a decoder counts for an error a prefill rank reported."""
    return _BY_CODE[code]


def cause_of_abort(reason: AbortReason) -> FailureCause:
    """The cause a decoder counts when it ends a request itself with this reason."""
    return _BY_ABORT[reason]
