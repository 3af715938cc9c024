"""/health that tells the truth about sgl_pd's threads.

SGLang's /health sends a one-token request through the scheduler and answers 200 once the
scheduler responds. A scheduler whose messenger lost a thread (its inbox, its liveness
thread, a writer), or whose prefill registry stopped answering, can no longer serve PD
requests although the scheduler itself runs. This AROUND hook of
``Scheduler.handle_generate_request`` drops health-check requests in that case, so
/health answers 503 after SGLang's health-check timeout and the router takes the server
out of rotation. Ordinary requests are untouched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX

logger = logging.getLogger("sgl_pd.health")

_problem_source: Callable[[], str | None] | None = None
_last_reported: str | None = None


def watch(problem: Callable[[], str | None]) -> None:
    """Called by the KV manager of this scheduler process: `problem()` names what is
    broken, or returns None while all is well."""
    global _problem_source
    _problem_source = problem


def around_handle_generate_request(
    original: Callable[..., Any], scheduler: Any, recv_req: Any, *args: Any, **kwargs: Any
) -> Any:
    global _last_reported
    if _problem_source is not None and str(getattr(recv_req, "rid", "")).startswith(
        HEALTH_CHECK_RID_PREFIX
    ):
        problem = _problem_source()
        if problem is not None:
            if problem != _last_reported:
                logger.error("sgl_pd unhealthy, failing /health: %s", problem)
                _last_reported = problem
            return None
    return original(scheduler, recv_req, *args, **kwargs)
