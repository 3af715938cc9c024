"""One sgl_pd messenger per SGLang scheduler process (one TP rank), in SGLang's
``BaseKVManager`` terms.

`SglPdKVManager` is the base of the roles' classes, `PrefillKVManager` and
`DecodeKVManager`; `roles` picks a scheduler's (SGLang asks for one manager class for
both roles). What both share is set up here: this rank's transfer engine (with the KV
pool and metadata buffers registered), its inbox, its outbox (sends that never block
SGLang's scheduler), its liveness thread and /health report. The role's class adds its
messenger: the prefill side writes pages, the decode side asks for them and counts their
completion words.
"""

from __future__ import annotations

import abc
import logging
import secrets
import threading
from dataclasses import dataclass, replace
from typing import Any

import msgspec
from sglang.srt.disaggregation.base.conn import BaseKVManager

from sgl_pd.backend import health, sliding_window_glue
from sgl_pd.backend.addresses import Hosts, resolve_hosts
from sgl_pd.backend.heartbeats import Heartbeats, Watched
from sgl_pd.backend.kv_sums import KvSums
from sgl_pd.backend.metrics import TransferMetrics
from sgl_pd.backend.pool import PoolDescription, describe_pool, state_kinds
from sgl_pd.backend.relayout_copies import PoolCopies
from sgl_pd.backend.server_options import unsupported_option
from sgl_pd.backend.staging_area import MIB, Staging, StagingArea, staging_bytes
from sgl_pd.backend.state_slots import mamba_dtypes
from sgl_pd.backend.tracing import RequestTracing
from sgl_pd.config import SglPdConfig
from sgl_pd.core.clock import Clock, SystemClock
from sgl_pd.core.kv_checksum import checksum_key
from sgl_pd.core.liveness import FreezeWatch
from sgl_pd.core.regions import Region
from sgl_pd.core.sharding import ShardingScheme
from sgl_pd.core.wire import (
    Delivered,
    FrameCodec,
    Heartbeat,
    HeartbeatAck,
    Message,
    MetadataBuffers,
    Role,
    Sequenced,
    ShardRegistration,
    SlotArea,
)
from sgl_pd.errors import ConfigError
from sgl_pd.log_limits import LogLimiter
from sgl_pd.messenger.auth import ClusterAuth
from sgl_pd.messenger.inbox import Inbox
from sgl_pd.messenger.link import LinkPool
from sgl_pd.messenger.outbox import Outbox
from sgl_pd.messenger.reliable import ControlFaults, ReliableReceiver, ReliableSender
from sgl_pd.transfer.config import TransportConfig
from sgl_pd.transfer.engine import TransferEngine
from sgl_pd.transfer.faults import FaultInjectingEngine, WriteFaults
from sgl_pd.transfer.mooncake import MooncakeTransferEngine

logger = logging.getLogger("sgl_pd.manager")
_ignored = LogLimiter(logger)


class _SingleDataParallelRank:
    """SGLang's decode scheduler asks each prefiller's DP size; sgl_pd serves DP size 1,
    so every prefiller answers rank 0 without a network round trip."""

    dp_size = 1
    follow_bootstrap_room = True

    def get(self, bootstrap_addr: str) -> _SingleDataParallelRank:
        return self


class _Watching:
    """The role's messenger as the liveness thread sees it, plus: nothing more is resent
    to a peer declared lost (every request it had here fails)."""

    def __init__(
        self,
        role: Watched,
        reliable: ReliableSender,
        deliveries: ReliableReceiver,
        metrics: TransferMetrics,
    ) -> None:
        self._role = role
        self._reliable = reliable
        self._deliveries = deliveries
        self._metrics = metrics

    def active_peers(self) -> dict[str, str | None]:
        return self._role.active_peers()

    def peer_lost(self, inbox: str, why: str, gone: bool) -> None:
        self._reliable.forget_peer(inbox)
        self._role.peer_lost(inbox, why, gone)

    def resumed_after_freeze(self, frozen_s: float) -> None:
        self._role.resumed_after_freeze(frozen_s)

    def tables(self) -> dict[str, int]:
        return {
            **self._role.tables(),
            "control_pending": self._reliable.pending,
            "deliveries_remembered": self._deliveries.remembered(),
        }

    def housekeeping(self) -> None:
        self._role.housekeeping()
        self._metrics.set_tables(self.tables())
        self._metrics.control_totals(
            {
                "resent": self._reliable.resent,
                "given_up": self._reliable.given_up,
                "duplicate": self._deliveries.duplicates,
                "injected_drop": self._reliable.faults.dropped + self._deliveries.faults.dropped,
            }
        )


