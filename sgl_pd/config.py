"""sgl_pd's own settings: parsed once from the command line, then passed down explicitly.

SGLang starts its scheduler processes itself, so the launcher hands this object to
them through one environment variable (``SGLPD_CONFIG``, JSON) that the plugin reads
once at load time. The cluster secret is not in it: each process reads it where the operator put it
(the secret file, or ``SGLPD_AUTH_SECRET``), so it sits in no second variable. Every
variable sgl_pd reads or sets is listed in `sgl_pd.environment`.
"""

from __future__ import annotations

import argparse
import json
import os
import stat
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from sgl_pd.core.bounds import TimingBounds, deferred_release_s, engine_transfer_timeout_s
from sgl_pd.environment import AUTH_SECRET, CONFIG, env_value
from sgl_pd.errors import ConfigError

CONFIG_ENV = CONFIG.name
SECRET_ENV = AUTH_SECRET.name  # the cluster secret itself, when no secret file is given


MIN_SECRET_BYTES = 16
BACKEND_NAME = "sgl_pd"  # the value of SGLang's --disaggregation-transfer-backend that selects us
TRANSPORTS = ("auto", "tcp", "rdma", "efa")
KV_SEND_MODES = ("layerwise", "after-forward")
FIRST_TOKEN_SAMPLERS = ("decode", "prefill")  # who samples a request's first token (D16)


def sgl_pd_role(server_args: object) -> str | None:
    """ "prefill" or "decode" when SGLang's server arguments make this server one side of
    an sgl_pd pair; None for any other server (monolithic, another transfer backend)."""
    mode = str(getattr(server_args, "disaggregation_mode", "null"))
    backend = str(getattr(server_args, "disaggregation_transfer_backend", ""))
    return mode if mode in ("prefill", "decode") and backend == BACKEND_NAME else None


