"""The CPU harness: the stand-in driver, the flags it adds, and the launcher's help."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

from sgl_pd.harness.build_stub import ensure_stub
from sgl_pd.harness.cpu import CPU_SERVER_FLAGS, Harness, plan_harness


def test_stub_exports_the_one_symbol_and_reports_no_device() -> None:
    lib = ctypes.CDLL(str(ensure_stub()))
    result = lib.cuPointerGetAttribute(None, 0, ctypes.c_ulonglong(0))
    assert result == 100  # CUDA_ERROR_NO_DEVICE: nothing may mistake it for a driver
    assert not hasattr(lib, "cuInit")


def test_cpu_plan_adds_only_missing_flags_and_the_library_path() -> None:
    given = ["--device", "cpu", "--cuda-graph-backend-decode", "disabled"]
    plan = plan_harness(Harness.CPU, given)
    assert plan.harness is Harness.CPU
    assert plan.extra_args == (
        "--attention-backend",
        "torch_native",
        "--cuda-graph-backend-prefill",
        "disabled",
        "--disable-overlap-schedule",
    )
    assert plan.env["SGLANG_USE_CPU_ENGINE"] == "1"
    assert str(ensure_stub().parent) in plan.env["LD_LIBRARY_PATH"].split(":")


def test_gpu_plan_changes_nothing_and_needs_a_gpu() -> None:
    """Asked for explicitly, the GPU harness changes nothing - where a GPU is visible; a
    pod whose GPUs are not would otherwise serve on CPU: it refuses in one line."""
    from sgl_pd.errors import ConfigError
    from sgl_pd.harness.cpu import real_driver_has_devices

    if real_driver_has_devices():
        plan = plan_harness(Harness.GPU, [])
        assert plan.env == {} and plan.extra_args == ()
    else:
        with pytest.raises(ConfigError, match="no GPU is visible"):
            plan_harness(Harness.GPU, [])


def test_every_cpu_flag_is_an_sglang_flag() -> None:
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    known = {opt for action in parser._actions for opt in action.option_strings}
    assert set(CPU_SERVER_FLAGS) <= known


def test_launcher_help_lists_sglang_and_sgl_pd_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sgl_pd.launch_server", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    assert "--model-path" in out and "--disaggregation-mode" in out  # SGLang's
    assert "--pd-harness" in out and "--pd-transport" in out  # ours
    assert "sgl_pd" in out.split("--disaggregation-transfer-backend", 1)[1].split("\n", 1)[0]


def test_launcher_rejects_a_bad_flag_value_without_a_traceback() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sgl_pd.launch_server", "--pd-transport", "carrier-pigeon"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "invalid choice" in result.stderr and "Traceback" not in result.stderr


def test_a_dp_attention_decoder_keeps_the_lm_head_on_all_gather_on_cpu() -> None:
    decode = ["--disaggregation-mode", "decode", "--tp", "2", "--dp", "2"]
    plan = plan_harness(Harness.CPU, [*decode, "--enable-dp-attention"])
    assert "--no-enable-tp-lm-head-all-to-all" in plan.extra_args
    assert "--no-enable-tp-lm-head-all-to-all" not in plan_harness(Harness.CPU, decode).extra_args
    chosen = plan_harness(
        Harness.CPU, [*decode, "--attn-dp-size", "2", "--enable-tp-lm-head-all-to-all"]
    )
    assert "--no-enable-tp-lm-head-all-to-all" not in chosen.extra_args


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (
            ["--disaggregation-mode", "prefill", "--tp", "2", "--enable-dp-attention"],
            "DP attention",
        ),
        (["--disaggregation-mode", "decode", "--pp-size", "2"], "pipeline parallelism"),
        (
            ["--disaggregation-mode", "prefill", "--enable-two-batch-overlap"],
            "--pd-kv-send after-forward",
        ),
        (
            ["--disaggregation-mode", "prefill", "--optimistic-prefill-attempts", "2"],
            "--optimistic-prefill-attempts 2 is not served",
        ),
        (
            [
                "--disaggregation-mode",
                "decode",
                "--disaggregation-decode-allocation-policy",
                "prefill_complete",
            ],
            "prefill_complete is not served",
        ),
        (
            [
                "--disaggregation-mode",
                "decode",
                "--disaggregation-decode-enable-radix-cache",
                "--enable-hierarchical-cache",
            ],
            "decode HiCache) is not served yet",
        ),
        (["--disaggregation-mode", "prefill", "--enable-prefill-cp"], "context parallelism"),
        (
            ["--disaggregation-mode", "decode", "--enable-multi-layer-eagle"],
            "--pd-first-token prefill",
        ),
        (
            ["--disaggregation-mode", "decode", "--enable-return-hidden-states"],
            "--return-hidden-states-mode last",
        ),
    ],
)
def test_launcher_refuses_unserved_options_without_a_traceback(flags: list[str], says: str) -> None:
    argv = [
        "--model-path",
        "m",
        *flags,
        "--disaggregation-transfer-backend",
        "sgl_pd",
        "--pd-no-auth",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "sgl_pd.launch_server", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and says in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_launchers_building_the_stub_side_by_side_all_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Servers started together on a fresh checkout each build the stand-in driver; none
    may take another's half-written file or fail on its rename."""
    import ctypes
    from concurrent.futures import ThreadPoolExecutor

    from sgl_pd.harness import build_stub

    monkeypatch.setattr(build_stub, "BUILD_DIR", tmp_path)
    monkeypatch.setattr(build_stub, "STUB_PATH", tmp_path / "libcuda.so.1")
    with ThreadPoolExecutor(4) as pool:
        built = list(pool.map(lambda _: build_stub.ensure_stub(), range(4)))
    assert built == [tmp_path / "libcuda.so.1"] * 4
    ctypes.CDLL(str(built[0]))
    assert [p.name for p in tmp_path.iterdir()] == ["libcuda.so.1"]


def test_a_gpu_pinned_server_without_a_gpu_exits_at_once_with_one_line() -> None:
    """What the recipes and manifests start (`--pd-harness gpu`) on a host whose GPUs are
    not visible: the launcher exits before SGLang starts, one line, no traceback."""
    from sgl_pd.harness.cpu import real_driver_has_devices

    if real_driver_has_devices():
        pytest.skip("a GPU is visible here")
    done = subprocess.run(
        [
            sys.executable, "-m", "sgl_pd.launch_server", "--pd-harness", "gpu",
            "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "sgl_pd",
            "--pd-no-auth", "--model-path", "unused",
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("sgl_pd: ")]
    assert len(errors) == 1 and "no GPU is visible" in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
