"""Entry point SGLang calls in every process (``sglang.srt.plugins`` group).

Registering must be cheap and harmless for a server that does not select sgl_pd: it
adds the backend to SGLang's choices and installs hooks that only act when
``--disaggregation-transfer-backend sgl_pd`` is given - except one INFO log line per
change of an idle server's KV pool (``backend/pool_report.py``), useful everywhere.
"""

from __future__ import annotations

import logging

from sgl_pd.config import BACKEND_NAME

logger = logging.getLogger("sgl_pd.plugin")


def register() -> None:
    from sgl_pd.backend import hook_propagation
    from sgl_pd.backend.registration import register_backend
    from sgl_pd.harness.cpu_shims import apply_cpu_shims
    from sgl_pd.warnings_log import attach

    attach()  # (SGLPD_WARNINGS_LOG: this process's warnings, gathered in one file)
    hook_propagation.install()  # the same rebinding as SGLang's, seconds sooner a process
    register_backend()
    apply_cpu_shims()  # acts only on SGLang's CPU engine
    logger.info("sgl_pd plugin registered (transfer backend %r)", BACKEND_NAME)