def cluster_auth(config: SglPdConfig) -> ClusterAuth | None:
    """The key every control connection of this cluster uses; None with --pd-no-auth.
    Raises `ConfigError` when no secret was given."""
    secret = config.auth_secret()
    if secret is None:
        logger.warning("sgl_pd serves without authentication (--pd-no-auth)")
        return None
    auth = ClusterAuth.from_secret(secret)
    logger.info("sgl_pd control plane authenticated, cluster key %s", auth.fingerprint)
    return auth


@dataclass(frozen=True)
class Parallelism:
    """This scheduler process's place in SGLang's resolved parallel layout (not the raw
    flags: ``--dp 2 --enable-dp-attention`` resolves to attention DP 2, DP 1)."""

    tp_rank: int
    attn_tp_size: int  # ranks that shard one request's KV heads
    attn_dp_size: int  # attention DP: independent pools, each with its own requests
    dp_size: int  # whole-server replicas under SGLang's DP controller
    pp_size: int

    @classmethod
    def of(cls, server_args: Any) -> Parallelism:
        from sglang.srt.runtime_context import get_parallel

        p = get_parallel()
        try:
            return cls(
                int(p.tp_rank), int(p.attn_tp_size), int(p.attn_dp_size), int(p.dp_size),
                int(p.pp_size),
            )  # fmt: skip
        except (ValueError, RuntimeError):  # not published: a process outside a scheduler
            tp = int(server_args.tp_size)
            return cls(0, tp, 1, int(server_args.dp_size), int(server_args.pp_size))


def _kv_heads(kv_args: Any, server_args: Any, attn_tp_size: int) -> tuple[int, int]:
    """(KV heads on this rank, KV heads of the model), as SGLang shards them."""
    if hasattr(kv_args, "kv_head_num") and hasattr(kv_args, "total_kv_head_num"):
        return int(kv_args.kv_head_num), int(kv_args.total_kv_head_num)
    from sglang.srt.configs.model_config import ModelConfig

    model = ModelConfig.from_server_args(server_args)
    return int(model.get_num_kv_heads(attn_tp_size)), int(model.get_total_num_kv_heads())


def _transport(config: SglPdConfig, server_args: Any, hosts: Hosts) -> TransportConfig:
    ib_device = server_args.disaggregation_ib_device or ""
    protocol = config.transport
    if protocol == "auto":
        protocol = "rdma" if ib_device else "tcp"
    return TransportConfig(
        protocol=protocol, hostname=hosts.advertise, bind_host=hosts.bind, ib_device=ib_device
    )


