"""--pd-kv-checksum over the backend and the in-memory engine: the decoder verifies what
landed against what each prefill rank summed as it wrote, after-forward and layer by
layer, with a held prefix; a corrupted write fails its request (cause `checksum`), every
time, never a decode from the wrong bytes; a prefiller that does not sum is named."""

from __future__ import annotations

import pytest

from sgl_pd.core.states import DecodeState

from .pd_fakes import LAYOUT, Rig, wait_state


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("held_pages", [0, 3])
def test_verified_requests_go_to_decode(layerwise: bool, held_pages: int) -> None:
    rig = Rig(layerwise=layerwise, checksum=True)
    d = rig.add_decoder("decode-a")
    for room in (5, 6):
        src = list(range(10 * (room - 4), 10 * (room - 4) + 9))
        rig.request(
            d, room, list(range(20, 29))[held_pages:], room % 8, held_pages * LAYOUT.page_size
        )
        send = rig.prefill_layerwise if layerwise else rig.prefill_all
        send(room, src, held_pages=held_pages)
        wait_state(d, room, DecodeState.COMPLETE)
        assert d.messenger.hand_off(room), d.messenger.poll(room)
        assert d.messenger.poll(room)[0] is DecodeState.HANDED_OFF
        d.messenger.forget(room)
    rig.prefill.writers.close()


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_corrupted_write_is_caught_every_time(layerwise: bool) -> None:
    rig = Rig(layerwise=layerwise, checksum=True, corruption_rate=1.0, metered=True)
    d = rig.add_decoder("decode-a")
    for room in range(1, 9):
        rig.request(d, room, list(range(6 * room, 6 * room + 6)), room % 8)
        (rig.prefill_layerwise if layerwise else rig.prefill_all)(room, list(range(6)))
        wait_state(d, room, DecodeState.COMPLETE)
        assert not d.messenger.hand_off(room)
        state, error = d.messenger.poll(room)
        assert state is DecodeState.FAILED
        assert "checksum mismatch: layer" in (error or "") and "prefill rank 0" in (error or "")
        assert d.messenger.is_release_safe(room, 1)  # every write landed: pages may go
        d.messenger.forget(room)
    assert rig.faulty_engine.corrupted_batches >= 8
    registry = rig.registries["decode"]
    value = registry.get_sample_value(
        "sgl_pd_transfer_failures_total", {"role": "decode", "cause": "checksum"}
    )
    assert value == 8
    rig.prefill.writers.close()


def test_a_prefiller_without_checksums_is_named() -> None:
    rig = Rig(checksum=False, decoder_checksum=True)
    d = rig.add_decoder("decode-a")
    rig.request(d, 3, list(range(20, 24)), 3)
    rig.prefill_all(3, list(range(4)))
    wait_state(d, 3, DecodeState.FAILED)
    assert "--pd-kv-checksum" in (d.messenger.poll(3)[1] or "")
    rig.prefill.writers.close()
