"""Every warning a server's processes log, gathered in one file: with ``SGLPD_WARNINGS_LOG``
naming a file, each process that loads the plugin (the HTTP process and every scheduler
rank) appends the WARNING and worse records of sgl_pd's and SGLang's loggers there, with
their level and logger - which SGLang's own log format leaves out, so that in its log a
warning reads like any other line. Operators can watch it; the end-to-end tests check
that a healthy cluster's servers warn about nothing their settings cause.

The handlers sit on the ``sgl_pd`` and ``sglang`` loggers, not on the root logger, which
SGLang reconfigures (``logging.basicConfig(force=True)``) after plugins are loaded.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from sgl_pd.environment import WARNINGS_LOG, env_value

LOGGERS = ("sgl_pd", "sglang")
FORMAT = "%(asctime)s pid %(process)d %(levelname)s %(name)s: %(message)s"


class _WarningsFile(logging.FileHandler):
    """(its own class, so that attaching twice in one process is seen and skipped)"""


def attach(environ: Mapping[str, str] = os.environ) -> str | None:
    """Adds the warnings file's handler to this process's sgl_pd and SGLang loggers, once;
    the file's path, or None when ``SGLPD_WARNINGS_LOG`` is unset."""
    path = env_value(WARNINGS_LOG.name, environ)
    if not path:
        return None
    handler = _WarningsFile(path, mode="a", encoding="utf-8", delay=True)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter(FORMAT))
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(h, _WarningsFile) for h in logger.handlers):
            logger.addHandler(handler)
    return path
