"""Errors of the pure core, one family per module, all rooted in `SglPdError`."""

from sgl_pd.errors import SglPdError


class LayoutError(SglPdError):
    """A KV layout is inconsistent (non-positive sizes, MLA without a latent width, ...)."""


class ShardingError(SglPdError):
    """Two sharding schemes cannot be linked (head count not divisible by the TP size, ...)."""


class PlanError(SglPdError):
    """A transfer cannot be planned: page lists too short or repeated, bad token or layer range,
    or a write that would run past a registered region."""


class CountingError(SglPdError):
    """A completion signal does not fit the expected write groups of a request."""


class UnknownSource(CountingError):
    """A completion came from a source shard that has no link to this decoder."""


class DuplicateCompletion(CountingError):
    """The same (source shard, sequence number) completion was counted twice."""


class CompletionOverflow(CountingError):
    """A completion's sequence number lies beyond what the source can send for the request."""


class WireError(SglPdError):
    """A frame could not be decoded; the peer or the link is at fault, never this process."""


class TruncatedFrame(WireError):
    """The frame is shorter than its header says: the peer closed early or a read was cut."""


class CorruptFrame(WireError):
    """Bad magic, checksum mismatch, trailing bytes or an oversize length field."""


class ProtocolVersionMismatch(WireError):
    """The peer speaks another PROTOCOL_VERSION: upgrade both sides to the same sgl_pd."""


class LayoutMismatch(WireError):
    """The peer's KV layout hash differs: both sides must serve the same model, page size,
    dtype and page layout (NHD/HND)."""


class MalformedMessage(WireError):
    """The checksum held but the body is not a valid message of this protocol version."""


class StateError(SglPdError):
    """A request state machine was driven wrongly."""


class IllegalTransition(StateError):
    """A transition not in the allowed-transitions table was requested."""


class UnknownRequest(StateError):
    """The request id is not tracked (never added, or already forgotten)."""


class DuplicateRequest(StateError):
    """A request id was added twice while the first is still tracked."""


class InvalidMessage(WireError, ValueError):
    """A message's fields contradict each other. Raised when one is built; when a received
    body fails this check the codec reports `MalformedMessage`. (A ValueError so that
    msgspec folds it into its validation error while decoding.)"""


class ClockError(SglPdError, ValueError):
    """A manual clock was asked to move backwards."""
