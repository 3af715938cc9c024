"""A forward's end as the layer streamer sees it on a GPU (`layerwise_glue.ForwardEnd`):
an event recorded on the forward's stream after its launch, as ``run_batch`` returns
under the overlap scheduler. It must not read as ended while the forward's kernels still
run (the streamer would send KV not yet written), and must once they are done. Skipped
without a CUDA device."""

from __future__ import annotations

import time

from gpu_marks import GPU_ONLY

from sgl_pd.backend.prefill.layerwise_glue import ForwardEnd

pytestmark = GPU_ONLY

WAIT_S = 10.0


def test_a_launched_forward_reads_as_ended_only_once_its_kernels_ran() -> None:
    import torch

    stream = torch.cuda.Stream()
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    end = ForwardEnd()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of device time: the "forward"
        y = x @ x
    end.launched(stream, on_gpu=True)  # what after_run_batch does, from the host
    assert not end(), "read as ended while its kernels were still queued"
    deadline = time.monotonic() + WAIT_S
    while not end():
        assert time.monotonic() < deadline, "never read as ended"
        time.sleep(0.001)
    assert stream.query()  # everything before the record has run
    assert torch.isfinite(y.float()).all()
