"""sgl_pd's own settings: parsed once from the command line, then passed down explicitly.

SGLang starts its scheduler processes itself, so the launcher hands this object to
them through one environment variable (``SGL_PD_CONFIG``, JSON) that the plugin reads
once at load time. Nothing else in sgl_pd reads the environment.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass

from sgl_pd.errors import ConfigError

CONFIG_ENV = "SGL_PD_CONFIG"
BACKEND_NAME = "sgl_pd"  # the value of SGLang's --disaggregation-transfer-backend that selects us
TRANSPORTS = ("auto", "tcp", "rdma", "efa")
KV_SEND_MODES = ("layerwise", "after-forward")


@dataclass(frozen=True)
class SglPdConfig:
    harness: str = "auto"  # auto | cpu | gpu: how SGLang is run on this host
    transport: str = "auto"  # auto (rdma with --disaggregation-ib-device, else tcp) | tcp | ...
    advertise_host: str = ""  # address peers use to reach this server; "" = from --host
    bootstrap_timeout_s: float = 30.0  # finding a prefiller and its ranks
    transfer_timeout_s: float = 120.0  # a request's KV, from its destination pages to done
    kv_send: str = "layerwise"  # when a prefiller sends a chunk's KV: per layer or after it
    liveness_timeout_s: float = 1.5  # a peer silent this long is declared lost
    # Fault injection, for fault campaigns only (tests, benchmarks/bench_faults.py):
    inject_write_delay_ms: float = 0.0  # added before every KV write batch
    inject_write_failure_rate: float = 0.0  # probability that a KV write batch fails

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"--pd-transport {self.transport!r}: choose one of {TRANSPORTS}")
        if self.kv_send not in KV_SEND_MODES:
            raise ConfigError(f"--pd-kv-send {self.kv_send!r}: choose one of {KV_SEND_MODES}")
        for name in ("bootstrap_timeout_s", "transfer_timeout_s", "liveness_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if not self.inject_write_delay_ms >= 0:
            raise ConfigError(
                f"--pd-inject-write-delay-ms must be >= 0, got {self.inject_write_delay_ms}"
            )
        if not 0 <= self.inject_write_failure_rate <= 1:
            raise ConfigError(
                "--pd-inject-write-failure-rate must be within [0, 1], got "
                f"{self.inject_write_failure_rate}"
            )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> SglPdConfig:
        try:
            fields = json.loads(text)
            return cls(**fields)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{CONFIG_ENV} holds an invalid sgl_pd configuration: {e}") from e

    @classmethod
    def from_environment(cls) -> SglPdConfig:
        """The configuration the launcher handed down, or defaults for a plain SGLang launch."""
        text = os.environ.get(CONFIG_ENV)
        return cls() if text is None else cls.from_json(text)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "sgl_pd",
        "Disaggregated prefill/decode. Select it with --disaggregation-mode prefill|decode "
        f"--disaggregation-transfer-backend {BACKEND_NAME}.",
    )
    group.add_argument(
        "--pd-harness",
        choices=["auto", "cpu", "gpu"],
        default="auto",
        help="Run SGLang on the GPU or on its CPU engine (auto: GPU when a CUDA driver "
        "with devices is present).",
    )
    group.add_argument(
        "--pd-transport",
        choices=TRANSPORTS,
        default="auto",
        help="Mooncake transport for KV pages (auto: rdma when --disaggregation-ib-device "
        "is given, else tcp).",
    )
    group.add_argument(
        "--pd-kv-send",
        choices=KV_SEND_MODES,
        default="layerwise",
        help="When a prefiller sends a chunk's KV: layer by layer as the forward pass "
        "writes it (layerwise), or once the forward pass has ended (after-forward, "
        "SGLang's own behaviour).",
    )
    group.add_argument(
        "--pd-advertise-host",
        default="",
        help="Address other servers use to reach this one (default: --host, or this "
        "machine's address when --host is 0.0.0.0).",
    )
    group.add_argument(
        "--pd-bootstrap-timeout",
        type=float,
        default=SglPdConfig.bootstrap_timeout_s,
        help="Seconds a decoder waits for a prefiller's ranks to answer before failing "
        "the request.",
    )
    group.add_argument(
        "--pd-transfer-timeout",
        type=float,
        default=SglPdConfig.transfer_timeout_s,
        help="Seconds a request's KV transfer may take before it fails and its pages are freed.",
    )
    group.add_argument(
        "--pd-liveness-timeout",
        type=float,
        default=SglPdConfig.liveness_timeout_s,
        help="Seconds without an answer to heartbeats after which a peer is declared lost: "
        "a decoder fails the requests a lost prefill rank was writing, a prefill rank stops "
        "writing to a lost decoder.",
    )
    group.add_argument(
        "--pd-inject-write-delay-ms",
        type=float,
        default=0.0,
        help="Fault injection for testing only: milliseconds added before every KV write batch.",
    )
    group.add_argument(
        "--pd-inject-write-failure-rate",
        type=float,
        default=0.0,
        help="Fault injection for testing only: probability that a KV write batch fails.",
    )


def config_from_args(args: argparse.Namespace) -> SglPdConfig:
    return SglPdConfig(
        harness=args.pd_harness,
        transport=args.pd_transport,
        advertise_host=args.pd_advertise_host,
        bootstrap_timeout_s=args.pd_bootstrap_timeout,
        transfer_timeout_s=args.pd_transfer_timeout,
        kv_send=args.pd_kv_send,
        liveness_timeout_s=args.pd_liveness_timeout,
        inject_write_delay_ms=args.pd_inject_write_delay_ms,
        inject_write_failure_rate=args.pd_inject_write_failure_rate,
    )
