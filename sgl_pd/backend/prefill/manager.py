"""The prefill role of a rank's messenger: writes pages into decoders (D2, D5, D6) and
registers the rank with its server's registry."""

from __future__ import annotations

import logging
import threading
from typing import Any

from sgl_pd.backend.addresses import bind_address, host_port, local_connect_host
from sgl_pd.backend.heartbeats import Watched
from sgl_pd.backend.manager import SglPdKVManager
from sgl_pd.backend.prefill.layerwise_glue import attach_messenger, layerwise_problem
from sgl_pd.backend.prefill.messenger import PrefillMessenger
from sgl_pd.core.clock import Clock
from sgl_pd.core.wire import Abort, Message, RegisterShard, Role, TransferRequest
from sgl_pd.errors import SglPdError
from sgl_pd.layerwise.streamer import LayerStreamer
from sgl_pd.messenger.registry import RegistryClient

logger = logging.getLogger("sgl_pd.manager")

REGISTRY_PROBE_INTERVAL_S = 5.0  # how often a prefill rank checks its registry answers
REGISTRY_PROBE_TIMEOUT_S = 5.0


class PrefillKVManager(SglPdKVManager):
    role = Role.PREFILL

    def _start_role(self, server_args: Any, clock: Clock) -> Watched:
        layerwise = self.config.kv_send == "layerwise"
        self.prefill = PrefillMessenger(
            rank=self.rank,
            instance=self.instance,
            scheme=self.scheme,
            pool=self.pool,
            engine=self.engine,
            layerwise=layerwise,
            send_to_decoder=self.reliable.send,
            metrics=self.metrics,
            timeout_s=self.config.transfer_timeout_s,
            clock=clock,
            freeze=self.freeze,
            staging=self.staging,
            tracing=self.tracing,
            quarantine_s=self.bounds.quarantine_s,
            sums=self._kv_sums(server_args),
        )
        self.streamer: LayerStreamer | None = attach_messenger(self.prefill, layerwise)
        self.registration = self.registration_for(
            layer_group_size=self.prefill.layer_group_size, completion=None
        )
        self._bootstrap_addr = _local_bootstrap_addr(server_args)
        self._registry_problem: str | None = None
        return self.prefill

    def _serve(self) -> None:
        threading.Thread(
            target=self.register_to_bootstrap, name="sgl-pd-register", daemon=True
        ).start()

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
        client = RegistryClient(f"prefill-{self.rank}", auth=self.auth)
        try:
            client.register(
                self._bootstrap_addr,
                message,
                timeout_s=self.config.bootstrap_timeout_s * 4,
                stop=self.closing,
            )
            logger.info("rank %d registered with %s", self.rank, self._bootstrap_addr)
            while not self.closing.wait(REGISTRY_PROBE_INTERVAL_S):
                try:
                    client.query(self._bootstrap_addr, timeout_s=REGISTRY_PROBE_TIMEOUT_S)
                    self._registry_problem = None
                except SglPdError as e:
                    self._registry_problem = f"the prefill registry does not answer: {e}"
        except SglPdError as e:
            if not self.closing.is_set():
                self._registry_problem = f"could not register with the prefill registry: {e}"
                logger.error("rank %d %s", self.rank, self._registry_problem)
        finally:
            client.close()

    def _on_role_message(self, message: Message) -> None:
        if isinstance(message, TransferRequest):
            self.prefill.on_transfer_request(message)
        elif isinstance(message, Abort):
            self.prefill.on_abort(message)
        else:
            self.ignore(message)

    def _role_problem(self) -> str | None:
        if self.prefill.writers.thread_failures:
            return f"{self.prefill.writers.thread_failures} KV writer thread(s) died"
        return layerwise_problem() or self._registry_problem

    def _close_role(self) -> None:
        if self.streamer is not None:
            self.streamer.stop(timeout_s=5.0)
        self.prefill.close()


def _local_bootstrap_addr(server_args: Any) -> str:
    """Where this server's registry listens: SGLang starts it on --host (all interfaces
    for a wildcard), on the first node of a multi-node server."""
    port = int(server_args.disaggregation_bootstrap_port)
    if int(server_args.nnodes) > 1 and server_args.dist_init_addr:
        return f"{str(server_args.dist_init_addr).rsplit(':', 1)[0]}:{port}"
    return host_port(local_connect_host(bind_address(str(server_args.host))), port)
