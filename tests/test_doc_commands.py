"""Every command the README and docs/ show is parsed by the parser of the program it
runs: sgl_pd's launcher (its flags, then SGLang's own parser for the rest, then the
launcher's start-up refusals), SGLang's, the router's, the simulator's and the
benchmarks'; `bash` scripts exist and are valid shell; `kubectl` targets exist. A flag
renamed or dropped in code, or mistyped in a page, fails here.

In a page, `...` stands for the reader's other arguments (the model, its port, ...)."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"```(?:bash|sh)\n(.*?)```", re.S)
# runs a Python program until its argparse parser has parsed the command line, then stops
_PARSE_ONLY = """
import argparse, runpy, sys
parse_args = argparse.ArgumentParser.parse_args
def parse_then_stop(self, args=None, namespace=None):
    parse_args(self, args, namespace)
    sys.exit(0)
argparse.ArgumentParser.parse_args = parse_then_stop
kind, target, *rest = sys.argv[1:]
sys.argv = [target, *rest]
if kind == "-m":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    runpy.run_path(target, run_name="__main__")
sys.exit("the program never parsed its command line")
"""


@dataclass(frozen=True)
class Command:
    page: str
    argv: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.page}: {shlex.join(self.argv)}"


def _commands() -> list[Command]:
    found = []
    for page in PAGES:
        for block in _BLOCK.findall(page.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                if words:
                    found.append(Command(page.name, tuple(w for w in words if w != "...")))
    return found


COMMANDS = _commands()


def _python_program(argv: tuple[str, ...]) -> tuple[str, str, list[str]] | None:
    """("-m", module, args) or ("path", script, args) of a Python command, else None."""
    if not argv or not re.fullmatch(r"(\S*/)?python3?", argv[0]):
        return None
    if argv[1] == "-m":
        return "-m", argv[2], list(argv[3:])
    return "path", argv[1], list(argv[2:])


def _parse_server(module: str, args: list[str], sglang: argparse.ArgumentParser) -> None:
    if module == "sgl_pd.launch_server":
        from sgl_pd import launch_server
        from sgl_pd.config import SglPdConfig, add_cli_args

        ours = argparse.ArgumentParser(exit_on_error=False)
        add_cli_args(ours)
        parsed, args = ours.parse_known_args(args)
        # a page shows GPU clusters: a server that cannot see its GPUs must not fall back
        assert parsed.pd_harness == "gpu", "a server command in the docs pins --pd-harness gpu"
        config = SglPdConfig(harness=parsed.pd_harness, kv_send=parsed.pd_kv_send,
                             first_token=parsed.pd_first_token, no_auth=True)  # fmt: skip
        assert launch_server._unsupported(args, config) is None, launch_server._unsupported(
            args, config
        )
    if "--model-path" not in args:  # (a page's `...`)
        args = ["--model-path", "placeholder", *args]
    sglang.parse_args(args)


def _check(command: Command, server_parser: argparse.ArgumentParser) -> None:
    argv = command.argv
    program = _python_program(argv)
    if program is not None:
        kind, target, args = program
        if target in ("sgl_pd.launch_server", "sglang.launch_server"):
            _parse_server(target, args, server_parser)
        elif target == "sglang_router.launch_router":
            from sglang_router.launch_router import parse_router_args

            parse_router_args(args)  # (also RouterArgs' own checks)
        else:
            done = subprocess.run(
                [sys.executable, "-c", _PARSE_ONLY, kind, target, *args],
                cwd=ROOT, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr[-2000:]
    elif argv[0] == "bash":
        script = ROOT / argv[1]
        assert script.is_file(), f"{argv[1]} does not exist"
        syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert syntax.returncode == 0, syntax.stderr
    elif argv[0] == "kubectl" and "-k" in argv:
        assert (ROOT / argv[argv.index("-k") + 1] / "kustomization.yaml").is_file()
    elif argv[:2] == ("docker", "build") and "-f" in argv:
        assert (ROOT / argv[argv.index("-f") + 1]).is_file()
    elif argv[0].startswith("--"):  # a flag to add to a command shown above it
        from sgl_pd.config import add_cli_args

        ours = argparse.ArgumentParser(exit_on_error=False)
        add_cli_args(ours)
        ours.parse_args(list(argv))
    else:
        standard = ("openssl", "export", "kubectl", "curl", "sudo", "scp", "umask", "docker")
        assert argv[0] in standard, (
            f"no parser known for {argv[0]!r}: teach tests/test_doc_commands.py to check it"
        )


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_the_command_parses(command: Command, server_parser: argparse.ArgumentParser) -> None:
    try:
        _check(command, server_parser)
    except (argparse.ArgumentError, SystemExit) as e:
        pytest.fail(f"{command}\n  rejected: {e}")


def test_the_pages_show_the_commands_a_reader_needs() -> None:
    """The README's two commands and a whole cluster's are among those checked."""
    shown = {(c.page, c.argv[:3]) for c in COMMANDS}
    for needed in (
        ("README.md", ("bash", "launch/demo.sh")),
        ("README.md", ("bash", "launch/test.sh")),
        ("README.md", (".venv/bin/python", "-m", "sgl_pd.launch_server")),
        ("README.md", (".venv/bin/python", "-m", "sglang_router.launch_router")),
    ):
        assert needed in shown, needed
