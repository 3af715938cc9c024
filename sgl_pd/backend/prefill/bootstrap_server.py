"""The prefill server's registry, started by SGLang at ``--disaggregation-bootstrap-port``.

SGLang builds it in the HTTP front-end process (``start_disagg_service``); it holds the
prefill ranks' registrations and answers decoders' queries (``sgl_pd.messenger.registry``).
"""

from __future__ import annotations

import logging

from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer, KVPoll
from sglang.srt.runtime_context import get_serving

from sgl_pd.backend.addresses import bind_address, host_port, local_connect_host
from sgl_pd.backend.manager import cluster_auth
from sgl_pd.backend.prefill.direct import LocalSubmitter
from sgl_pd.backend.prefill.skips import SKIPPED
from sgl_pd.config import SglPdConfig
from sgl_pd.messenger.registry import RegistryServer

logger = logging.getLogger("sgl_pd.bootstrap")


class SglPdBootstrapServer(BaseKVBootstrapServer):
    def __init__(self, host: str, port: int) -> None:
        bind_host = bind_address(host)
        auth = cluster_auth(SglPdConfig.from_environment())
        # decoders may also submit requests here (direct mode): they go to our own API
        serving = get_serving()
        self._submitter = LocalSubmitter(
            f"http://{host_port(local_connect_host(bind_host), serving.port)}",
            api_key=serving.api_key,
        )
        self._server = RegistryServer(
            bind_host,
            int(port),
            auth=auth,
            submit=self._submitter.submit,
            refusals=self._submitter.refused_for,
            skip=SKIPPED.skip,  # router flow: rooms their decoder prefills itself
        )
        logger.info("sgl_pd registry listening on %s:%d", bind_host, port)

    def poll(self) -> int:
        return KVPoll.Success

    def close(self) -> None:
        self._server.close()
        self._submitter.close()
