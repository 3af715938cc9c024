"""Sharded servers end to end: the tiny Llama (2 KV heads) through SGLang's router with
prefill and decode at TP 1 and 2, each pairing token for token against a monolithic TP1
server, and every scheduler process's pool back to idle afterwards.

One mesh per page size holds a TP2 and a TP1 server on each side, with one router per
pairing: TP2 -> TP2 (D12, rank i to rank i), TP2 -> TP1 (D13, the decoder rebuilds full
pages from the halves both prefill ranks send) and TP1 -> TP2 (each decode rank gets its
head from the one source). The send modes alternate between the meshes, so every pairing
runs layer-wise at one page size and after the forward at the other. The TP1 decoder of
the page-1 mesh also takes requests itself (direct mode, D3) and sends their prefills to
the TP2 prefill server. The page-16 mesh's TP2 prefill server writes slowly on purpose;
the module ends by SIGKILLing it mid-transfer and restarting it.

Mismatched pairings re-lay heads out (`core.relayout`): the TP1 prefill server gathers
each decode rank's head into staging blocks, the TP1 decoder receives both halves in
staging and scatters them. At 16 tokens a page that shows in the write counts.

Both decoders keep a prefix cache (--disaggregation-decode-enable-radix-cache): each
pairing asks prompts of its own (no prefix shared with another pairing's, so every one
is transferred whole the first time); in the page-16 mesh each pairing then serves
multi-turn conversations whose later turns move only the pages after the held prefix -
re-laid out where the pairing is mismatched.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from sgl_pd.cluster.campaign import (
    abort_at_decoder,
    first_success,
    kill_during_request,
    post_generate,
    restarter,
)
from sgl_pd.cluster.client import generate_ids
from sgl_pd.cluster.conversations import replay, script, wrong_turns
from sgl_pd.cluster.local import Patience, Server
from sgl_pd.cluster.logs import decode_failures, pools_idle, timing_lines, wait_pools_idle
from sgl_pd.cluster.mesh import MeshServer, PdMesh, pd_mesh
from sgl_pd.cluster.prompts import long_prompt_ids, varied_prompts

from .conftest import COMMON_ARGS, DECODE_PREFIX_CACHE

pytestmark = pytest.mark.e2e

# Seven or eight scheduler processes share two cores: heartbeats are answered late while
# they compute. 15 s still tells a killed server from a busy one within the test's time.
WRITE_DELAY_MS = 20  # per write batch of the slowed server: a long prompt streams for > 1 s
PROMPTS = [long_prompt_ids(2), *varied_prompts(15, seed=31)]  # 2 to ~450 tokens
NEW_TOKENS = 8
ROUTES = [("p_tp2", "d_tp2"), ("p_tp2", "d_tp1"), ("p_tp1", "d_tp2")]
MODES = {  # page size -> send mode of the TP2 and the TP1 prefill server
    1: {"p_tp2": "layerwise", "p_tp1": "after-forward"},
    16: {"p_tp2": "after-forward", "p_tp1": "layerwise"},
}


def _mesh_servers(page: int) -> list[MeshServer]:
    # every pairing verifies each request's KV by checksum (in model coordinates, across TP)
    common = (*COMMON_ARGS, "--page-size", str(page), "--pd-kv-checksum")
    slowed = ("--pd-inject-write-delay-ms", str(WRITE_DELAY_MS)) if page == 16 else ()
    return [
        MeshServer(
            "p_tp2",
            "prefill",
            (*common, "--tp", "2", "--pd-kv-send", MODES[page]["p_tp2"], *slowed),
        ),
        MeshServer(
            "p_tp1", "prefill", (*common, "--tp", "1", "--pd-kv-send", MODES[page]["p_tp1"])
        ),
        MeshServer("d_tp2", "decode", (*common, *DECODE_PREFIX_CACHE, "--tp", "2")),
        MeshServer(
            "d_tp1",
            "decode",
            (*common, *DECODE_PREFIX_CACHE, "--tp", "1"),
            direct_from=("p_tp2",) if page == 1 else (),
        ),
    ]


@pytest.fixture(scope="class")
def mesh(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, patience: Patience
) -> Iterator[PdMesh]:
    """The mesh of the test class's page size; one at a time (a mesh is about 13 GB of
    memory on this machine's CPU engine)."""
    page = request.cls.PAGE
    log_dir = tmp_path_factory.mktemp(f"mesh-{page}")
    with pd_mesh(log_dir, _mesh_servers(page), ROUTES, patience=patience) as mesh:
        yield mesh


@pytest.fixture(scope="module")
def reference(mono: Server) -> list[list[int]]:
    return _ask_all(mono.url)


