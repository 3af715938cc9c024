"""Per-stream figures from SGLang's benchmark client output (sglang.benchmark.serving)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sgl_pd.cluster.load import Workload, bench_serving_argv, summarize


def _result(ttfts: list[float], itls: list[list[float]], errors: list[str]) -> dict:
    return {
        "ttfts": ttfts,
        "itls": itls,
        "output_lens": [len(i) + 1 if not e else 0 for i, e in zip(itls, errors, strict=True)],
        "errors": errors,
        "input_lens": [100] * len(errors),
        "duration": 10.0,
    }


def test_streams_are_summarised_from_their_gaps() -> None:
    # two streams: a steady one (4 gaps of 50 ms) and one that stalls once for 1 s
    result = _result(
        [0.2, 0.4, 0.0],
        [[0.05] * 4, [0.05, 1.0, 0.05, 0.05], []],
        ["", "", "connection reset"],
    )
    stats = summarize(result, rate=0.5, itl_target_ms=100.0)
    assert (stats.completed, stats.failed) == (2, 1)
    assert stats.itl_p50 == pytest.approx(50.0)
    assert stats.itl_max == pytest.approx(1000.0)
    assert stats.ttft_p50 == pytest.approx(300.0)
    # per stream: 4 tokens after the first over the decode time: 20 and 4 tok/s
    assert stats.tps_per_stream == pytest.approx((20.0 + 4 / 1.15) / 2)
    assert stats.goodput == pytest.approx(1 / 10.0)  # only the steady stream met 100 ms


def test_a_run_with_no_completed_request_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="no request completed"):
        summarize(_result([0.0], [[]], ["refused"]), rate=1.0, itl_target_ms=10.0)


def test_the_load_is_sglangs_own_client_with_random_ids() -> None:
    argv = bench_serving_argv(
        "http://127.0.0.1:1", Path("/m"), Workload(2048, 150, 8, 0.5), Path("/o.jsonl")
    )
    assert argv[1:3] == ["-m", "sglang.benchmark.serving"]

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert value("--dataset-name") == "random-ids"
    assert value("--request-rate") == "0.5"
    assert value("--random-input-len") == "2048"
    assert "--tokenize-prompt" in argv  # ids, not re-tokenized text: exact lengths
