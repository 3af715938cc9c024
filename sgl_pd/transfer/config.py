"""Transport settings, validated once where the server arguments are read."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field

from sgl_pd.errors import ConfigError


class TransportProtocol(enum.Enum):
    TCP = "tcp"  # any host; what CPU-only machines and tests use
    RDMA = "rdma"  # InfiniBand / RoCE NICs (ConnectX)
    EFA = "efa"  # AWS EFA; needs a Mooncake build with EFA support


METADATA_P2P = "P2PHANDSHAKE"  # peers exchange segment descriptors directly, no etcd
_WILDCARDS = ("", "0.0.0.0", "::")  # bind hosts meaning every interface
TCP_INFLIGHT_WRITES = 1024  # writes; Mooncake's TCP transport queue per peer, by default


def _parse_devices(spec: str) -> tuple[tuple[str, ...], tuple[tuple[int, str], ...]]:
    """Parses an `--disaggregation-ib-device` value.

    Accepted: "" (let Mooncake pick every NIC), "mlx5_0,mlx5_1" (the same NICs for every
    shard), or a JSON object mapping a shard index to its NICs, e.g.
    '{"0": "mlx5_0", "1": "mlx5_1,mlx5_2"}'. Returns (shared NICs, per-shard NICs).
    """
    spec = spec.strip()
    if not spec:
        return (), ()
    if not spec.startswith("{"):
        return _split_devices(spec, where="--disaggregation-ib-device"), ()
    try:
        raw = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"--disaggregation-ib-device {spec!r} starts like JSON but does not parse ({e}); "
            'write e.g. {"0": "mlx5_0", "1": "mlx5_1"}'
        ) from e
    if not isinstance(raw, dict):
        raise ConfigError("--disaggregation-ib-device JSON must be an object {shard: NICs}")
    per_shard: list[tuple[int, str]] = []
    for key, value in raw.items():
        try:
            shard = int(key)
        except ValueError as e:
            raise ConfigError(
                f"--disaggregation-ib-device key {key!r} is not a shard index (0, 1, ...)"
            ) from e
        if not isinstance(value, str):
            raise ConfigError(
                f"--disaggregation-ib-device shard {shard}: NICs must be a string like "
                f'"mlx5_0,mlx5_1", got {value!r}'
            )
        names = _split_devices(value, where=f"--disaggregation-ib-device shard {shard}")
        per_shard.append((shard, ",".join(names)))
    return (), tuple(sorted(per_shard))


def _split_devices(text: str, *, where: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(","))
    if any(not n or any(c.isspace() for c in n) for n in names):
        raise ConfigError(f"{where}: {text!r} is not a comma-separated list of NIC names")
    return names


@dataclass(frozen=True)
class TransportConfig:
    """How this process's transfer engine reaches its peers.

    `protocol` accepts the enum or its string ("tcp", "rdma", "efa"); `ib_device` takes the
    `--disaggregation-ib-device` syntax (see `_parse_devices`).
    """

    protocol: TransportProtocol | str = TransportProtocol.TCP
    hostname: str = "127.0.0.1"  # address peers use to reach this host; no port
    # The address our listeners are meant to serve (`--host`); None, "", "0.0.0.0" or "::"
    # = every interface. Mooncake always binds every interface, so the Mooncake engine pins
    # its listeners to the network interface that owns this address (see mooncake.py).
    bind_host: str | None = None
    ib_device: str = ""
    metadata_server: str = METADATA_P2P
    # seconds to wait for a new peer's handshake before `PeerUnreachable`; Mooncake's own
    # handshake wait is about 60 s and holds the engine's segment lock meanwhile.
    connect_timeout_s: float = 5.0
    # Writes in flight to one peer, over all batches and threads of an engine; bigger
    # batches are cut into pipelined chunks. None = the protocol's default: on TCP 1024,
    # because Mooncake's TCP transport queues 1024 writes per peer, admits about 1024 more
    # and fails the rest at once (raise MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER and
    # MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER in the launcher before raising this); on RDMA
    # and EFA no cap.
    max_inflight_writes: int | None = None
    _shared: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _per_shard: tuple[tuple[int, str], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        proto = self.protocol
        if not isinstance(proto, TransportProtocol):
            try:
                proto = TransportProtocol(str(proto).strip().lower())
            except ValueError as e:
                accepted = ", ".join(p.value for p in TransportProtocol)
                raise ConfigError(
                    f"transfer protocol {self.protocol!r} is not one of: {accepted}"
                ) from e
            object.__setattr__(self, "protocol", proto)
        # one colon = "host:port"; IPv6 literals have two or more
        if not self.hostname or self.hostname.count(":") == 1:
            raise ConfigError(
                f"transport hostname {self.hostname!r} must be a host name or IP without a "
                "port (Mooncake picks the port and reports it as the session id)"
            )
        if self.bind_host is not None:
            bind = self.bind_host.strip()
            if bind.count(":") == 1:
                raise ConfigError(
                    f"transport bind_host {self.bind_host!r} must be an address or host name "
                    "without a port"
                )
            # one spelling for "every interface", so the engine has one case to test
            object.__setattr__(self, "bind_host", None if bind in _WILDCARDS else bind)
        if not self.metadata_server:
            raise ConfigError(f'metadata server is empty; use "{METADATA_P2P}" without etcd')
        if not self.connect_timeout_s > 0:
            raise ConfigError(
                f"connect_timeout_s must be > 0 seconds, got {self.connect_timeout_s}"
            )
        if self.max_inflight_writes is not None and self.max_inflight_writes < 2:
            raise ConfigError(
                f"max_inflight_writes must be >= 2 (two pipelined chunks) or None, got "
                f"{self.max_inflight_writes}"
            )
        shared, per_shard = _parse_devices(self.ib_device)
        object.__setattr__(self, "_shared", shared)
        object.__setattr__(self, "_per_shard", per_shard)

    @property
    def transport(self) -> TransportProtocol:
        """`protocol` as the enum (`__post_init__` has converted any string)."""
        assert isinstance(self.protocol, TransportProtocol)
        return self.protocol

    @property
    def inflight_cap(self) -> int | None:
        """Writes allowed in flight to one peer; None = no cap."""
        if self.max_inflight_writes is not None:
            return self.max_inflight_writes
        return TCP_INFLIGHT_WRITES if self.transport is TransportProtocol.TCP else None

    def devices_for(self, shard: int | None = None) -> str:
        """The comma-separated NIC filter to give Mooncake for `shard` ("" = all NICs).

        With a per-shard mapping every shard that builds an engine must be listed.
        """
        if not self._per_shard:
            return ",".join(self._shared)
        mapping = dict(self._per_shard)
        if shard is None or shard not in mapping:
            raise ConfigError(
                f"--disaggregation-ib-device maps shards {sorted(mapping)} but shard {shard} "
                "needs NICs; add it to the JSON object"
            )
        return mapping[shard]
