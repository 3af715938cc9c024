"""Fixtures shared by the test layers."""

from __future__ import annotations

import argparse

import pytest


@pytest.fixture(scope="session")
def server_parser() -> argparse.ArgumentParser:
    """SGLang's own server argument parser, with sgl_pd's backend registered as a choice
    of --disaggregation-transfer-backend: what parses every server command the project
    shows (recipes, manifests, docs)."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser
