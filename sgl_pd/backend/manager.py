"""One sgl_pd messenger per SGLang scheduler process (one TP rank), in SGLang's
``BaseKVManager`` terms.

It owns this rank's transfer engine (with the KV pool and metadata buffers registered),
its inbox, its outbox (sends that never block SGLang's scheduler), its liveness thread,
and the role's messenger: `PrefillMessenger` writes pages, `DecodeMessenger` asks for
them and counts their completion words. `SglPdKVManager` dispatches each incoming
message to the role's handler; the role is fixed at start-up.
"""

from __future__ import annotations

import logging
import random
import socket
import threading
from typing import Any

from sglang.srt.disaggregation.base.conn import BaseKVManager

from sgl_pd.backend import health
from sgl_pd.backend.decode_messenger import DecodeMessenger
from sgl_pd.backend.heartbeats import Heartbeats
from sgl_pd.backend.layerwise_glue import attach_messenger
from sgl_pd.backend.metrics import TransferMetrics
from sgl_pd.backend.pool import PoolDescription, describe_pool
from sgl_pd.backend.prefill_messenger import PrefillMessenger
from sgl_pd.config import SglPdConfig
from sgl_pd.core.clock import SystemClock
from sgl_pd.core.sharding import ShardingScheme
from sgl_pd.core.wire import (
    Abort,
    AbortAck,
    ChunkNotice,
    ErrorMsg,
    FrameCodec,
    Heartbeat,
    HeartbeatAck,
    Message,
    MetadataBuffers,
    RegisterShard,
    Role,
    ShardRegistration,
    TransferRequest,
)
from sgl_pd.errors import ConfigError, SglPdError
from sgl_pd.layerwise.streamer import LayerStreamer
from sgl_pd.messenger.inbox import Inbox
from sgl_pd.messenger.link import LinkPool
from sgl_pd.messenger.outbox import Outbox
from sgl_pd.messenger.peers import PeerDirectory
from sgl_pd.messenger.registry import RegistryClient
from sgl_pd.transfer.config import TransportConfig
from sgl_pd.transfer.engine import TransferEngine
from sgl_pd.transfer.faults import FaultInjectingEngine, WriteFaults
from sgl_pd.transfer.mooncake import MooncakeTransferEngine

logger = logging.getLogger("sgl_pd.manager")

REGISTRY_PROBE_INTERVAL_S = 5.0  # how often a prefill rank checks its registry answers
REGISTRY_PROBE_TIMEOUT_S = 5.0


class _SingleDataParallelRank:
    """SGLang's decode scheduler asks each prefiller's DP size; sgl_pd serves DP size 1,
    so every prefiller answers rank 0 without a network round trip."""

    dp_size = 1
    follow_bootstrap_room = True

    def get(self, bootstrap_addr: str) -> _SingleDataParallelRank:
        return self


def _kv_heads(kv_args: Any, server_args: Any) -> tuple[int, int]:
    """(KV heads on this rank, KV heads of the model), as SGLang shards them."""
    if hasattr(kv_args, "kv_head_num") and hasattr(kv_args, "total_kv_head_num"):
        return int(kv_args.kv_head_num), int(kv_args.total_kv_head_num)
    from sglang.srt.configs.model_config import ModelConfig

    model = ModelConfig.from_server_args(server_args)
    tp = int(server_args.tp_size)
    return int(model.get_num_kv_heads(tp)), int(model.get_total_num_kv_heads())


def _advertise_host(config: SglPdConfig, server_args: Any) -> str:
    if config.advertise_host:
        return config.advertise_host
    host = str(server_args.host)
    if host not in ("", "0.0.0.0", "::"):
        return "127.0.0.1" if host == "localhost" else host
    return socket.gethostbyname(socket.gethostname())


def _transport(config: SglPdConfig, server_args: Any, host: str) -> TransportConfig:
    ib_device = server_args.disaggregation_ib_device or ""
    protocol = config.transport
    if protocol == "auto":
        protocol = "rdma" if ib_device else "tcp"
    return TransportConfig(protocol=protocol, hostname=host, ib_device=ib_device)


