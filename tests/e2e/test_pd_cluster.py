"""Prefill server + decode server + SGLang's router, with sgl_pd streaming the KV layer by
layer over real Mooncake TCP: same greedy tokens as one monolithic server, layers sent
while the forward pass still runs, and nothing leaked."""

from __future__ import annotations

import collections
import json
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from sgl_pd.cluster.client import chat, generate_ids, stream_chat
from sgl_pd.cluster.conversations import replay, script, wrong_turns
from sgl_pd.cluster.local import Patience, PdCluster, Server
from sgl_pd.cluster.logs import pools_idle, timing_lines, unexpected_warnings, wait_pools_idle
from sgl_pd.cluster.prompts import long_prompt_ids, prompt_ids, varied_prompts
from sgl_pd.cluster.soak import Traffic, gauges
from sgl_pd.messenger.reliable import MAX_REMEMBERED
from sgl_pd.models import TINY_LLAMA_PATH

from .conftest import CHUNKED_PREFILL_SIZE, DECODE_PREFIX_CACHE, start_pd

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdCluster]:
    yield from start_pd(tmp_path_factory, "layerwise", decode_extra=DECODE_PREFIX_CACHE)


PROMPTS = varied_prompts(50)
REMEMBERED = "table:deliveries_remembered"
MAX_NEW_TOKENS = 12


def _all(url: str) -> list[list[int]]:
    with ThreadPoolExecutor(max_workers=16) as pool:  # 16 requests in flight at a time
        return list(pool.map(lambda p: generate_ids(url, p, MAX_NEW_TOKENS), PROMPTS))


def test_prompts_cover_several_chunks() -> None:
    from transformers import AutoTokenizer

    from sgl_pd.models import TINY_LLAMA_PATH

    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA_PATH)
    lengths = [len(tokenizer(p).input_ids) for p in PROMPTS]
    assert min(lengths) < CHUNKED_PREFILL_SIZE and max(lengths) > 3 * CHUNKED_PREFILL_SIZE


def test_fifty_concurrent_prompts_match_monolithic_tokens(mono: Server, pd: PdCluster) -> None:
    expected = _all(mono.url)
    got = _all(pd.router_url)
    mismatches = [i for i, (e, g) in enumerate(zip(expected, got, strict=True)) if e != g]
    assert not mismatches, f"prompts {mismatches} differ from monolithic serving"
    assert all(len(ids) == MAX_NEW_TOKENS for ids in got)  # plain text never ends early


def test_one_and_two_token_prompts_match_monolithic_tokens(mono: Server, pd: PdCluster) -> None:
    """The decoder samples the first token (D16) from prompt token n-1; a one-token prompt
    has nothing to prefill before it and goes upstream's way. Both give monolithic's tokens."""
    for ids in ([0], [0, 41], [0, 41, 42], long_prompt_ids(2), long_prompt_ids(3)):
        assert generate_ids(pd.router_url, ids, 6) == generate_ids(mono.url, ids, 6), ids


def _generate(url: str, ids: list[int], **sampling: object) -> dict[str, object]:
    body = {"input_ids": ids, "sampling_params": sampling, "return_logprob": True}
    response = requests.post(f"{url}/generate", json=body, timeout=300)
    response.raise_for_status()
    return dict(response.json())


def test_the_first_token_comes_from_monolithics_distribution(mono: Server, pd: PdCluster) -> None:
    """The decoder samples the first token (D16) from the distribution monolithic serving
    computes (its logprob within float tolerance), and with the request's own seed: the
    same seeded request gives the same tokens twice. (Seeded tokens are not compared with
    monolithic's: the decoder computes the last prompt token in a decode step, not in an
    extend, so logits differ in their last bits and, as with any change of batch or prefix
    cache, a sampled token can flip where the draw falls at a boundary.)"""
    for i, text in enumerate(PROMPTS[:8]):
        ids = prompt_ids(text)
        want = _generate(mono.url, ids, temperature=0, max_new_tokens=1)
        got = _generate(pd.router_url, ids, temperature=0, max_new_tokens=1)
        (lp_got, tok_got, _), (lp_want, tok_want, _) = (
            r["meta_info"]["output_token_logprobs"][0]  # type: ignore[index]
            for r in (got, want)
        )
        assert tok_got == tok_want and abs(lp_got - lp_want) < 0.05, (i, lp_got, lp_want)
    sampling = {"temperature": 0.9, "top_p": 0.95, "top_k": 40, "max_new_tokens": 8}
    ids = prompt_ids(PROMPTS[0])
    first, again = (_generate(pd.router_url, ids, sampling_seed=7, **sampling) for _ in "ab")
    assert first["output_ids"] == again["output_ids"]


