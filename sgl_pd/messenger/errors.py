"""Errors of the control-plane messenger, all rooted in `SglPdError` through `MessengerError`."""

from sgl_pd.core.wire import ErrorCode
from sgl_pd.errors import SglPdError


class MessengerError(SglPdError):
    """A control message could not be sent or a peer could not be found; subclasses say why."""


class MessengerClosed(MessengerError):
    """The object was used after `close()`, or `close()` cancelled a wait in progress."""


class InvalidAddress(MessengerError, ValueError):
    """An address is not "host:port" with a port in 1..65535."""


class BindError(MessengerError):
    """A socket could not be bound (the host is not an address of this machine, ...)."""


class AddressInUse(BindError):
    """The port is taken by another process: pick another `--disaggregation-bootstrap-port`
    or stop the process holding it."""


class PeerUnreachable(MessengerError):
    """A message could not be handed to a peer's inbox within the send timeout: nothing is
    listening there, the connection broke, or the peer stopped reading. It was not sent."""

    def __init__(self, peer: str, reason: str) -> None:
        super().__init__(f"peer inbox {peer} is unreachable: {reason}")
        self.peer = peer


class BootstrapError(MessengerError):
    """A prefill registry answered with an error or with registrations that do not fit."""


class RegistryRefused(BootstrapError):
    """A prefill registry answered with an error; `code` says which (e.g. OVERLOADED)."""

    def __init__(self, message: str, code: ErrorCode) -> None:
        super().__init__(message)
        self.code = code


class BootstrapTimeout(BootstrapError):
    """A prefill registry did not answer, or did not have every prefill rank registered,
    within the timeout. The message names the address."""
