"""Layer-wise KV streaming: a per-layer progress counter the forward bumps (CUDA-graph-safe)
and the host thread that polls it and hands each finished layer to the transfer (D6-D8).

Pure of SGLang; torch is imported only when a `CudaProgress` is built.
"""

from sgl_pd.layerwise.progress import (
    MAX_GENERATION,
    STRIDE,
    CudaProgress,
    CudaUnavailable,
    HostProgress,
    LayerwiseError,
    ProgressCounter,
    ProgressError,
    decode,
    encode,
)
from sgl_pd.layerwise.streamer import (
    ForwardJob,
    JobTimeline,
    LayerStreamer,
    StepOutcome,
    StreamerError,
)

__all__ = [
    "MAX_GENERATION",
    "STRIDE",
    "CudaProgress",
    "CudaUnavailable",
    "ForwardJob",
    "HostProgress",
    "JobTimeline",
    "LayerStreamer",
    "LayerwiseError",
    "ProgressCounter",
    "ProgressError",
    "StepOutcome",
    "StreamerError",
    "decode",
    "encode",
]
