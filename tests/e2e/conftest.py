"""Real SGLang servers on CPU with the bundled model, shared by the end-to-end tests.

Each fixture starts its servers on free ports, waits for readiness with a timeout and
stops everything it started when its scope ends, also after a failure.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sgl_pd.cluster.local import (
    Patience,
    PdCluster,
    Server,
    local_patience,
    monolithic_server,
    pd_cluster,
)

# Small chunks so that prompts of a few hundred tokens are prefilled in several chunks.
CHUNKED_PREFILL_SIZE = 128
# The bundled model loops on whitespace inside JSON unless the grammar forbids it.
COMMON_ARGS = [
    "--chunked-prefill-size", str(CHUNKED_PREFILL_SIZE),
    "--log-level", "info",
    "--constrained-json-disable-any-whitespace",
]  # fmt: skip


@pytest.fixture(scope="session")
def patience() -> Patience:
    """How long the tests wait for servers (SGLPD_LOCAL_PATIENCE scales it)."""
    return local_patience()


@pytest.fixture(scope="session")
def mono(tmp_path_factory: pytest.TempPathFactory, patience: Patience) -> Iterator[Server]:
    with monolithic_server(
        tmp_path_factory.mktemp("mono"), extra=COMMON_ARGS, patience=patience
    ) as server:
        yield server


# the decoder keeps a prefix cache and prefills short uncached suffixes itself (local
# prefill, on by default with the cache)
DECODE_LOCAL_PREFILL = ("--disaggregation-decode-enable-radix-cache",)
# the decoder keeps a prefix cache, and every request crosses the wire: a prompt's held
# prefix is not transferred (what the tests of prefix reuse and transfers measure)
DECODE_PREFIX_CACHE = (*DECODE_LOCAL_PREFILL, "--pd-local-prefill-max-tokens", "0")


def start_pd(
    tmp_path_factory: pytest.TempPathFactory,
    kv_send: str,
    patience: Patience | None = None,
    extra: tuple[str, ...] = (),
    decode_extra: tuple[str, ...] = (),
) -> Iterator[PdCluster]:
    """A PD cluster whose prefiller sends KV as `kv_send` says; `extra`: more flags for
    both servers, `decode_extra` for the decoder only; `patience`: the waits,
    `local_patience()` when None."""
    args = [*COMMON_ARGS, "--enable-metrics", *extra]
    with pd_cluster(
        tmp_path_factory.mktemp(f"pd-{kv_send}"),
        prefill_extra=[*args, "--pd-kv-send", kv_send],
        decode_extra=[*args, *decode_extra],
        patience=patience,
    ) as cluster:
        yield cluster