def _route_prompts(route: tuple[str, str]) -> list[str | list[int]]:
    """The pairing's own prompts: a prefix cache of a decoder two pairings share holds
    nothing of the other pairing's."""
    mark = f"R{ROUTES.index(route)} "
    return [p if isinstance(p, list) else mark + p for p in PROMPTS]


@pytest.fixture(scope="module")
def route_references(mono: Server) -> dict[tuple[str, str], list[list[int]]]:
    return {route: _ask_all(mono.url, _route_prompts(route)) for route in ROUTES}


def _ask_all(url: str, prompts: list[str | list[int]] | None = None) -> list[list[int]]:
    asked = PROMPTS if prompts is None else prompts
    with ThreadPoolExecutor(8) as pool:  # batches mix lengths and chunked prefills
        return list(pool.map(lambda p: generate_ids(url, p, NEW_TOKENS), asked))


def _mismatches(
    want: list[list[int]], got: list[list[int]]
) -> list[tuple[int, list[int], list[int]]]:
    return [(i, w, g) for i, (w, g) in enumerate(zip(want, got, strict=True)) if w != g]


def _modes(server: Server) -> dict[str, int]:
    """Send mode -> requests one prefill server finished in it, counted once per rank."""
    modes: dict[str, int] = {}
    for line in timing_lines(server.process.log_path):
        modes[str(line["mode"])] = modes.get(str(line["mode"]), 0) + 1
    return modes


def _assert_pairing_serves(
    mesh: PdMesh, page: int, route: tuple[str, str], want: list[list[int]]
) -> None:
    prefill = mesh.servers[route[0]]
    before = sum(_modes(prefill).values())
    got = _ask_all(mesh.router(*route), _route_prompts(route))
    assert not _mismatches(want, got), _mismatches(want, got)
    # every request went through the pairing's prefill server, in its mode, on each rank
    mode = MODES[page][route[0]].replace("-", "_")
    ranks = 2 if route[0] == "p_tp2" else 1
    finished = _modes(prefill)
    assert set(finished) == {mode}, finished
    assert finished[mode] - before == ranks * len(PROMPTS)
    # writes per token of this pairing's requests, for the re-layout check
    lines = timing_lines(prefill.process.log_path)[before:]
    WRITES_PER_TOKEN[(page, route)] = sum(line["writes"] for line in lines) / sum(
        line["tokens"] - line["held"] for line in lines
    )


# (page size, route) -> writes per prompt token on the prefill ranks (see above)
WRITES_PER_TOKEN: dict[tuple[int, tuple[str, str]], float] = {}