@dataclass(frozen=True)
class SglPdConfig:
    harness: str = "auto"  # auto | cpu | gpu: how SGLang is run on this host
    transport: str = "auto"  # auto (rdma with --disaggregation-ib-device, else tcp) | tcp | ...
    advertise_host: str = ""  # address peers use to reach this server; "" = from --host
    bootstrap_timeout_s: float = 30.0  # finding a prefiller and its ranks
    transfer_timeout_s: float = 120.0  # a request's KV, from its destination pages to done
    kv_send: str = "layerwise"  # when a prefiller sends a chunk's KV: per layer or after it
    first_token: str = "decode"  # who samples the first token: the decoder (D16) or prefill
    # A peer that accepts connections but has not answered heartbeats this long is
    # declared hung (a dead one, whose connections are refused, is lost within a second)
    hang_timeout_s: float = 20.0
    # MiB of staging for re-laying out KV heads under mismatched TP (`core.relayout`):
    # negative = derived from the pool and chunk size, 0 = none (one write per token slot)
    staging_mb: float = -1.0
    # Where the cluster secret that authenticates every control connection is: a file
    # (its absolute path), or SGLPD_AUTH_SECRET (each process reads it there, so the
    # secret itself is in no second variable); neither with no_auth=False: not
    # configured, and PD serving refuses to start.
    auth_secret_file: str = ""
    auth_secret_from_env: bool = False
    no_auth: bool = False  # serve without authentication (--pd-no-auth; trusted hosts only)
    allow_loopback_advertise: bool = False  # advertise 127.x while binding all interfaces
    # Direct mode (decoder): prefill bootstrap addresses "host:port,..." or "@FILE" (one per
    # line, re-read while serving) to which the decoder submits requests that arrive
    # without a bootstrap room; "" = router mode only
    prefill_bootstrap: str = ""
    # Decoder: the largest uncached prompt suffix it prefills itself rather than sending
    # the request to a prefill server (`backend/decode/local_prefill.py`); negative =
    # derived (`local_prefill_limit`), 0 = never
    local_prefill_max_tokens: int = -1
    # Decoder: prompt tokens of local prefill one decode step carries (a longer suffix
    # takes several steps); negative = the largest local suffix, one step each
    local_prefill_step_tokens: int = -1
    # Decoder: a step carrying local prefill may take at most this factor of the plain
    # decode step its streams would otherwise run (predicted from its measured steps,
    # `core.local_budget`); 0 = no SLO, every step carries the step tokens
    local_prefill_itl_slo: float = 1.25
    # Decoder: once in this many of the streams' gaps a local step may go past the ITL
    # SLO and carry the step tokens at once (`core.local_budget.BurstAllowance`); 0 = never
    local_prefill_burst_every: int = 200
    # Decoder, direct mode: prefill servers with this many prompt tokens outstanding
    # from it are saturated; when all are, short fresh prompts are prefilled locally too
    prefill_saturated_tokens: int = 8192
    # Fault injection, for fault campaigns only (tests, benchmarks/bench_faults.py):
    inject_write_delay_ms: float = 0.0  # added before every KV write batch
    inject_write_failure_rate: float = 0.0  # probability that a KV write batch fails
    inject_control_drop_rate: float = 0.0  # probability that a control frame is dropped
    inject_kv_corruption_rate: float = 0.0  # probability that a KV write batch is corrupted
    # keyed checksums of every request's KV, verified by the decoder before it decodes
    kv_checksum: bool = False

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"--pd-transport {self.transport!r}: choose one of {TRANSPORTS}")
        if self.kv_send not in KV_SEND_MODES:
            raise ConfigError(f"--pd-kv-send {self.kv_send!r}: choose one of {KV_SEND_MODES}")
        if self.first_token not in FIRST_TOKEN_SAMPLERS:
            raise ConfigError(
                f"--pd-first-token {self.first_token!r}: choose one of {FIRST_TOKEN_SAMPLERS}"
            )
        for name in ("bootstrap_timeout_s", "transfer_timeout_s", "hang_timeout_s"):
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
        if not 0 <= self.inject_kv_corruption_rate <= 1:
            raise ConfigError(
                "--pd-inject-kv-corruption-rate must be within [0, 1], got "
                f"{self.inject_kv_corruption_rate}"
            )
        if not 0 <= self.inject_control_drop_rate < 1:
            raise ConfigError(
                "--pd-inject-control-drop-rate must be within [0, 1), got "
                f"{self.inject_control_drop_rate}"
            )

        if self.prefill_bootstrap and not self.prefill_bootstrap.startswith("@"):
            from sgl_pd.core.dispatch import parse_bootstrap_addresses

            try:
                parse_bootstrap_addresses(self.prefill_bootstrap)
            except ValueError as e:
                raise ConfigError(f"--pd-prefill-bootstrap: {e}") from None
        if self.local_prefill_step_tokens == 0:
            raise ConfigError("--pd-local-prefill-step-tokens must be > 0 (or unset)")
        slo = self.local_prefill_itl_slo
        if not (slo == 0 or 1 < slo < float("inf")):
            raise ConfigError(
                f"--pd-local-prefill-itl-slo must be 0 (off) or a factor over 1, got {slo}"
            )
        if self.local_prefill_burst_every < 0:
            raise ConfigError(
                "--pd-local-prefill-burst-every must be >= 0 (0: never), got "
                f"{self.local_prefill_burst_every}"
            )
        if self.prefill_saturated_tokens <= 0:
            raise ConfigError(
                f"--pd-prefill-saturated-tokens must be > 0, got {self.prefill_saturated_tokens}"
            )

    def auth_secret(self) -> bytes | None:
        """The cluster secret, None when serving without authentication. Raises
        `ConfigError` when neither a secret nor --pd-no-auth was given."""
        if self.no_auth:
            return None
        if self.auth_secret_file:
            return read_secret_file(self.auth_secret_file)
        if self.auth_secret_from_env:
            return env_secret(os.environ)
        raise ConfigError(MISSING_SECRET)

    def bounds(
        self, *, decode: bool = False, environ: Mapping[str, str] = os.environ
    ) -> TimingBounds:
        """The timing bounds these settings give (`core.bounds`), on this host's engine
        and, on a decoder (`decode`), with SGLang's deferred release as it will run."""
        return TimingBounds(
            hang_timeout_s=self.hang_timeout_s,
            transfer_timeout_s=self.transfer_timeout_s,
            engine_transfer_timeout_s=engine_transfer_timeout_s(environ),
            deferred_release_s=deferred_release_s(environ) if decode else None,
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
        text = env_value(CONFIG_ENV)
        return cls() if text is None else cls.from_json(text)


# Why a decoder refuses SGLang's decode HiCache (host and storage tiers of its prefix
# cache; its device-memory radix cache is served).
DECODE_HICACHE_REFUSAL = (
    "--enable-hierarchical-cache on a decode server (decode HiCache) is not served yet:"
    " its host-tier hits are loaded back into pages the prefill is told it need not"
    " write, a path sgl_pd has not been run through (SGLang's host KV pool registers its"
    " memory with the CUDA driver, so it does not start on a machine without a GPU);"
    " keep --disaggregation-decode-enable-radix-cache, which holds prefixes in device"
    " memory, and drop --enable-hierarchical-cache on decoders"
)

MISSING_SECRET = (
    "sgl_pd needs the cluster secret that authenticates its servers to each other: write"
    " one (`openssl rand -hex 32 > pd.secret; chmod 600 pd.secret`), give the same file to"
    f" every prefill and decode server with --pd-auth-secret-file, or set {SECRET_ENV};"
    " --pd-no-auth serves without authentication (only where no untrusted process can"
    " reach any server's ports)"
)


def read_secret_file(path: str) -> bytes:
    """The secret in `path` (surrounding whitespace removed); refuses a file that other
    users can read, or one too short to be a secret."""
    where = Path(path)
    try:
        mode = where.stat().st_mode
        secret = where.read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"--pd-auth-secret-file {path}: cannot read it ({e})") from e
    if mode & stat.S_IROTH:
        raise ConfigError(
            f"--pd-auth-secret-file {path} is readable by every user of this host:"
            f" `chmod 600 {path}`"
        )
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"--pd-auth-secret-file {path} holds {len(secret)} bytes, at least"
            f" {MIN_SECRET_BYTES} are needed: `openssl rand -hex 32 > {path}`"
        )
    return secret


