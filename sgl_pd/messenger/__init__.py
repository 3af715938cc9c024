"""Control-plane messaging over ZeroMQ: the I/O edge around the core's wire messages.

    inbox     Inbox: a rank's ROUTER on a free port, one thread decoding into a handler
    link      Link, LinkPool: DEALERs sending to peer inboxes, bounded send waits
    registry  RegistryServer (prefill, at the bootstrap port), RegistryClient (blocking)
    peers     PeerDirectory: decode side, bootstrap address -> prefill shards, non-blocking
    errors    MessengerError and its subclasses (all SglPdError)

Threads (all daemon, named sgl-pd-*, each with a stop event and a 0.1 s receive timeout):
one per Inbox, one per RegistryServer, `workers` per PeerDirectory.
"""

from sgl_pd.messenger.errors import (
    AddressInUse,
    BindError,
    BootstrapError,
    BootstrapTimeout,
    InvalidAddress,
    MessengerClosed,
    MessengerError,
    PeerUnreachable,
    RegistryRefused,
)
from sgl_pd.messenger.inbox import Inbox
from sgl_pd.messenger.link import Link, LinkPool
from sgl_pd.messenger.peers import PeerDirectory, PrefillTable, RegistryQuerier
from sgl_pd.messenger.registry import RegistryClient, RegistryServer

__all__ = [
    "AddressInUse",
    "BindError",
    "BootstrapError",
    "BootstrapTimeout",
    "Inbox",
    "InvalidAddress",
    "Link",
    "LinkPool",
    "MessengerClosed",
    "MessengerError",
    "PeerDirectory",
    "PeerUnreachable",
    "PrefillTable",
    "RegistryClient",
    "RegistryQuerier",
    "RegistryRefused",
    "RegistryServer",
]