def _assert_bulk_writes(page: int, route: tuple[str, str]) -> None:
    """Re-laid out, a mismatched pairing writes about as often as identical TP per link
    (a page run at a time), not once per token slot: 16 times as often at 16 tokens a
    page."""
    identical = WRITES_PER_TOKEN.get((page, ("p_tp2", "d_tp2")))
    if identical is None or route == ("p_tp2", "d_tp2"):
        return  # run alone: nothing to compare with
    # a TP1 prefill rank writes into both TP2 decode ranks: twice the links of a rank
    links_per_source = max(1, int(route[1][-1]) // int(route[0][-1]))
    assert WRITES_PER_TOKEN[(page, route)] <= 2 * links_per_source * identical, WRITES_PER_TOKEN


def _assert_conversations_serve(mesh: PdMesh, mono: Server, route: tuple[str, str]) -> None:
    """Multi-turn conversations through the pairing: every turn has monolithic's tokens,
    and the later turns' KV moves only past the decoder's held prefix."""
    mark = ROUTES.index(route)
    openers = [long_prompt_ids(40 + 60 * i, start=1000 * mark + 97 * i + 5) for i in range(2)]
    conversations = script(mono.url, openers, turns=3, max_new_tokens=6)
    prefill = mesh.servers[route[0]]
    before = len(timing_lines(prefill.process.log_path))
    verdicts = replay(mesh.router(*route), conversations, concurrency=2)
    assert not wrong_turns(verdicts), (route, verdicts)
    lines = timing_lines(prefill.process.log_path)[before:]
    assert sum(line["held"] > 0 for line in lines) >= 2 * 2, [
        (line["tokens"], line["held"]) for line in lines
    ]


def _assert_all_idle(mesh: PdMesh, patience: Patience) -> None:
    states = wait_pools_idle(mesh.servers, patience.seconds(90))
    assert pools_idle(mesh.servers, states), states


ROUTE_IDS = ["tp2-tp2", "tp2-tp1", "tp1-tp2"]


class TestPageOfOneToken:
    """TP2 prefill streams layer by layer, TP1 prefill sends after the forward."""

    PAGE = 1

    @pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
    def test_each_pairing_gives_monolithic_tokens(
        self,
        mesh: PdMesh,
        route_references: dict[tuple[str, str], list[list[int]]],
        route: tuple[str, str],
    ) -> None:
        _assert_pairing_serves(mesh, self.PAGE, route, route_references[route])

    def test_direct_mode_from_a_tp1_decoder_to_a_tp2_prefill_server(
        self, mesh: PdMesh, reference: list[list[int]]
    ) -> None:
        """Requests sent to the TP1 decoder itself: it submits each prefill to the TP2
        prefill server, whose two ranks write halves of every page into its pool."""
        before = sum(_modes(mesh.servers["p_tp2"]).values())
        got = _ask_all(mesh.servers["d_tp1"].url)
        assert not _mismatches(reference, got), _mismatches(reference, got)
        assert sum(_modes(mesh.servers["p_tp2"]).values()) - before == 2 * len(PROMPTS)

    def test_every_rank_of_every_server_is_idle(self, mesh: PdMesh, patience: Patience) -> None:
        _assert_all_idle(mesh, patience)


class TestPageOfSixteenTokens:
    """TP2 prefill (writes slowed) sends after the forward, TP1 prefill layer by layer."""

    PAGE = 16

    @pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
    def test_each_pairing_gives_monolithic_tokens(
        self,
        mesh: PdMesh,
        route_references: dict[tuple[str, str], list[list[int]]],
        route: tuple[str, str],
    ) -> None:
        _assert_pairing_serves(mesh, self.PAGE, route, route_references[route])
        _assert_bulk_writes(self.PAGE, route)

    @pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
    def test_each_pairing_serves_conversations_from_held_prefixes(
        self, mesh: PdMesh, mono: Server, route: tuple[str, str]
    ) -> None:
        _assert_conversations_serve(mesh, mono, route)

    def test_an_abort_mid_relayout_then_a_request_on_the_same_pages(
        self, mesh: PdMesh, mono: Server
    ) -> None:
        """A long prompt streaming from the slowed TP2 prefill server into the TP1
        decoder's receive staging is aborted there; the next long prompt takes the pages
        and the staging the aborted one held, and gets monolithic tokens (the idle check
        that follows finds no page and no staging byte held)."""
        url = mesh.router("p_tp2", "d_tp1")
        second = long_prompt_ids(1024, start=6000)
        want = generate_ids(mono.url, second, NEW_TOKENS)
        # the abort must land while the KV streams: a few tries, sooner each time. The
        # router retries what failed, so the decoder's log says whether it did
        decoder = mesh.servers["d_tp1"]
        aborted = False
        for attempt, wait_s in enumerate((1.0, 0.6, 0.3, 0.1)):
            rid = f"relayout-abort-{attempt}"
            first = long_prompt_ids(1536, start=3 + 1000 * attempt)
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(post_generate, url, first, rid, 4)
                time.sleep(wait_s)  # mid-prefill: chunks are written after each forward
                abort_at_decoder(decoder.url, rid)
                pending.result(timeout=120)
            failed = decode_failures([decoder.process.log_path])
            aborted = "aborted" in failed.get(rid, "")
            if aborted:
                break
        assert aborted, "every request completed before its abort arrived"
        assert generate_ids(url, second, NEW_TOKENS) == want

    def test_every_rank_of_every_server_is_idle(self, mesh: PdMesh, patience: Patience) -> None:
        _assert_all_idle(mesh, patience)

    def test_a_killed_tp2_prefill_server_fails_its_request_then_serves_again(
        self, mesh: PdMesh, reference: list[list[int]], mono: Server, patience: Patience
    ) -> None:
        """SIGKILL of the slowed TP2 prefill server (both ranks) while a long prompt
        streams to the TP1 decoder: the client gets an error, the decoder names the lost
        peer, the restarted server serves the pairing again, and every rank's pool is
        idle."""
        victim, decoder = mesh.servers["p_tp2"], mesh.servers["d_tp1"]
        url = mesh.router("p_tp2", "d_tp1")

        restart = restarter(
            victim.process, f"{victim.url}/health", url, patience.servers_ready_s(2),
            patience.seconds(180),
        )  # fmt: skip

        result = kill_during_request(
            url, victim.process, lambda n: long_prompt_ids(1024, start=41 + 2000 * n),
            "kill-tp2", restart,
        )  # fmt: skip
        if result.response is not None:  # the router may also just drop the connection
            response = result.response
            assert response.status_code != 200 or (
                response.json()["meta_info"]["finish_reason"]["type"] == "abort"
            ), response.text
        # the fast path: its connections were refused, not a wait for the hang timeout
        assert "connections are refused" in decoder.process.log_path.read_text(errors="replace")
        restart()
        prompt = "Count: 7 8 9"
        want = generate_ids(mono.url, prompt, NEW_TOKENS)
        assert first_success(url, prompt, NEW_TOKENS, budget_s=patience.seconds(180)) == want
        assert _ask_all(url) == reference
        _assert_all_idle(mesh, patience)
