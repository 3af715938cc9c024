"""Errors of the transfer layer, all rooted in `SglPdError` through `TransferError`."""

from sgl_pd.errors import SglPdError


class TransferError(SglPdError):
    """Something in the transfer layer failed; subclasses say what."""


class MooncakeNotInstalled(TransferError):
    """The `mooncake` module cannot be imported."""


class RegistrationError(TransferError):
    """Memory could not be registered or unregistered with the transfer engine."""


class InvalidWrites(TransferError):
    """A batch of writes is malformed or reads local memory that is not registered.

    Raised before anything is sent: the batch never reached the peer.
    """


class EngineClosed(TransferError):
    """The engine was used after `close()`."""


class UnknownBatch(TransferError):
    """A batch handle was polled after its final status had already been reported, or was
    never issued by this engine."""


class PeerUnreachable(TransferError):
    """The peer's session cannot be reached (nothing listens there, or it did not answer the
    handshake in time). No byte of the batch was written."""

    def __init__(self, peer: str, reason: str) -> None:
        super().__init__(f"peer {peer} is unreachable: {reason}")
        self.peer = peer
        self.reason = reason


class TransferFailed(TransferError):
    """The engine reported a failed batch. Some writes of it may have landed: the destination
    range must be treated as garbage until it is written again.

    `may_still_land`: Mooncake reports a batch failed as soon as one of its writes failed,
    while others may still be posted and land later (up to its transfer timeout); neither
    side may reuse the memory until then. False only where nothing was posted."""

    def __init__(
        self, peer: str, n_writes: int, nbytes: int, reason: str, *, may_still_land: bool = True
    ) -> None:
        super().__init__(f"batch of {n_writes} writes ({nbytes} bytes) to {peer} failed: {reason}")
        self.peer = peer
        self.n_writes = n_writes
        self.nbytes = nbytes  # bytes
        self.reason = reason
        self.may_still_land = may_still_land
