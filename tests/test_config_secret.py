"""The cluster secret: where it comes from, what is refused, and that it is never shown."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_pd.config import SECRET_ENV, SglPdConfig, add_cli_args, config_from_args
from sgl_pd.errors import ConfigError
from sgl_pd.log_limits import LogLimiter, peer_text

SECRET = "9f" * 32


def _config(argv: list[str], environ: dict[str, str] | None = None) -> SglPdConfig:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return config_from_args(parser.parse_args(argv), environ or {})


def _secret_file(tmp_path: Path, text: str = SECRET, mode: int = 0o600) -> str:
    path = tmp_path / "pd.secret"
    path.write_text(text + "\n")
    os.chmod(path, mode)
    return str(path)


def test_the_secret_comes_from_a_file_or_the_environment(tmp_path: Path) -> None:
    from_file = _config(["--pd-auth-secret-file", _secret_file(tmp_path)])
    from_env = _config([], {SECRET_ENV: SECRET})
    assert from_file.auth_secret() == SECRET.encode()
    with pytest.MonkeyPatch.context() as env:  # (SGLang's processes inherit the variable)
        env.setenv(SECRET_ENV, SECRET)
        assert from_env.auth_secret() == SECRET.encode()
    # SGLang's processes find it where the operator put it: the configuration handed to
    # them names the place, never the secret, so it sits in no second variable
    assert SglPdConfig.from_json(from_file.to_json()).auth_secret() == SECRET.encode()
    for config in (from_file, from_env):
        shown = config.to_json() + repr(config)
        assert SECRET not in shown and SECRET.encode().hex() not in shown


@pytest.mark.parametrize(
    ("argv", "environ", "match"),
    [
        ([], {}, "needs the cluster secret"),
        (["--pd-no-auth"], {SECRET_ENV: SECRET}, "contradicts"),
        ([], {SECRET_ENV: "short"}, "at least 16"),
    ],
)
def test_missing_or_contradictory_secrets_are_refused(
    argv: list[str], environ: dict[str, str], match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        _config(argv, environ).auth_secret()


def test_a_secret_file_others_can_read_or_too_short_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="chmod 600"):
        _config(["--pd-auth-secret-file", _secret_file(tmp_path, mode=0o644)])
    with pytest.raises(ConfigError, match="at least 16"):
        _config(["--pd-auth-secret-file", _secret_file(tmp_path, "tiny")])
    with pytest.raises(ConfigError, match="cannot read"):
        _config(["--pd-auth-secret-file", str(tmp_path / "missing")])
    with pytest.raises(ConfigError, match="keep one"):
        _config(["--pd-auth-secret-file", _secret_file(tmp_path)], {SECRET_ENV: SECRET})


def test_no_auth_is_explicit() -> None:
    assert _config(["--pd-no-auth"]).auth_secret() is None


def test_the_launcher_refuses_pd_serving_without_a_secret() -> None:
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    result = subprocess.run(
        [
            sys.executable, "-m", "sgl_pd.launch_server",
            "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "sgl_pd",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )  # fmt: skip
    assert result.returncode != 0
    assert "--pd-auth-secret-file" in result.stderr and "Traceback" not in result.stderr


def test_peer_text_is_one_bounded_escaped_line() -> None:
    shown = peer_text("evil\n[ERROR] forged line" + "x" * 10_000)
    assert "\n" not in shown and len(shown) < 250 and "more" not in shown
    assert shown.endswith("chars)")
    assert peer_text("ok") == "'ok'"


def test_the_log_limiter_holds_back_repeats_and_counts_them() -> None:
    now = [0.0]
    lines: list[str] = []

    class _Logger:
        def log(self, _level: int, msg: str, *args: object, exc_info: bool = False) -> None:
            lines.append(msg % args)

    limiter = LogLimiter(_Logger(), interval_s=10.0, clock=lambda: now[0])  # type: ignore[arg-type]
    assert limiter.warning("k", "bad frame %d", 1)
    assert not limiter.warning("k", "bad frame %d", 2)
    assert limiter.warning("other", "another kind")
    now[0] = 11.0
    assert limiter.warning("k", "bad frame %d", 3)
    assert lines == ["bad frame 1", "another kind", "bad frame 3 (1 more like this not logged)"]


def test_variables_use_a_prefix_sglang_leaves_alone_and_old_names_still_work(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """SGLang renames every SGL_* variable to SGLANG_* in its processes (copying the
    value, warning that ours is deprecated): sgl_pd's are SGLPD_*; an old SGL_PD_* name
    is read with one warning of our own, and SGLang's renamed copy without one."""
    from sgl_pd import config

    assert config.CONFIG_ENV.startswith("SGLPD_") and config.SECRET_ENV.startswith("SGLPD_")
    assert config.env_value("SGLPD_X", {"SGLPD_X": "new", "SGL_PD_X": "old"}) == "new"
    with caplog.at_level("WARNING", logger="sgl_pd.config"):
        assert config.env_value("SGLPD_Y", {"SGL_PD_Y": "old"}) == "old"
        assert config.env_value("SGLPD_Y", {"SGL_PD_Y": "old"}) == "old"
        assert config.env_value("SGLPD_Z", {"SGLANG_PD_Z": "copied"}) == "copied"
    assert [r.getMessage() for r in caplog.records] == [
        "SGL_PD_Y is an old name: set SGLPD_Y instead (the old one is read until the next release)"
    ]
    assert config.env_value("SGLPD_NONE", {}) is None