class SglPdKVManager(BaseKVManager):
    # SGLang reads these on every manager
    supports_host_destination = False
    enable_all_cp_ranks_for_transfer = False
    # A decode request that ends early keeps its pages in SGLang's deferred release until
    # `is_abort_release_safe`: every prefill rank acked its Abort or was declared lost.
    enable_deferred_decode_kv_release = True

    def __init__(
        self,
        args: Any,
        disaggregation_mode: Any,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        self.kv_args = args
        self.config = SglPdConfig.from_environment()
        self.role = Role.PREFILL if disaggregation_mode.value == "prefill" else Role.DECODE
        for flag, value in (("--dp-size", server_args.dp_size), ("--pp-size", server_args.pp_size)):
            if int(value) != 1:
                raise ConfigError(f"sgl_pd serves {flag} 1 for now, got {value}")
        self.req_to_decode_prefix_len: dict[int, int] = {}
        self.prefill_info_table = _SingleDataParallelRank()
        self.pool: PoolDescription = describe_pool(
            args, bool(is_mla_backend), None if is_mla_backend else _kv_heads(args, server_args)
        )
        self.layout = self.pool.layout
        self.rank = int(args.engine_rank)
        self.scheme = ShardingScheme(int(server_args.tp_size))
        self.instance = random.getrandbits(63)
        host = _advertise_host(self.config, server_args)

        self.engine: TransferEngine = MooncakeTransferEngine(
            _transport(self.config, server_args, host), shard=self.rank
        )
        faults = WriteFaults(
            delay_s=self.config.inject_write_delay_ms / 1000,
            failure_rate=self.config.inject_write_failure_rate,
            seed=self.rank,
        )
        if faults.active:
            logger.warning("fault injection on KV writes: %s", faults)
            self.engine = FaultInjectingEngine(self.engine, faults)
        clock = SystemClock()
        for region in (*self.pool.kv.regions, *self.pool.aux):
            self.engine.register(region.base, region.length)
        self.codec = FrameCodec(self.layout.compat_hash())
        self.links = LinkPool(self.codec.layout_hash)
        self.outbox = Outbox(self.links, name=f"{self.role.value}-{self.rank}")
        self._closing = threading.Event()
        self.metrics = TransferMetrics(bool(server_args.enable_metrics), self.role.value)
        self.inbox = Inbox(host, self.codec, self._on_message, name=f"sgl-pd-inbox-{self.rank}")
        self.streamer: LayerStreamer | None = None

        if self.role is Role.PREFILL:
            layerwise = self.config.kv_send == "layerwise"
            self.prefill = PrefillMessenger(
                rank=self.rank,
                instance=self.instance,
                scheme=self.scheme,
                pool=self.pool,
                engine=self.engine,
                layerwise=layerwise,
                send_to_decoder=self.outbox.send,
                metrics=self.metrics,
                timeout_s=self.config.transfer_timeout_s,
                clock=clock,
            )
            watched: PrefillMessenger | DecodeMessenger = self.prefill
            self.streamer = attach_messenger(self.prefill, layerwise)
            self.registration = self._registration(completion=None)
            self._bootstrap_addr = self._local_bootstrap_addr(server_args)
            self._registry_problem: str | None = None
            threading.Thread(
                target=self.register_to_bootstrap, name="sgl-pd-register", daemon=True
            ).start()
        else:
            self.decode = DecodeMessenger(
                rank=self.rank,
                scheme=self.scheme,
                pool=self.pool,
                engine=self.engine,
                send_to_prefill=self.outbox.send,
                transfer_timeout_s=self.config.transfer_timeout_s,
                metrics=self.metrics,
                clock=clock,
            )
            watched = self.decode
            self.registration = self._registration(completion=self.decode.completion_area)
            self.peers = PeerDirectory(
                self.codec.layout_hash,
                query_timeout_s=self.config.bootstrap_timeout_s,
                name=f"decode-{self.rank}",
            )
        self.heartbeats = Heartbeats(
            self.inbox.endpoint,
            self.outbox,
            watched,
            timeout_s=self.config.liveness_timeout_s,
            clock=clock,
            name=f"{self.role.value}-{self.rank}",
        )
        health.watch(self.problem)
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

    # -- registration -----------------------------------------------------------------

    def _registration(self, completion: Any) -> ShardRegistration:
        return ShardRegistration(
            role=self.role,
            rank=self.rank,
            scheme=self.scheme,
            session=self.engine.session_id,
            layout=self.layout,
            num_pages=self.pool.num_pages,
            kv_regions=self.pool.kv.regions,
            layer_group_size=(self.prefill.layer_group_size if self.role is Role.PREFILL else 1),
            metadata=MetadataBuffers(
                regions=self.pool.aux, row_bytes=self.pool.aux_item_bytes, rows=self.pool.aux_rows
            ),
            completion=completion,
            inbox=self.inbox.endpoint,
            instance=self.instance,
        )

    @staticmethod
    def _local_bootstrap_addr(server_args: Any) -> str:
        port = int(server_args.disaggregation_bootstrap_port)
        if int(server_args.nnodes) > 1 and server_args.dist_init_addr:
            return f"{str(server_args.dist_init_addr).rsplit(':', 1)[0]}:{port}"
        return f"127.0.0.1:{port}"

    def register_to_bootstrap(self) -> None:
        """Registers this prefill rank with its server's registry (retrying until it is
        up), then checks every few seconds that the registry still answers: decoders
        cannot find a prefiller whose registry died, and /health must say so."""
        message = RegisterShard(
            rank=self.rank,
            tp_size=self.scheme.tp_size,
            instance=self.instance,
            registration=self.codec.encode(self.registration),
        )
        client = RegistryClient(f"prefill-{self.rank}")
        try:
            client.register(
                self._bootstrap_addr,
                message,
                timeout_s=self.config.bootstrap_timeout_s * 4,
                stop=self._closing,
            )
            logger.info("rank %d registered with %s", self.rank, self._bootstrap_addr)
            while not self._closing.wait(REGISTRY_PROBE_INTERVAL_S):
                try:
                    client.query(self._bootstrap_addr, timeout_s=REGISTRY_PROBE_TIMEOUT_S)
                    self._registry_problem = None
                except SglPdError as e:
                    self._registry_problem = f"the prefill registry does not answer: {e}"
        except SglPdError as e:
            if not self._closing.is_set():
                self._registry_problem = f"could not register with the prefill registry: {e}"
                logger.error("rank %d %s", self.rank, self._registry_problem)
        finally:
            client.close()

    def problem(self) -> str | None:
        """What keeps this rank from serving PD requests, or None (read by /health)."""
        if not self.inbox.alive:
            return "the messenger's inbox thread stopped: no message from peers arrives"
        if not self.heartbeats.alive:
            return "the liveness thread stopped: lost peers would go unnoticed"
        if self.role is Role.PREFILL:
            if self.prefill.writers.thread_failures:
                return f"{self.prefill.writers.thread_failures} KV writer thread(s) died"
            return self._registry_problem
        return None

    # -- messages ---------------------------------------------------------------------

    def _on_message(self, message: Message) -> None:
        """Inbox thread: hand each message to its handler; none of them blocks."""
        if isinstance(message, Heartbeat):
            self.heartbeats.on_heartbeat(message)
        elif isinstance(message, HeartbeatAck):
            self.heartbeats.on_ack(message)
        elif self.role is Role.PREFILL:
            if isinstance(message, TransferRequest):
                self.prefill.on_transfer_request(message)
            elif isinstance(message, Abort):
                self.prefill.on_abort(message, message.reply_to or None)
            else:
                logger.warning("prefill rank ignores %s", type(message).__name__)
        elif isinstance(message, ChunkNotice):
            self.decode.on_chunk_notice(message)
        elif isinstance(message, AbortAck):
            self.decode.on_abort_ack(message)
        elif isinstance(message, ErrorMsg):
            self.decode.on_error(message)
        else:
            logger.warning("decode rank ignores %s", type(message).__name__)

    # -- SGLang's deferred release of a decode request that ended early --------------------

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        return self.decode.is_release_safe(int(bootstrap_room), int(required_acks))

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        """Nothing beyond the request's track, which the receiver's `clear` drops."""

    def close(self) -> None:
        self._closing.set()
        self.heartbeats.stop()
        self.inbox.close()
        self.outbox.close()
        if self.role is Role.PREFILL:
            if self.streamer is not None:
                self.streamer.stop(timeout_s=5.0)
            self.prefill.close()
        else:
            self.peers.close()
        self.links.close()
        self.engine.close()
