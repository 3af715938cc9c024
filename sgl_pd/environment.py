"""Every environment variable sgl_pd reads or sets, with why: the one list that
docs/environment.md is generated from (`sgl_pd.reference`), and the one reader of sgl_pd's
own variables (`env_value`).

sgl_pd's variables start with ``SGLPD_``: SGLang renames every ``SGL_*`` variable to
``SGLANG_*`` in each of its processes, copying the value and logging that ours is
deprecated, which the old ``SGL_PD_*`` names suffered (the cluster secret among them).
The old names are still read, with a warning of our own, for one release.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

from sgl_pd.core.bounds import DEFERRED_RELEASE_ENV, ENGINE_TIMEOUT_ENV

ENV_PREFIX = "SGLPD_"  # a prefix SGLang leaves alone (it renames SGL_* to SGLANG_*)
OLD_ENV_PREFIXES = ("SGL_PD_", "SGLANG_PD_")  # before; the second is SGLang's rename of it


@dataclass(frozen=True)
class Variable:
    name: str
    owner: str  # whose variable it is: sgl_pd, SGLang, Mooncake, OpenMP, ...
    who_sets: str  # "you" (an operator may set it) or what sgl_pd process sets it
    meaning: str


CONFIG = Variable(
    "SGLPD_CONFIG",
    "sgl_pd",
    "the launcher",
    "sgl_pd's settings (JSON, no secret) handed from `python -m sgl_pd.launch_server` to"
    " SGLang's processes, which start too late to see the command line. A server started"
    " by SGLang's own launcher, without it, runs sgl_pd with defaults.",
)
AUTH_SECRET = Variable(
    "SGLPD_AUTH_SECRET",
    "sgl_pd",
    "you",
    "The cluster secret itself (at least 16 bytes), instead of `--pd-auth-secret-file`."
    " It stays in this one variable: SGLang's processes inherit it and read it there.",
)
WARNINGS_LOG = Variable(
    "SGLPD_WARNINGS_LOG",
    "sgl_pd",
    "you (local clusters: beside each server's log)",
    "A file where every process of a server appends the warnings of sgl_pd's and SGLang's"
    " loggers, with level and logger (SGLang's log format shows neither): see"
    " `sgl_pd/warnings_log.py`.",
)
HARNESS_APPLIED = Variable(
    "SGLPD_HARNESS_APPLIED",
    "sgl_pd",
    "the launcher",
    "Marks the launcher's re-executed process (the harness's environment applied once).",
)
OBSERVE_TIMING = Variable(
    "SGLPD_OBSERVE_TIMING",
    "sgl_pd",
    "you",
    "`1`: log when each request's prefill forward ended and when its KV was complete on"
    " the decoder, for any PD backend (`benchmarks/bench_vs_upstream.py`; off by default).",
)
LOCAL_PATIENCE = Variable(
    "SGLPD_LOCAL_PATIENCE",
    "sgl_pd",
    "you",
    "Local clusters of the tests, demo and benchmarks: a factor on every wait (e.g. `3`"
    " on a loaded machine; default 1).",
)
DEFERRED_RELEASE = Variable(
    DEFERRED_RELEASE_ENV,
    "SGLang",
    "the launcher (default 120)",
    "How long a decoder holds the pages of a request that ended early while it waits for"
    " its prefill ranks' drain acks. A value below the bound `sgl_pd/core/bounds.py`"
    " derives is raised by the backend, with one log line.",
)
KEEP_ALIVE = Variable(
    "SGLANG_TIMEOUT_KEEP_ALIVE",
    "SGLang",
    "the launcher (default 75)",
    "Seconds SGLang's HTTP server keeps an idle connection: longer than the router's pool"
    " keeps one plus the hang timeout, so no request is lost on a closing connection. A"
    " shorter value you set is kept, with one warning.",
)
ENGINE_TIMEOUT = Variable(
    ENGINE_TIMEOUT_ENV,
    "Mooncake",
    "you",
    "Mooncake's transfer timeout (seconds, default 30): sgl_pd's timing bounds (failed"
    " batch quarantine, page hold) are derived from it.",
)
CPU_ENGINE = Variable(
    "SGLANG_USE_CPU_ENGINE",
    "SGLang",
    "the CPU harness",
    "`--pd-harness cpu`: SGLang's CPU engine (with `LD_LIBRARY_PATH` holding the stand-in"
    " driver and `TORCHDYNAMO_DISABLE=1`).",
)
CPU_THREADS_BIND = Variable(
    "SGLANG_CPU_OMP_THREADS_BIND",
    "SGLang",
    "local clusters",
    "Local clusters of the tests, demo and benchmarks: each rank's cores (with `OMP_NUM_THREADS`).",
)
PYSPY_BEFORE_CRASH = Variable(
    "SGLANG_PYSPY_DUMP_BEFORE_CRASH",
    "SGLang",
    "local clusters",
    "Set to 0 for local clusters: stopped by a SIGTERM, a server would otherwise sleep 5 s"
    " before a py-spy dump of its schedulers (with `SGLANG_CUDA_COREDUMP_BEFORE_CRASH`).",
)
COREDUMP_BEFORE_CRASH = Variable(
    "SGLANG_CUDA_COREDUMP_BEFORE_CRASH",
    "SGLang",
    "local clusters",
    "Set to 0 for local clusters, with `SGLANG_PYSPY_DUMP_BEFORE_CRASH`: no CUDA coredump"
    " of a stopped CPU server.",
)

VARIABLES = (
    AUTH_SECRET,
    CONFIG,
    OBSERVE_TIMING,
    LOCAL_PATIENCE,
    WARNINGS_LOG,
    HARNESS_APPLIED,
    DEFERRED_RELEASE,
    KEEP_ALIVE,
    ENGINE_TIMEOUT,
    CPU_ENGINE,
    CPU_THREADS_BIND,
    PYSPY_BEFORE_CRASH,
    COREDUMP_BEFORE_CRASH,
)

_warned_old_names: set[str] = set()


def env_value(name: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """sgl_pd's variable `name` (``SGLPD_...``), or the value under its old name (one
    warning per name and process); None when neither is set."""
    value = environ.get(name)
    if value is not None:
        return value
    rest = name[len(ENV_PREFIX) :]
    for old in (prefix + rest for prefix in OLD_ENV_PREFIXES):
        if old in environ:
            if old not in _warned_old_names and not old.startswith("SGLANG_"):
                _warned_old_names.add(old)
                logging.getLogger("sgl_pd.config").warning(
                    "%s is an old name: set %s instead (the old one is read until the next"
                    " release)",
                    old,
                    name,
                )
            return environ[old]
    return None