class SglPdKVManager(BaseKVManager):
    # SGLang reads these on every manager
    supports_host_destination = False
    enable_all_cp_ranks_for_transfer = False
    role: Role  # set by each role's class

    def __init__(
        self,
        args: Any,
        disaggregation_mode: Any,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        self.kv_args = args
        self.config = SglPdConfig.from_environment()
        # options sgl_pd cannot serve, refused by the backend itself (also when SGLang's
        # own launcher started the server with the plugin loaded)
        refusal = unsupported_option(
            server_args,
            self.role.value,
            kv_send=self.config.kv_send,
            first_token=self.config.first_token,
            state_kinds=state_kinds(args),
            local_prefill_max_tokens=self.config.local_prefill_max_tokens,
            kv_checksum=self.config.kv_checksum,
        )
        if refusal is not None:
            raise ConfigError(refusal)
        self.auth = cluster_auth(self.config)
        parallel = Parallelism.of(server_args)
        for flag, value in (("--dp-size", parallel.dp_size), ("--pp-size", parallel.pp_size)):
            if value != 1:
                raise ConfigError(f"sgl_pd serves {flag} 1 for now, got {value}")
        if parallel.attn_dp_size > 1 and self.role is Role.PREFILL:
            raise ConfigError(
                "sgl_pd serves DP attention on decode servers only for now: start the "
                "prefill server without --enable-dp-attention / --attn-dp-size"
            )
        self.req_to_decode_prefix_len: dict[int, int] = {}
        self.prefill_info_table = _SingleDataParallelRank()
        self.pool: PoolDescription = describe_pool(
            args,
            bool(is_mla_backend),
            None if is_mla_backend else _kv_heads(args, server_args, parallel.attn_tp_size),
            sliding_window_glue.window(),
            parallel.attn_tp_size,
            sliding_window_glue.sliding_layers(),
        )
        if any(c.kind == "mamba" for c in self.pool.state):
            # what SGLang's environment makes of its element types, for the pair check
            state = tuple(
                msgspec.structs.replace(c, dtypes=mamba_dtypes()) if c.kind == "mamba" else c
                for c in self.pool.state
            )
            self.pool = replace(self.pool, state=state)
        self.layout = self.pool.layout
        # with DP attention every attention-DP rank is a decoder of its own, with the
        # whole pool of its requests: rank engine_rank (its attention-TP rank) of
        # attn_tp_size. The NIC and fault seed follow the process's TP rank.
        self.rank = int(args.engine_rank)
        self.scheme = ShardingScheme(parallel.attn_tp_size)
        self.tp_rank = parallel.tp_rank
        # from the OS, not `random`: SGLang seeds `random` alike in every rank of a server
        self.instance = secrets.randbits(63)
        # listeners bind --host; peers are told an address they can reach
        hosts = resolve_hosts(
            str(server_args.host), self.config.advertise_host, self.config.allow_loopback_advertise
        )

        self.engine: TransferEngine = MooncakeTransferEngine(
            _transport(self.config, server_args, hosts), shard=self.tp_rank
        )
        faults = WriteFaults(
            delay_s=self.config.inject_write_delay_ms / 1000,
            failure_rate=self.config.inject_write_failure_rate,
            corruption_rate=self.config.inject_kv_corruption_rate,
            seed=self.tp_rank,
        )
        if faults.active:
            logger.warning("fault injection on KV writes: %s", faults)
            self.engine = FaultInjectingEngine(self.engine, faults)
        state_regions = [r for c in self.pool.state for r in c.regions]
        for region in (*self.pool.kv.regions, *self.pool.aux, *state_regions):
            self.engine.register(region.base, region.length)
        self.staging = self._staging(server_args)
        self.codec = FrameCodec(self.layout.compat_hash())
        self.links = LinkPool(self.codec.layout_hash, auth=self.auth)
        self.outbox = Outbox(self.links, name=f"{self.role.value}-{self.rank}")
        self.closing = threading.Event()
        self.metrics = TransferMetrics(bool(server_args.enable_metrics), self.role.value)
        # spans only under SGLang's --enable-trace, whose scheduler set up the exporter
        self.tracing = RequestTracing(bool(getattr(server_args, "enable_trace", False)))
        self.inbox = Inbox(
            hosts.bind,
            self.codec,
            self._on_message,
            name=f"sgl-pd-inbox-{self.rank}",
            advertise_host=hosts.advertise,
            auth=self.auth,
        )

        clock = SystemClock()
        self.bounds = self.config.bounds(decode=self.role is Role.DECODE)
        problems = self.bounds.violations()
        if problems:
            raise ConfigError(f"sgl_pd's timing bounds do not hold: {problems[0]}")
        drop_rate = self.config.inject_control_drop_rate
        control_faults = ControlFaults(drop_rate, seed=self.tp_rank)
        if control_faults.active:
            logger.warning("fault injection: control frames dropped at %g", drop_rate)
        name = f"{self.role.value}-{self.rank}"
        self.reliable = ReliableSender(
            self.outbox, self.inbox.endpoint, self.instance, self.bounds, clock,
            faults=control_faults, name=name,
        )  # fmt: skip
        self.deliveries = ReliableReceiver(
            self.outbox, self.inbox.endpoint, self.bounds, clock, faults=control_faults
        )
        self.freeze = FreezeWatch(clock, self.config.hang_timeout_s)
        watched = self._start_role(server_args, clock)
        self.heartbeats = Heartbeats(
            self.inbox.endpoint,
            self.outbox,
            _Watching(watched, self.reliable, self.deliveries, self.metrics),
            hang_timeout_s=self.config.hang_timeout_s,
            clock=clock,
            name=f"{self.role.value}-{self.rank}",
            freeze=self.freeze,
            on_lost=self.metrics.peer_lost,
        )
        health.watch(self.problem)
        self._serve()
        logger.info(
            "sgl_pd %s rank %d/%d ready: session %s, inbox %s, %d layers, %d pages",
            self.role.value,
            self.rank,
            self.scheme.tp_size,
            self.engine.session_id,
            self.inbox.endpoint,
            self.layout.num_layers,
            self.pool.num_pages,
        )

    def _staging(self, server_args: Any) -> Staging | None:
        """This rank's re-layout staging (`core.relayout`), or None where its pool never
        stages (HND) or --pd-staging-mb is 0."""
        chunk = int(getattr(server_args, "chunked_prefill_size", 0) or 0)
        nbytes = staging_bytes(
            self.config.staging_mb, self.role, self.pool, chunk if chunk > 0 else 8192
        )
        if not nbytes:
            return None
        device = self._pool_device(server_args)
        staging = Staging(StagingArea(nbytes, device, self.engine), PoolCopies(self.pool, device))
        logger.info(
            "sgl_pd %s rank %d: %.1f MiB of %s staging for KV heads re-laid out under "
            "mismatched TP and fragmented pages (--pd-staging-mb)",
            self.role.value,
            self.rank,
            staging.area.capacity / MIB,
            "gather" if self.role is Role.PREFILL else "receive",
        )
        return staging

    def _pool_device(self, server_args: Any) -> str:
        device = str(getattr(server_args, "device", None) or "cuda")
        if device == "cuda":  # the pool lives on this rank's GPU
            device = f"cuda:{int(getattr(self.kv_args, 'gpu_id', 0) or 0)}"
        return device

    def _kv_sums(self, server_args: Any) -> KvSums | None:
        """--pd-kv-checksum: this rank's keyed sums of its pool (`core.kv_checksum`)."""
        if not self.config.kv_checksum:
            return None
        key = checksum_key(self.config.auth_secret())  # (None with --pd-no-auth)
        try:
            return KvSums(self.pool, self._pool_device(server_args), key)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    # -- the role's part ----------------------------------------------------------------

    @abc.abstractmethod
    def _start_role(self, server_args: Any, clock: Clock) -> Watched:
        """Builds the role's messenger; returns what the liveness thread watches."""

    @abc.abstractmethod
    def _on_role_message(self, message: Message) -> None:
        """Inbox thread: one message for the role's messenger; must not block."""

    def _serve(self) -> None:
        """Once everything exists: let peers learn about this rank (prefill registers)."""

    def _role_problem(self) -> str | None:
        return None

    @abc.abstractmethod
    def _close_role(self) -> None: ...

    # -- shared -------------------------------------------------------------------------

    def registration_for(
        self, *, layer_group_size: int, completion: SlotArea | None
    ) -> ShardRegistration:
        return ShardRegistration(
            role=self.role,
            rank=self.rank,
            scheme=self.scheme,
            session=self.engine.session_id,
            layout=self.layout,
            num_pages=self.pool.num_pages,
            kv_regions=self.pool.kv.regions,
            layer_group_size=layer_group_size,
            metadata=MetadataBuffers(
                regions=self.pool.aux, row_bytes=self.pool.aux_item_bytes, rows=self.pool.aux_rows
            ),
            completion=completion,
            inbox=self.inbox.endpoint,
            instance=self.instance,
            decoder_samples_first=self.config.first_token == "decode",
            writes_end_within_ms=round(1000 * self.bounds.required_deferred_release_s),
            state=self.pool.state,
            staging=(
                Region(self.staging.area.base, self.staging.area.capacity)
                if self.staging is not None and self.role is Role.DECODE
                else None
            ),
        )

    def ignore(self, message: Message) -> None:
        """A message this role does not take (a peer's bug, or a hostile one)."""
        kind = type(message).__name__
        _ignored.warning(kind, "%s rank ignores %s messages", self.role.value, kind)

    def _on_message(self, message: Message) -> None:
        """Inbox thread: heartbeats here, everything else to the role."""
        if isinstance(message, Heartbeat):
            self.heartbeats.on_heartbeat(message)
        elif isinstance(message, HeartbeatAck):
            self.heartbeats.on_ack(message)
        elif isinstance(message, Sequenced):
            guarded = self.deliveries.accept(message)
            if guarded is not None:
                self._on_role_message(guarded)
        elif isinstance(message, Delivered):
            self.reliable.on_delivered(message)
        else:
            self._on_role_message(message)

    def problem(self) -> str | None:
        """What keeps this rank from serving PD requests, or None (read by /health)."""
        if not self.inbox.alive:
            return "the messenger's inbox thread stopped: no message from peers arrives"
        if not self.heartbeats.alive:
            return "the liveness thread stopped: lost peers would go unnoticed"
        if self.outbox.thread_failures:
            return f"{self.outbox.thread_failures} outbox thread(s) died: messages may be lost"
        return self._role_problem()

    def close(self) -> None:
        # Writers end before the inbox and outbox close: their drain acks still go out,
        # and a peer never finds this inbox refusing while a write of ours may land (it
        # would then take this process for gone; the engine closes last for the same
        # reason).
        self.closing.set()
        self.heartbeats.stop()
        self._close_role()
        self.reliable.close()
        self.inbox.close()
        self.outbox.close()
        self.links.close()
        if self.staging is not None:
            self.staging.area.close()
        self.engine.close()
