"""On a GPU, the chunk notice does not wait for the scheduler's stream: `page_ids_of`
queues the copy of the page ids and returns while the work queued before it still runs
(the old `.cpu()` blocked there: under the overlap scheduler, on the forward in flight).
The ids read later are SGLang's. The first call waits for the device (a pinned allocation,
lazily loaded kernels): the glue makes it when the model loads. Skipped without a CUDA device."""

from __future__ import annotations

import torch
from gpu_marks import GPU_ONLY

from sgl_pd.backend.prefill.layerwise_glue import page_ids_of, warm_page_id_copies

pytestmark = GPU_ONLY

SLEEP_CYCLES = 200_000_000  # GPU cycles of spin queued first (~100 ms on an H200)


def test_the_notice_returns_before_the_stream_reaches_the_copy() -> None:
    warm_page_id_copies("cuda")  # as the glue does when the model loads
    row = torch.arange(1000, 1000 + 4096, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    busy = torch.cuda.Event()
    torch.cuda._sleep(SLEEP_CYCLES)  # the forward in flight, as far as this stream knows
    busy.record()
    ids = page_ids_of(row, 16)
    assert not busy.query(), "page_ids_of waited for the work queued before it"
    assert not ids.resolved
    expected = (row[::16] // 16).cpu().tolist()
    assert ids.array().tolist() == expected  # waits for the copy, then reads it
