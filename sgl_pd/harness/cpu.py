"""Decides whether this host runs SGLang on a GPU or on its CPU engine, and what that takes.

The decision is made once, in the launcher, before SGLang is imported: the stand-in
driver has to be on the library path when the process starts, so the launcher
re-executes itself with the environment returned here.
"""

from __future__ import annotations

import ctypes
import enum
import os
from dataclasses import dataclass

from sgl_pd.errors import ConfigError
from sgl_pd.harness.build_stub import STUB_PATH, ensure_stub

# Flags SGLang's CPU engine needs (facts in the design brief): no CUDA graphs or overlap
# scheduling without a GPU, and the attention backend that runs on plain torch ops.
CPU_SERVER_FLAGS: dict[str, str | None] = {
    "--device": "cpu",
    "--attention-backend": "torch_native",
    # (SGLang's spelling of --disable-cuda-graph that it does not warn about)
    "--cuda-graph-backend-decode": "disabled",
    "--cuda-graph-backend-prefill": "disabled",
    "--disable-overlap-schedule": None,
}


class Harness(enum.Enum):
    GPU = "gpu"
    CPU = "cpu"


@dataclass(frozen=True)
class HarnessPlan:
    harness: Harness
    reason: str  # one line for the log: why this harness was chosen
    env: dict[str, str]  # variables to add to the server's environment
    extra_args: tuple[str, ...]  # SGLang flags the user did not give but the harness needs


def real_driver_has_devices() -> bool:
    """True when a real NVIDIA driver is loadable and reports at least one device.

    The stand-in never satisfies this: it has no ``cuInit``.
    """
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        cu_init = lib.cuInit
        cu_count = lib.cuDeviceGetCount
    except (OSError, AttributeError):
        return False
    count = ctypes.c_int(0)
    return cu_init(0) == 0 and cu_count(ctypes.byref(count)) == 0 and count.value > 0


def _given(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value of `flag` in `argv` ("--flag value" or "--flag=value"), None if absent."""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def uses_dp_attention(argv: list[str]) -> bool:
    """The server runs DP attention (the old flag or the attention-DP size)."""
    return _given(argv, "--enable-dp-attention") or flag_value(argv, "--attn-dp-size") not in (
        None,
        "1",
    )


def plan_harness(requested: Harness | None, argv: list[str]) -> HarnessPlan:
    """Chooses the harness (``requested`` or auto-detected) and what it adds to ``argv``."""
    if requested is None:
        requested = Harness.GPU if real_driver_has_devices() else Harness.CPU
        reason = (
            "a CUDA driver with devices was found"
            if requested is Harness.GPU
            else ("no CUDA driver with devices was found")
        )
    else:
        reason = f"--pd-harness {requested.value} was given"
        if requested is Harness.GPU and not real_driver_has_devices():
            raise ConfigError(
                "--pd-harness gpu: no GPU is visible here (no CUDA driver reports a device):"
                " check the GPU device plugin or CUDA_VISIBLE_DEVICES, or serve on SGLang's"
                " CPU engine with --pd-harness cpu"
            )
    if requested is Harness.GPU:
        return HarnessPlan(Harness.GPU, reason, {}, ())

    stub_dir = str(ensure_stub().parent)
    library_path = os.pathsep.join(p for p in (stub_dir, os.environ.get("LD_LIBRARY_PATH")) if p)
    extra: list[str] = []
    flags = dict(CPU_SERVER_FLAGS)
    if flag_value(argv, "--disaggregation-mode") == "decode":
        # a decoder backs up retracted requests' KV in pinned host memory unless told to
        # keep plain CPU tensors; pinning needs the CUDA driver
        flags["--disaggregation-decode-retraction-backup"] = "cpu_tensor"
        # a DP-attention decoder's LM head exchanges logits with SGLang's all-to-all
        # custom op, registered for CUDA only; the all-gather path it replaces runs
        if uses_dp_attention(argv) and not _given(argv, "--enable-tp-lm-head-all-to-all"):
            flags["--no-enable-tp-lm-head-all-to-all"] = None
    for flag, value in flags.items():
        if not _given(argv, flag):
            extra += [flag] if value is None else [flag, value]
    return HarnessPlan(
        Harness.CPU,
        f"{reason}: serving on SGLang's CPU engine with the stand-in driver {STUB_PATH}",
        {
            "SGLANG_USE_CPU_ENGINE": "1",
            "LD_LIBRARY_PATH": library_path,
            # SGLang torch.compiles the MoE router's biased top-k (about 100 s of gcc on
            # the first MoE forward on CPU); eager torch computes the same
            "TORCHDYNAMO_DISABLE": "1",
        },
        tuple(extra),
    )
