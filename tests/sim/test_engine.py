"""The event engine against hand-computed timelines, and its properties on random traces."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_pd.sim.deploy import MixedSetup, PdSetup, figures
from sgl_pd.sim.engine import SimRequest, TransferModel
from sgl_pd.sim.roofline import MeasuredCost
from sgl_pd.sim.trace import Lengths, load_trace, poisson

COST = MeasuredCost(prefill_s_per_token=0.001, decode_step_s=0.010, decode_per_request_s=0.0)
# 4 layers, 1000 B per token, 1 MB/s: 100 tokens are 0.1 s on the wire, 25 ms a layer
LAYERWISE = TransferModel(1000.0, 4, 1e6, 0.001, layerwise=True)
AFTER_FORWARD = TransferModel(1000.0, 4, 1e6, 0.001, layerwise=False)


def _one(prompt: int = 101, output: int = 3) -> list[SimRequest]:
    return [SimRequest(0, 0.0, prompt, output)]


def test_pd_one_request_layer_wise() -> None:
    (r,), _ = PdSetup(COST, COST, 1, 1, LAYERWISE).run(_one())
    # the prefiller runs tokens [0, 100) in 100 ms; layer l is ready at 25 ms x (l + 1) and
    # the wire is busy 25 ms per layer: 50, 75, 100, 125 ms, then 1 ms latency
    assert r.forward_end == pytest.approx(0.100)
    assert r.kv_complete == pytest.approx(0.126)
    # the decoder's first step runs token 100 and samples the first output token (D16)
    assert r.token_times == pytest.approx([0.136, 0.146, 0.156])


def test_pd_one_request_after_forward() -> None:
    (r,), _ = PdSetup(COST, COST, 1, 1, AFTER_FORWARD).run(_one())
    assert r.kv_complete == pytest.approx(0.100 + 0.100 + 0.001)
    assert r.token_times[0] == pytest.approx(0.211)


def test_mixed_one_request_chunked() -> None:
    (r,), _ = MixedSetup(COST, 1, chunk_tokens=64).run(_one(prompt=100))
    # chunks of 64 and 36 tokens; the prefill samples token 1, then two decode steps
    assert r.token_times == pytest.approx([0.100, 0.110, 0.120])


def test_mixed_decode_streams_wait_for_a_prefill() -> None:
    reqs = [SimRequest(0, 0.0, 10, 50), SimRequest(1, 0.105, 500, 2)]
    MixedSetup(COST, 1, chunk_tokens=8192).run(reqs)
    gaps = [b - a for a, b in zip(reqs[0].token_times, reqs[0].token_times[1:], strict=False)]
    assert max(gaps) == pytest.approx(0.010 + 0.500)  # one decode step waits for 500 tokens


def test_figures_of_a_run() -> None:
    reqs = poisson(2.0, 40, Lengths(200), Lengths(20), seed=3)
    f = figures(*PdSetup(COST, COST, 1, 2, LAYERWISE).run(reqs), warmup=0.0)
    assert f.requests == 40
    assert f.ttft_p50_ms >= 200 + 10  # the prefill and one decode step at least
    assert f.itl_p50_ms == pytest.approx(10.0)  # batch growth is free in COST
    assert 0 < f.exposed_p50_ms <= 201 * 1000 / 1e6 * 1e3 + 1


traces = st.lists(
    st.tuples(
        st.floats(0.0, 2.0),  # inter-arrival, s
        st.integers(2, 400),  # prompt tokens
        st.integers(1, 30),  # output tokens
    ),
    min_size=1,
    max_size=12,
)


def _requests(spec: list[tuple[float, int, int]]) -> list[SimRequest]:
    t, out = 0.0, []
    for i, (gap, prompt, output) in enumerate(spec):
        t += gap
        out.append(SimRequest(i, t, prompt, output))
    return out


@settings(max_examples=60, deadline=None)
@given(traces, st.integers(16, 512))
def test_layer_wise_never_exposes_more_than_after_forward(spec, chunk) -> None:  # type: ignore[no-untyped-def]
    lw, _ = PdSetup(COST, COST, 1, 2, LAYERWISE, chunk_tokens=chunk).run(_requests(spec))
    af, _ = PdSetup(COST, COST, 1, 2, AFTER_FORWARD, chunk_tokens=chunk).run(_requests(spec))
    for a, b in zip(lw, af, strict=True):
        assert a.forward_end == b.forward_end  # the prefill does not wait on the wire
        assert a.kv_complete - a.forward_end <= b.kv_complete - b.forward_end + 1e-12


GROWING = MeasuredCost(prefill_s_per_token=0.001, decode_step_s=0.010, decode_per_request_s=0.004)


@settings(max_examples=60, deadline=None)
@given(traces, st.integers(1, 3))
def test_more_decoders_never_lower_throughput(spec, decoders) -> None:  # type: ignore[no-untyped-def]
    def finish(n: int) -> float:
        reqs, _ = PdSetup(COST, GROWING, 1, n, LAYERWISE).run(_requests(spec))
        assert all(r.done for r in reqs)
        return max(r.token_times[-1] for r in reqs)

    # the same work served: it finishes no later with one more decoder
    assert finish(decoders + 1) <= finish(decoders) + 1e-9


def test_traces_in_published_formats(tmp_path) -> None:  # type: ignore[no-untyped-def]
    mooncake = tmp_path / "trace.jsonl"
    mooncake.write_text(
        '{"timestamp": 1000, "input_length": 6000, "output_length": 300, "hash_ids": [1]}\n'
        '{"timestamp": 1500, "input_length": 100, "output_length": 20, "hash_ids": [2]}\n'
    )
    a, b = load_trace(mooncake)
    assert (a.arrival, a.prompt_tokens, a.output_tokens) == (0.0, 6000, 300)
    assert b.arrival == pytest.approx(0.5)
    azure = tmp_path / "azure.csv"
    azure.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
    )
    c, d = load_trace(azure, speedup=2.0)
    assert (c.prompt_tokens, d.output_tokens) == (374, 109)
    assert d.arrival == pytest.approx((50.995169 - 46.68059) / 2, rel=1e-6)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no requests"):
        load_trace(empty)


def test_a_follow_up_is_prefilled_on_the_decoder_when_local_prefill_is_on() -> None:
    """A follow-up turn holding all but 30 of its 1001 prompt tokens: with local prefill
    the decoder computes those 30 in one step (30 ms) and samples the first token there;
    off, the prefill server computes 29 (D16), sends their KV, and the decoder's first
    step feeds the last token."""

    def follow_up() -> list[SimRequest]:
        return [SimRequest(0, 0.0, 1001, 3, held_tokens=971)]

    (local,), _ = PdSetup(COST, COST, 1, 1, LAYERWISE, local_prefill_max_tokens=64).run(follow_up())
    assert local.kv_complete is None  # nothing crossed the wire
    assert local.token_times == pytest.approx([0.030, 0.040, 0.050])
    (remote,), _ = PdSetup(COST, COST, 1, 1, LAYERWISE).run(follow_up())
    assert remote.kv_complete is not None and remote.token_times[0] > local.token_times[0]
    # a fresh prompt that long stays with the prefill server either way
    (fresh,), _ = PdSetup(COST, COST, 1, 1, LAYERWISE, local_prefill_max_tokens=64).run(_one())
    assert fresh.kv_complete is not None


def test_local_steps_interleave_with_running_streams() -> None:
    """A stream decoding while the decoder prefills a 100-token suffix: the local chunk
    rides in the stream's decode step, which then takes 10 ms + 100 ms at this cost."""
    stream = SimRequest(0, 0.0, 1001, 12, held_tokens=1000)
    follow_up = SimRequest(1, 0.015, 1100, 2, held_tokens=1000)
    setup = PdSetup(COST, COST, 1, 1, LAYERWISE, local_prefill_max_tokens=100)
    (s, f), _ = setup.run([stream, follow_up])
    gaps = [b - a for a, b in zip(s.token_times, s.token_times[1:], strict=False)]
    assert max(gaps) == pytest.approx(0.010 + 0.100)  # one mixed step, not two steps
    assert f.token_times and f.kv_complete is None