def test_stop_strings_end_the_output_as_in_monolithic(mono: Server, pd: PdCluster) -> None:
    ids = long_prompt_ids(12)
    sampling = {"temperature": 0, "max_new_tokens": 16, "stop": ["1"]}
    want = _generate(mono.url, ids, **sampling)
    got = _generate(pd.router_url, ids, **sampling)
    assert got["text"] == want["text"] and got["output_ids"] == want["output_ids"]


JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "done": {"type": "boolean"},
    },
    "required": ["count", "done"],
    "additionalProperties": False,
}


def test_json_schema_requests_parse_and_validate(pd: PdCluster) -> None:
    """Grammars run only on the decoder (the prefiller's copy carries none): every output
    parses and validates, the first token included."""
    import json

    import jsonschema

    def one(i: int) -> str:
        body = {
            "text": PROMPTS[i % len(PROMPTS)],
            "sampling_params": {
                "temperature": 0.7,
                "sampling_seed": i,
                "max_new_tokens": 48,
                "json_schema": json.dumps(JSON_SCHEMA),
            },
        }
        response = requests.post(f"{pd.router_url}/generate", json=body, timeout=300)
        response.raise_for_status()
        return str(response.json()["text"])

    with ThreadPoolExecutor(max_workers=16) as pool:
        texts = list(pool.map(one, range(100)))
    for text in texts:
        jsonschema.validate(json.loads(text), JSON_SCHEMA)


def test_streaming_chat_through_the_router(mono: Server, pd: PdCluster) -> None:
    streamed = stream_chat(pd.router_url, "What is 3 + 4?", max_tokens=24)
    assert streamed.text == chat(mono.url, "What is 3 + 4?", max_tokens=24)
    assert streamed.ttft_s <= streamed.total_s


def test_layers_are_sent_before_the_forward_pass_ends(mono: Server, pd: PdCluster) -> None:
    """A long prompt, chunked: the messenger's own clock shows the last chunk's first
    layer written before that chunk's forward pass ended, and the tokens still match."""
    ids = long_prompt_ids(8 * CHUNKED_PREFILL_SIZE)
    assert generate_ids(pd.router_url, ids, 4) == generate_ids(mono.url, ids, 4)
    line = timing_lines(pd.prefill.process.log_path)[-1]
    assert line["mode"] == "layerwise" and line["chunks"] == 8
    assert line["last_chunk_first_write"] < line["forward_end"] <= line["done"]


def test_metrics_report_transfers(pd: PdCluster) -> None:
    generate_ids(pd.router_url, PROMPTS[0], 2)
    text = requests.get(f"{pd.prefill.url}/metrics", timeout=30).text
    sent = re.search(r'^sgl_pd_transfer_bytes_total\{role="prefill"\} ([0-9.e+]+)$', text, re.M)
    assert sent is not None and float(sent.group(1)) > 0
    served = re.search(r'^sgl_pd_transfer_pages_total\{role="prefill"\} ([0-9.e+]+)$', text, re.M)
    assert served is not None and float(served.group(1)) > 0
    text = requests.get(f"{pd.decode.url}/metrics", timeout=30).text
    done = re.search(r'^sgl_pd_transfer_requests_total\{role="decode"\} ([0-9.e+]+)$', text, re.M)
    assert done is not None and float(done.group(1)) >= 1
    assert re.search(r'^sgl_pd_transfer_seconds_count\{role="decode"\}', text, re.M)
    for url, role in ((pd.prefill.url, "prefill"), (pd.decode.url, "decode")):
        text = requests.get(f"{url}/metrics", timeout=30).text
        for gauge in ("sgl_pd_rooms", "sgl_pd_writes_in_flight"):  # live state, per side
            assert re.search(rf'^{gauge}\{{role="{role}"\}} [0-9.e+]+$', text, re.M), gauge


def test_per_request_histograms_count_each_request_once_on_its_side(pd: PdCluster) -> None:
    """N requests through the router: every per-request histogram of the side it belongs
    to counts N more (TP1 servers: one rank each), and nothing counts as failed."""
    from .metrics_reading import sample

    per_side = {
        pd.prefill.url: [("sgl_pd_exposed_transfer_seconds_count", "prefill"),
                         ("sgl_pd_bootstrap_wait_seconds_count", "prefill"),
                         ("sgl_pd_request_kv_bytes_count", "prefill")],
        pd.decode.url: [("sgl_pd_decode_kv_wait_seconds_count", "decode"),
                        ("sgl_pd_bootstrap_wait_seconds_count", "decode")],
    }  # fmt: skip

    def counts() -> dict[tuple[str, str], float]:
        return {(url, name): sample(url, name, role=role)
                for url, series in per_side.items() for name, role in series}  # fmt: skip

    def failures() -> float:
        return sum(
            sample(url, "sgl_pd_transfer_failures_total", role=role, cause=cause)
            for url, role in ((pd.prefill.url, "prefill"), (pd.decode.url, "decode"))
            for cause in ("abort", "timeout", "peer_lost", "refused", "write_failure")
        )

    n = 8
    before, failed_before = counts(), failures()
    for prompt in PROMPTS[:n]:
        generate_ids(pd.router_url, prompt, 2)
    time.sleep(1.0)  # SGLang's metrics of a scheduler process reach /metrics through files
    after = counts()
    assert {k: after[k] - before[k] for k in before} == dict.fromkeys(before, n)
    assert failures() == failed_before


