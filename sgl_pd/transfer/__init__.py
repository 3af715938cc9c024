"""KV transfer layer: one `TransferEngine` protocol, a Mooncake backend and an in-memory fake.

Importing this package stays cheap: `mooncake` is imported only when a
`MooncakeTransferEngine` is built (``sgl_pd.transfer.mooncake``).
"""

from sgl_pd.transfer.completion import CompletionWordWriter, write_with_completion
from sgl_pd.transfer.config import TransportConfig, TransportProtocol
from sgl_pd.transfer.engine import BatchHandle, BatchStatus, TransferEngine, Writes
from sgl_pd.transfer.errors import (
    EngineClosed,
    InvalidWrites,
    MooncakeNotInstalled,
    PeerUnreachable,
    RegistrationError,
    TransferError,
    TransferFailed,
    UnknownBatch,
)

__all__ = [
    "BatchHandle",
    "BatchStatus",
    "CompletionWordWriter",
    "EngineClosed",
    "InvalidWrites",
    "MooncakeNotInstalled",
    "PeerUnreachable",
    "RegistrationError",
    "TransferEngine",
    "TransferError",
    "TransferFailed",
    "TransportConfig",
    "TransportProtocol",
    "UnknownBatch",
    "Writes",
    "write_with_completion",
]