def env_secret(environ: Mapping[str, str]) -> bytes:
    """The secret in SGLPD_AUTH_SECRET (surrounding whitespace removed); refuses one too
    short to be a secret, or none."""
    secret = (env_value(SECRET_ENV, environ) or "").strip().encode()
    if not secret:
        raise ConfigError(MISSING_SECRET)
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"{SECRET_ENV} holds {len(secret)} characters, at least {MIN_SECRET_BYTES} are"
            f" needed: `export {SECRET_ENV}=$(openssl rand -hex 32)`"
        )
    return secret


def _secret_source(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, bool]:
    """Where the launch's cluster secret is (`SglPdConfig.auth_secret_file`,
    `auth_secret_from_env`), checked by reading it once here."""
    from_env = (env_value(SECRET_ENV, environ) or "").strip()
    if args.pd_auth_secret_file and from_env:
        raise ConfigError(
            f"both --pd-auth-secret-file and {SECRET_ENV} give a cluster secret: keep one"
        )
    if args.pd_auth_secret_file:
        read_secret_file(args.pd_auth_secret_file)
        return str(Path(args.pd_auth_secret_file).resolve()), False
    if from_env:
        env_secret(environ)
        return "", True
    return "", False


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
        "--pd-first-token",
        choices=FIRST_TOKEN_SAMPLERS,
        default="decode",
        help="Who samples a request's first output token: the decoder, whose first decode "
        "step feeds the prompt's last token (the prefiller prefills all but that token and "
        "runs no grammar), or the prefiller, as SGLang's own PD does. Both servers of a "
        "pair must use the same.",
    )
    group.add_argument(
        "--pd-advertise-host",
        default="",
        help="Address other servers use to reach this one (default: --host, or this "
        "machine's address when --host is 0.0.0.0).",
    )
    group.add_argument(
        "--pd-allow-loopback-advertise",
        action="store_true",
        help="Allow advertising a loopback address (127.x) while --host binds every "
        "interface: a single-host setup. Without it such a start is refused, because "
        "servers on other hosts could not reach this one.",
    )
    group.add_argument(
        "--pd-auth-secret-file",
        default="",
        metavar="PATH",
        help="File holding the cluster secret (at least 16 bytes, e.g. `openssl rand -hex "
        f"32`; not readable by other users). Every prefill and decode server of a cluster "
        f"needs the same one. Or set {SECRET_ENV} to the secret itself.",
    )
    group.add_argument(
        "--pd-no-auth",
        action="store_true",
        help="Serve without authenticating peers: any process that reaches a server's "
        "ports can then register, learn KV addresses and act on messages. Only for hosts "
        "and networks where no untrusted process runs.",
    )
    group.add_argument(
        "--pd-prefill-bootstrap",
        default="",
        metavar="ADDRS",
        help="Decoder, direct mode: prefill servers' bootstrap addresses (host:port of "
        "--disaggregation-bootstrap-port, comma-separated), or @FILE with one per line, "
        "re-read while serving so prefill servers can join and leave. Requests that reach "
        "the decoder without a bootstrap room are then prefilled on the least loaded of "
        "them; router requests work as before.",
    )
    group.add_argument(
        "--pd-local-prefill-max-tokens",
        type=int,
        default=SglPdConfig.local_prefill_max_tokens,
        metavar="N",
        help="Decoder: prefill a request here, inside the decode loop (one step of at most "
        "N prompt tokens between two decode steps), when its uncached suffix has at most N "
        "tokens and the decoder's prefix cache holds at least 30%% of the prompt - a "
        "conversation's follow-up turn - or, in direct mode, when every prefill server is "
        "saturated or down. Default: derived from --chunked-prefill-size (one eighth, at "
        "most 512), 0 with speculative decoding or DP attention; 0 turns it off.",
    )
    group.add_argument(
        "--pd-local-prefill-step-tokens",
        type=int,
        default=SglPdConfig.local_prefill_step_tokens,
        metavar="N",
        help="Decoder: prompt tokens of local prefill that ride in one decode step (a "
        "longer suffix is chunked over several): what a running stream's step may carry "
        "on top of its decode. Default: --pd-local-prefill-max-tokens (one step each).",
    )
    group.add_argument(
        "--pd-local-prefill-itl-slo",
        type=float,
        default=SglPdConfig.local_prefill_itl_slo,
        metavar="FACTOR",
        help="Decoder: a decode step that also prefills locally may take at most FACTOR "
        "times the plain decode step of its running streams, as predicted from the steps "
        "it measured; the local tokens of each step are sized to fit (at least one page). "
        "0: no SLO, each step carries --pd-local-prefill-step-tokens.",
    )
    group.add_argument(
        "--pd-local-prefill-burst-every",
        type=int,
        default=SglPdConfig.local_prefill_burst_every,
        metavar="N",
        help="Decoder: once in N of the running streams' gaps between tokens a local step "
        "may go past --pd-local-prefill-itl-slo and carry up to "
        "--pd-local-prefill-step-tokens at once, so that a short follow-up gets its first "
        "token in one step; at most one gap in N is then past the SLO, so for N >= 100 it "
        "holds for the streams' p99 gap. 0: every step within the SLO.",
    )
    group.add_argument(
        "--pd-prefill-saturated-tokens",
        type=int,
        default=SglPdConfig.prefill_saturated_tokens,
        metavar="N",
        help="Decoder, direct mode: a prefill server with N prompt tokens outstanding from "
        "this decoder is saturated; when every one is, short prompts are prefilled locally "
        "(see --pd-local-prefill-max-tokens).",
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
        "--pd-hang-timeout",
        type=float,
        default=SglPdConfig.hang_timeout_s,
        help="Seconds a peer may leave heartbeats unanswered while it still accepts "
        "connections (busy, starved, stopped) before it is declared hung: a decoder fails "
        "the requests a hung prefill rank was writing, a prefill rank stops writing to a "
        "hung decoder. A dead peer, whose connections are refused, is declared lost within "
        "about a second whatever this says.",
    )
    group.add_argument(
        "--pd-staging-mb",
        type=float,
        default=SglPdConfig.staging_mb,
        help="MiB of device memory per rank for re-laying out KV heads when prefill and "
        "decode shard them differently (mismatched TP on NHD pools): prefill ranks gather "
        "a decoder's heads into contiguous blocks, decoders receive blocks and scatter them "
        "into their pool, so a page run costs one write instead of one per token slot. "
        "Default: derived from the pool and chunk size (logged at start-up); 0 turns it "
        "off. A request that cannot fit in a decoder's area is sent the slow way.",
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
    group.add_argument(
        "--pd-kv-checksum",
        action="store_true",
        help="Verify every request's KV before decoding it: the prefiller sums what it"
        " writes (keyed with the cluster secret), the decoder sums what landed and fails"
        " the request on a mismatch (cause `checksum`). Set it on both sides.",
    )
    group.add_argument(
        "--pd-inject-kv-corruption-rate",
        type=float,
        default=0.0,
        help="Fault injection for testing only: probability that a KV write batch has 8"
        " bytes overwritten after it landed (what --pd-kv-checksum must catch).",
    )
    group.add_argument(
        "--pd-inject-control-drop-rate",
        type=float,
        default=0.0,
        help="Fault injection for testing only: probability that a control message or its"
        " acknowledgement is dropped (such messages are sent until acknowledged).",
    )


def config_from_args(
    args: argparse.Namespace, environ: Mapping[str, str] = os.environ
) -> SglPdConfig:
    """The configuration of one launch; `environ` supplies the secret's variable."""
    if args.pd_no_auth and (args.pd_auth_secret_file or env_value(SECRET_ENV, environ)):
        raise ConfigError("--pd-no-auth contradicts the cluster secret also given: keep one")
    secret_file, secret_from_env = ("", False) if args.pd_no_auth else _secret_source(args, environ)
    return SglPdConfig(
        harness=args.pd_harness,
        transport=args.pd_transport,
        advertise_host=args.pd_advertise_host,
        bootstrap_timeout_s=args.pd_bootstrap_timeout,
        transfer_timeout_s=args.pd_transfer_timeout,
        kv_send=args.pd_kv_send,
        first_token=args.pd_first_token,
        hang_timeout_s=args.pd_hang_timeout,
        staging_mb=args.pd_staging_mb,
        inject_write_delay_ms=args.pd_inject_write_delay_ms,
        inject_write_failure_rate=args.pd_inject_write_failure_rate,
        inject_control_drop_rate=args.pd_inject_control_drop_rate,
        inject_kv_corruption_rate=args.pd_inject_kv_corruption_rate,
        kv_checksum=args.pd_kv_checksum,
        no_auth=args.pd_no_auth,
        allow_loopback_advertise=args.pd_allow_loopback_advertise,
        prefill_bootstrap=args.pd_prefill_bootstrap.strip(),
        local_prefill_max_tokens=args.pd_local_prefill_max_tokens,
        local_prefill_step_tokens=args.pd_local_prefill_step_tokens,
        local_prefill_itl_slo=args.pd_local_prefill_itl_slo,
        local_prefill_burst_every=args.pd_local_prefill_burst_every,
        prefill_saturated_tokens=args.pd_prefill_saturated_tokens,
        auth_secret_file=secret_file,
        auth_secret_from_env=secret_from_env,
    )