def test_a_real_prometheus_scrapes_the_pair_and_every_expression_returns_data(
    pd: PdCluster, tmp_path: Path
) -> None:
    """Debian's Prometheus scrapes both servers (each target labelled with its role as
    the Kubernetes scrape job labels pods) while requests run; every expression of the
    dashboard and every alert's quantity then returns data."""
    import importlib.util
    import shutil
    import subprocess
    import threading

    import yaml

    from sgl_pd.cluster.processes import free_port

    # the expressions as tests/k8s/test_monitoring.py reads them from the shipped files
    path = Path(__file__).resolve().parents[1] / "k8s/test_monitoring.py"
    spec = importlib.util.spec_from_file_location("sgl_pd_monitoring_exprs", path)
    assert spec is not None and spec.loader is not None
    monitoring = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(monitoring)
    RULES, alert_exprs, dashboard_exprs = (
        monitoring.RULES, monitoring.alert_exprs, monitoring.dashboard_exprs)  # fmt: skip

    if shutil.which("prometheus") is None:
        pytest.skip("prometheus is not installed: launch/install.sh installs it")
    port = free_port()
    targets = [(pd.prefill.url, "prefill"), (pd.decode.url, "decode")]
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{
            "job_name": "sgl-pd",
            "static_configs": [{"targets": [url.split("//", 1)[1]], "labels": {"component": role}}
                               for url, role in targets],
        }],
    }  # fmt: skip
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    prometheus = subprocess.Popen(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    stop = threading.Event()

    def load() -> None:  # streamed, several tokens each: SGLang observes ITL per chunk
        i = 0
        while not stop.is_set():
            with requests.post(
                f"{pd.router_url}/generate",
                json={
                    "text": PROMPTS[i % len(PROMPTS)],
                    "sampling_params": {"max_new_tokens": 6, "temperature": 0},
                    "stream": True,
                },
                stream=True,
                timeout=120,
            ) as response:
                for _ in response.iter_lines():
                    pass
            i += 1

    sender = threading.Thread(target=load, daemon=True)
    sender.start()
    api = f"http://127.0.0.1:{port}/api/v1/query"
    try:
        time.sleep(20)  # enough scrapes for rate() over a window holding many requests
        empty = []
        for expr in dashboard_exprs() + list(alert_exprs().values()):
            result = requests.get(api, params={"query": expr}, timeout=30).json()
            assert result["status"] == "success", (expr, result)
            if not result["data"]["result"]:
                empty.append(expr)
        assert empty == [], "expressions without data:\n" + "\n".join(empty)
        up = requests.get(api, params={"query": "up"}, timeout=30).json()["data"]["result"]
        assert sorted(r["metric"]["component"] for r in up if r["value"][1] == "1") == [
            "decode", "prefill"]  # fmt: skip
    finally:
        stop.set()
        sender.join(60)
        prometheus.terminate()
        prometheus.wait(30)


# -- the decoder's prefix cache (--disaggregation-decode-enable-radix-cache) -------------


def test_multi_turn_conversations_move_only_what_the_decoder_lacks(
    mono: Server, pd: PdCluster
) -> None:
    """Each turn = the previous prompt + its answer + a new message: the decoder holds
    all but the new message (the answer's KV only it computed), so only that crosses
    the wire, and every turn has monolithic's tokens."""
    from .metrics_reading import sample

    openers = [prompt_ids(p) for p in varied_prompts(4, seed=41)]
    conversations = script(mono.url, openers, turns=3, max_new_tokens=8)
    lines_before = len(timing_lines(pd.prefill.process.log_path))
    held_before = sample(pd.decode.url, "sgl_pd_decode_prefix_tokens_total", role="decode")
    verdicts = replay(pd.router_url, conversations)
    assert not wrong_turns(verdicts), verdicts
    lines = timing_lines(pd.prefill.process.log_path)[lines_before:]
    assert len(lines) == 4 * 3
    later = [line for line in lines if line["held"] > 0]
    # every later turn holds at least its previous prompt (the first turns may share one
    # conversation opener's start with another's)
    assert len(later) >= 4 * 2, [(line["tokens"], line["held"]) for line in lines]
    held = sum(int(line["held"]) for line in lines)
    moved = sum(int(line["tokens"]) - int(line["held"]) for line in lines)
    assert held > moved  # later turns are mostly held prefix
    time.sleep(1.0)  # SGLang's metrics of a scheduler process reach /metrics through files
    counted = sample(pd.decode.url, "sgl_pd_decode_prefix_tokens_total", role="decode")
    assert counted - held_before == held


def test_the_same_prompt_twice_moves_only_the_metadata(mono: Server, pd: PdCluster) -> None:
    """A full hit: the decoder holds every token the prefiller computes (all but the
    last, which its first decode step computes), so no KV moves, only the metadata row."""
    ids = long_prompt_ids(300, start=900)
    want = generate_ids(mono.url, ids, 6)
    assert generate_ids(pd.router_url, ids, 6) == want
    first = timing_lines(pd.prefill.process.log_path)[-1]
    assert generate_ids(pd.router_url, ids, 6) == want
    again = timing_lines(pd.prefill.process.log_path)[-1]
    assert again["room"] != first["room"]
    assert again["held"] == again["tokens"] == len(ids) - 1 and again["chunks"] == 0
    assert 0 < again["bytes"] < first["bytes"] / 10  # the metadata row alone


def test_a_prompt_inside_a_cached_one_holds_all_but_its_last_token(
    mono: Server, pd: PdCluster
) -> None:
    """The decoder's cache holds more than the prompt (an earlier, longer prompt began
    with it): it holds the prompt's tokens up to the one its first step computes."""
    longer = long_prompt_ids(200, start=4200)
    generate_ids(pd.router_url, longer, 2)
    for n in (2, 3, 64, 199, 200):
        ids = longer[:n]
        assert generate_ids(pd.router_url, ids, 6) == generate_ids(mono.url, ids, 6), n
        line = timing_lines(pd.prefill.process.log_path)[-1]
        assert line["held"] == line["tokens"] == n - 1, (n, line)


def test_128_clients_for_30_seconds_are_all_answered_and_every_table_empties(
    pd: PdCluster, patience: Patience
) -> None:
    """The load path, bounded (the sweep and the soak are `bench_load`'s): 128 clients
    through the router for 30 s, 5% of them leaving after their first token; every
    request is answered or cancelled, and sgl_pd's tables and SGLang's request gauges of
    both servers return to 0 (deliveries, remembered a while to tell copies from new
    messages, only within their bound)."""
    vocab = json.loads((TINY_LLAMA_PATH / "config.json").read_text())["vocab_size"]
    traffic = Traffic(
        pd.router_url, 128, vocab, prompt_tokens=48, output_tokens=16,
        timeout_s=patience.seconds(600),
    )  # fmt: skip
    traffic.start()
    time.sleep(30.0)
    traffic.stop(patience.seconds(900))
    ended = collections.Counter(o.ended for o in traffic.outcomes)
    assert set(ended) <= {"ok", "cancelled"}, ended
    assert ended["ok"] >= 128, ended
    deadline = time.monotonic() + patience.seconds(120)
    while True:
        held = {
            name: {k: v for k, v in gauges(server.url).items() if v and k != REMEMBERED}
            for name, server in (("prefill", pd.prefill), ("decode", pd.decode))
        }
        if not any(held.values()) or time.monotonic() > deadline:
            break
        time.sleep(2.0)
    assert not any(held.values()), f"still held once traffic stopped: {held}"
    for server in (pd.prefill, pd.decode):
        assert gauges(server.url).get(REMEMBERED, 0) <= MAX_REMEMBERED


def test_every_page_is_free_again(pd: PdCluster) -> None:
    """Runs last in this module: after all its requests, both pools report 0 used tokens."""
    pair = {"prefill": pd.prefill, "decode": pd.decode}
    states = wait_pools_idle(pair, 60)
    assert pools_idle(pair, states), f"pools still hold pages after the requests: {states}"


def test_no_server_warned_about_anything_its_settings_cause(pd: PdCluster, mono: Server) -> None:
    """Runs last: after every request of this module, the servers' processes logged no
    warning (sgl_pd's or SGLang's, gathered with their level by SGLPD_WARNINGS_LOG) but
    those SGLang logs on any healthy server (`cluster.logs.EXPECTED_WARNINGS`)."""
    for server in (pd.prefill, pd.decode, mono):
        assert unexpected_warnings(server) == [], server.process.name
