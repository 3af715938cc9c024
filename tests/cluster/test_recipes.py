"""Every recipe in launch/recipes/ parses with the real argument parsers: sgl_pd's own
flags, SGLang's ServerArgs (with sgl_pd's backend registered) and sglang_router's."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

import pytest

from sgl_pd.launch_server import _split_args
from sgl_pd.transfer.config import TransportConfig

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "launch/recipes").glob("*.sh"))
RECIPES = [r for r in RECIPES if r.name != "common.sh"]


def _argv(recipe: Path, *role: str, env: dict[str, str] | None = None) -> list[str]:
    out = subprocess.run(
        ["bash", str(recipe), *role],
        env={**os.environ, "RECIPE_DRY_RUN": "1", **(env or {})},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.splitlines()
    return out


def _nodes(recipe: Path) -> tuple[int, int]:
    text = subprocess.run(
        ["bash", str(recipe), "print"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return text.count("# prefill node"), text.count("# decode node")


def test_there_are_the_three_recipes() -> None:
    assert {r.name for r in RECIPES} >= {
        "deepseek-r1-tp8-1p3d.sh",
        "deepseek-r1-dp-decode.sh",
        "qwen3-coder-480b-tp8-1p3d.sh",
        "local-direct-1p2d.sh",
    }


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("secret") / "pd.secret"
    path.write_text("0123456789abcdef0123456789abcdef\n")
    path.chmod(0o600)
    return str(path)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.stem)
def test_every_server_command_parses(
    recipe: Path, server_parser: argparse.ArgumentParser, secret_file: str
) -> None:
    prefills, decodes = _nodes(recipe)
    assert prefills >= 1 and decodes >= 1
    for role, count in (("prefill", prefills), ("decode", decodes)):
        for index in range(count):
            env = {"SGLPD_SECRET_FILE": secret_file}
            module, *argv = _argv(recipe, role, str(index), env=env)
            assert module == "sgl_pd.launch_server"
            config, sglang_argv = _split_args(argv)  # ours: raises on a bad value
            assert config.auth_secret() is not None  # every recipe authenticates its cluster
            args = server_parser.parse_args(sglang_argv)  # SGLang's: raises on unknown flags
            assert args.disaggregation_mode == role
            assert args.disaggregation_transfer_backend == "sgl_pd"
            if args.disaggregation_ib_device:  # cluster recipes: RDMA, a NIC per rank
                devices = json.loads(args.disaggregation_ib_device)
                assert len(devices) == args.tp_size
                transport = TransportConfig(
                    protocol="rdma", ib_device=args.disaggregation_ib_device
                )
                for rank in range(args.tp_size):
                    assert transport.devices_for(rank)
            if config.prefill_bootstrap:  # direct mode: only decoders submit prefills
                assert role == "decode"
            # every decoder keeps a prefix cache (only the KV it lacks is transferred)
            assert args.disaggregation_decode_enable_radix_cache == (role == "decode")


def _has_router(recipe: Path) -> bool:
    text = subprocess.run(
        ["bash", str(recipe), "print"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return "# router" in text


@pytest.mark.parametrize("recipe", [r for r in RECIPES if _has_router(r)], ids=lambda r: r.stem)
def test_the_router_command_parses(recipe: Path) -> None:
    from sglang_router.launch_router import parse_router_args

    module, *argv = _argv(recipe, "router")
    assert module == "sglang_router.launch_router"
    args = parse_router_args(argv)
    assert args.pd_disaggregation
    prefills, _ = _nodes(recipe)
    assert len(args.prefill_urls) == prefills
    assert args.decode_urls
    assert args.decode_policy == "cache_aware"  # a turn goes where its prefix is held


def test_hosts_come_from_the_environment() -> None:
    recipe = ROOT / "launch/recipes/deepseek-r1-tp8-1p3d.sh"
    env = {"PREFILL_HOSTS": "192.168.1.5", "DECODE_HOSTS": "192.168.1.6 192.168.1.7"}
    _, *argv = _argv(recipe, "decode", "1", env=env)
    assert argv[argv.index("--host") + 1] == "192.168.1.7"
    _, *router = _argv(recipe, "router", env=env)
    assert router.count("--decode") == 2


def test_an_unknown_role_is_a_usage_error() -> None:
    recipe = RECIPES[0]
    result = subprocess.run(["bash", str(recipe), "sideways"], capture_output=True, text=True)
    assert result.returncode == 2 and "usage" in result.stderr


def test_a_recipe_without_a_router_says_so() -> None:
    recipe = ROOT / "launch/recipes/local-direct-1p2d.sh"
    result = subprocess.run(["bash", str(recipe), "router"], capture_output=True, text=True)
    assert result.returncode == 2 and "send requests to the decoders" in result.stderr
    assert not _has_router(recipe)
