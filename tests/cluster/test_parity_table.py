"""The docs' table of request features is the parity test's table, and the comparison
of two answers tells near ties from different answers."""

from __future__ import annotations

from pathlib import Path

from sgl_pd.cluster import parity

DOCS = Path(__file__).resolve().parents[2] / "docs" / "parity.md"


def test_the_docs_table_is_generated_from_the_rows() -> None:
    assert DOCS.read_text() == parity.markdown(), "run: python -m sgl_pd.cluster.parity"


def test_every_row_has_a_distinct_name_and_every_refusal_says_why() -> None:
    names = [row.feature for row in parity.ROWS]
    assert len(names) == len(set(names))
    assert all(row.why for row in parity.ROWS if row.outcome is parity.Outcome.PD_REFUSES)


def _answer(output_ids: list[int], logprob: float, status: int = 200) -> parity.Answer:
    body = {"output_ids": output_ids, "meta_info": {"id": "x", "e2e_latency": 0.1,
            "output_token_logprobs": [[logprob, output_ids[0], None]]}}  # fmt: skip
    return parity.Answer(status, body)


def test_answers_agree_up_to_float_noise_and_no_further() -> None:
    row = parity.ROWS[1]
    assert parity.answers_agree(row, _answer([1, 2], -0.5), _answer([1, 2], -0.5000001)) == []
    assert parity.answers_agree(row, _answer([1, 2], -0.5), _answer([1, 2], -0.6))
    assert parity.answers_agree(row, _answer([1, 2], -0.5), _answer([1, 3], -0.5))
    assert parity.answers_agree(row, _answer([1, 2], -0.5), _answer([1, 2], -0.5, status=500))


def test_a_refusal_row_wants_a_4xx_and_not_a_hang_or_a_500() -> None:
    refused = next(r for r in parity.ROWS if r.outcome is parity.Outcome.PD_REFUSES)
    ok = _answer([1], 0.0)
    assert parity.answers_agree(refused, ok, parity.Answer(400, {})) == []
    assert parity.answers_agree(refused, ok, parity.Answer(500, {}))
    assert parity.answers_agree(refused, ok, ok)
