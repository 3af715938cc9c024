"""``python -m sgl_pd.launch_server``: SGLang's server with sgl_pd loaded.

Takes every argument of ``python -m sglang.launch_server`` plus sgl_pd's own
(``--pd-*``; ``--help`` lists both). On a host without a GPU it applies the CPU harness:
the process re-executes itself once with the stand-in driver on the library path and
SGLang's CPU flags added, and says so in its log.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping
from types import SimpleNamespace

from sgl_pd.backend.server_options import unsupported_option
from sgl_pd.config import (
    BACKEND_NAME,
    CONFIG_ENV,
    SglPdConfig,
    add_cli_args,
    config_from_args,
)
from sgl_pd.core.bounds import DEFAULT_DEFERRED_RELEASE_S, DEFERRED_RELEASE_ENV, TimingBounds
from sgl_pd.environment import HARNESS_APPLIED, KEEP_ALIVE
from sgl_pd.errors import ConfigError
from sgl_pd.harness.cpu import Harness, flag_value, plan_harness, uses_dp_attention
from sgl_pd.harness.patches import require_patches

logger = logging.getLogger("sgl_pd.launch_server")

# Set on the re-executed process so the harness is applied exactly once.
_HARNESS_APPLIED_ENV = HARNESS_APPLIED.name


# SGLang's deferred release of a decode request that ended early: how long it waits for
# the prefill ranks' drain acks before it frees the pages anyway (`core.bounds` says why
# this is enough; the backend raises a lower value itself, however it is started).
DEFERRED_RELEASE_TIMEOUT_ENV = DEFERRED_RELEASE_ENV
DEFERRED_RELEASE_TIMEOUT_S = f"{DEFAULT_DEFERRED_RELEASE_S:g}"

# SGLang's router keeps an idle connection to each server for up to 50 s (its HTTP client's
# pool idle timeout) and sends the next request on it, while SGLang's HTTP server closes a
# connection idle for 5 s (uvicorn's keep-alive). When both happen at once the request is
# lost unread, and the router (0.3.2) ignores a prefill server's transport error when the
# decode side then fails: the decoder waits its whole transfer timeout for KV that no
# prefill server was asked for. A server stopped or starved past its keep-alive often loses
# a request sent to it meanwhile: on waking, the expired timer closes the connection before
# the request waiting in it is read. So a server keeps an idle connection longer than the
# router does, plus the longest pause that must fail nothing (the hang timeout; see
# `TimingBounds.required_keep_alive_s`), with a margin.
KEEP_ALIVE_ENV = KEEP_ALIVE.name
KEEP_ALIVE_S = "75"
KEEP_ALIVE_MARGIN_S = 5.0

# SGLang settings a server gets unless its environment sets them
SGLANG_ENV_DEFAULTS = {
    DEFERRED_RELEASE_TIMEOUT_ENV: DEFERRED_RELEASE_TIMEOUT_S,
    KEEP_ALIVE_ENV: KEEP_ALIVE_S,
}


def server_env(environ: Mapping[str, str], config: SglPdConfig | None = None) -> dict[str, str]:
    """The environment a server starts with: `SGLANG_ENV_DEFAULTS` (a keep-alive long
    enough for `config`'s hang timeout), then `environ`'s. An operator's keep-alive too
    short for the hang timeout is kept, and named in one warning."""
    defaults = dict(SGLANG_ENV_DEFAULTS)
    if config is not None:
        needed = config.bounds().required_keep_alive_s + KEEP_ALIVE_MARGIN_S
        defaults[KEEP_ALIVE_ENV] = f"{max(float(KEEP_ALIVE_S), needed):g}"
        own = environ.get(KEEP_ALIVE_ENV)
        bounds = TimingBounds(config.hang_timeout_s, config.transfer_timeout_s,
                              keep_alive_s=float(own) if own else None)  # fmt: skip
        for problem in bounds.violations():
            logger.warning("%s=%s: %s", KEEP_ALIVE_ENV, own, problem)
    return {**defaults, **environ}


def _serves_pd(sglang_argv: list[str]) -> bool:
    """This launch is one side of an sgl_pd pair (so it needs the cluster secret)."""
    mode = flag_value(sglang_argv, "--disaggregation-mode")
    backend = flag_value(sglang_argv, "--disaggregation-transfer-backend")
    return mode in ("prefill", "decode") and backend == BACKEND_NAME


def _unsupported(sglang_argv: list[str], config: SglPdConfig) -> str | None:
    """Why an sgl_pd server cannot run with these SGLang options, or None; said before
    SGLang starts its ranks (each would fail with a traceback of its own, or worse, run
    and deliver wrong KV)."""
    mode = flag_value(sglang_argv, "--disaggregation-mode")
    if mode == "prefill" and uses_dp_attention(sglang_argv):
        return (
            "DP attention runs on decode servers only for now: start the prefill server "
            "without --enable-dp-attention / --attn-dp-size (TP is fine)"
        )
    for flag in ("--pp-size", "--pipeline-parallel-size"):
        if flag_value(sglang_argv, flag) not in (None, "1"):
            return f"pipeline parallelism is not served yet: drop {flag}"
    return unsupported_option(
        _option_view(sglang_argv),
        str(mode),
        kv_send=config.kv_send,
        first_token=config.first_token,
        local_prefill_max_tokens=config.local_prefill_max_tokens,
    )


def _option_view(sglang_argv: list[str]) -> SimpleNamespace:
    """The SGLang options `server_options` reads, from the command line (SGLang has not
    parsed it yet: its ranks would each refuse with a traceback of their own)."""
    switches = (
        "--enable-hierarchical-cache", "--enable-two-batch-overlap", "--enable-prefill-cp",
        "--enable-multi-layer-eagle", "--enable-return-hidden-states",
    )  # fmt: skip
    view: dict[str, object] = {flag[2:].replace("-", "_"): flag in sglang_argv for flag in switches}
    for flag in (
        "--optimistic-prefill-attempts", "--disaggregation-decode-allocation-policy",
        "--attn-cp-size", "--return-hidden-states-mode", "--speculative-algorithm",
        "--chunked-prefill-size", "--tokenizer-worker-num",
    ):  # fmt: skip
        value = flag_value(sglang_argv, flag)
        if value is not None:
            view[flag[2:].replace("-", "_")] = value
    view["enable_dp_attention"] = uses_dp_attention(sglang_argv)
    return SimpleNamespace(**view)


def _split_args(argv: list[str]) -> tuple[SglPdConfig, list[str]]:
    """Separates sgl_pd's flags from SGLang's, which are passed on untouched."""
    parser = argparse.ArgumentParser(add_help=False)
    add_cli_args(parser)
    ours, rest = parser.parse_known_args(argv)
    return config_from_args(ours), rest


def _print_help() -> None:
    """Usage first, then sgl_pd's flags, then SGLang's; no start-up log lines (loading
    the plugins to list the sgl_pd backend among SGLang's choices logs each hook)."""
    logging.disable(logging.WARNING)
    try:
        from sglang.srt.plugins import load_plugins
        from sglang.srt.server_args import ServerArgs

        load_plugins()
    finally:
        logging.disable(logging.NOTSET)
    ours = argparse.ArgumentParser(
        prog="python -m sgl_pd.launch_server",
        usage="%(prog)s --model-path MODEL --disaggregation-mode prefill|decode"
        " --disaggregation-transfer-backend sgl_pd [sgl_pd's --pd-* flags] [SGLang's flags]",
        description="SGLang's server with sgl_pd's disaggregated prefill and decode: SGLang's"
        " own arguments, plus sgl_pd's (listed first). Docs: docs/running.md, docs/flags.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_cli_args(ours)
    sglang = argparse.ArgumentParser(prog="python -m sgl_pd.launch_server", add_help=False)
    ServerArgs.add_cli_args(sglang)
    sglang_help = sglang.format_help()
    print(ours.format_help())
    print("SGLang's arguments:")
    print(sglang_help[sglang_help.find("\n\n") + 2 :])  # (without its own usage line)


def _serve(sglang_argv: list[str]) -> None:
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()  # registers sgl_pd here too; scheduler processes load it themselves
    server_args = prepare_server_args(sglang_argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:  # usage first: before any start-up step logs
        import warnings

        warnings.simplefilter("ignore")  # (SGLang's imports warn about absent kernels)
        _print_help()
        return
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(name)s] %(message)s")
    first_pass = os.environ.get(_HARNESS_APPLIED_ENV) != "1"  # (before the re-execution)
    try:
        config, sglang_argv = _split_args(argv)
        refusal = _unsupported(sglang_argv, config) if _serves_pd(sglang_argv) else None
        if refusal is not None:
            raise ConfigError(refusal)
        if first_pass and _serves_pd(sglang_argv) and config.first_token == "decode":
            require_patches()  # (the installed files: the re-executed process has the same)
        if _serves_pd(sglang_argv) and config.auth_secret() is None:
            logger.warning(
                "--pd-no-auth: peers are not authenticated; any process that reaches this"
                " server's ports can act on it"
            )
    except ConfigError as e:
        sys.exit(f"sgl_pd: {e}")

    if first_pass:
        requested = None if config.harness == "auto" else Harness(config.harness)
        try:
            plan = plan_harness(requested, sglang_argv)
        except ConfigError as e:
            sys.exit(f"sgl_pd: {e}")
        logger.info("harness: %s (%s)", plan.harness.value, plan.reason)
        env = {
            **server_env(os.environ, config),
            **plan.env,
            CONFIG_ENV: config.to_json(),
            _HARNESS_APPLIED_ENV: "1",
        }
        if plan.extra_args:
            logger.info("adding SGLang flags: %s", " ".join(plan.extra_args))
        # Re-execute so the dynamic loader sees LD_LIBRARY_PATH from the start.
        sys.stdout.flush()
        os.execve(
            sys.executable,
            [sys.executable, "-m", "sgl_pd.launch_server", *argv, *plan.extra_args],
            env,
        )

    _serve(sglang_argv)


if __name__ == "__main__":
    main()
