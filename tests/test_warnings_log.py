"""SGLPD_WARNINGS_LOG gathers a process's warnings, sgl_pd's and SGLang's, with level and
logger, and keeps doing so after SGLang reconfigures the root logger."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from sgl_pd import warnings_log


@pytest.fixture
def detached() -> Iterator[None]:
    yield
    for name in warnings_log.LOGGERS:
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if isinstance(h, warnings_log._WarningsFile)]:
            logger.removeHandler(handler)
            handler.close()


def test_warnings_of_both_loggers_land_in_the_file_once(tmp_path: Path, detached: None) -> None:
    path = tmp_path / "server.warnings"
    assert warnings_log.attach({}) is None
    assert warnings_log.attach({"SGLPD_WARNINGS_LOG": str(path)}) == str(path)
    warnings_log.attach({"SGLPD_WARNINGS_LOG": str(path)})  # (a second load: no second copy)
    logging.basicConfig(level=logging.INFO, force=True)  # as SGLang configures its logging
    logging.getLogger("sgl_pd.backend.x").warning("ours %d", 1)
    logging.getLogger("sglang.srt.y").error("SGLang's")
    logging.getLogger("sgl_pd.backend.x").info("not a warning")
    logging.getLogger("uvicorn.error").warning("another library's")
    lines = path.read_text().splitlines()
    assert [line.split(" pid ", 1)[1].split(" ", 1)[1] for line in lines] == [
        "WARNING sgl_pd.backend.x: ours 1",
        "ERROR sglang.srt.y: SGLang's",
    ]
