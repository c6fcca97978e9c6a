"""Search-R1's /retrieve API: response shape, input validation, and the HTTP client's failure modes."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from deepsearch_helpers import TINY_CORPUS, closed_port_url, serve_app, stub_retriever_app, write_jsonl

from agentgym.envs.deepsearch.index import BM25Index, shared_index
from agentgym.envs.deepsearch.retriever import (
    HttpRetriever,
    LocalRetriever,
    RetrievalError,
    create_retrieval_app,
    main,
    parse_retrieve_response,
    retrieve_url,
)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    app = create_retrieval_app(shared_index())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://retriever") as c:
        yield c


async def test_retrieve_with_scores_is_search_r1_shaped(client: httpx.AsyncClient) -> None:
    response = await client.post(
        "/retrieve",
        json={"queries": ["Beatles rock band Liverpool", "capital of Russia"], "topk": 3, "return_scores": True},
    )
    assert response.status_code == 200
    result = response.json()["result"]
    assert len(result) == 2 and all(len(row) == 3 for row in result)
    first = result[0][0]
    assert set(first) == {"document", "score"} and set(first["document"]) == {"id", "contents"}
    assert first["document"]["contents"].startswith('"The Beatles"\n')
    scores = [item["score"] for item in result[1]]
    assert scores == sorted(scores, reverse=True) and scores[-1] > 0
    # the same passages as the in-process index, in the same order
    local = shared_index().search(["capital of Russia"], 3)[0]
    assert [item["document"]["id"] for item in result[1]] == [hit.passage.id for hit in local]


async def test_retrieve_without_scores_returns_bare_documents_and_default_topk(client: httpx.AsyncClient) -> None:
    response = await client.post("/retrieve", json={"queries": ["Mount Everest"]})
    assert response.status_code == 200
    row = response.json()["result"][0]
    assert len(row) == 3 and set(row[0]) == {"id", "contents"}


async def test_query_without_known_terms_gets_an_empty_list(client: httpx.AsyncClient) -> None:
    response = await client.post("/retrieve", json={"queries": ["zzxxqq", "Mount Everest"], "topk": 1})
    assert response.status_code == 200
    assert [len(row) for row in response.json()["result"]] == [0, 1]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"queries": []}, "non-empty list"),
        ({"queries": ["ok", "  "]}, "queries[1] is empty"),
        ({"queries": ["x" * 5000]}, "longer than"),
        ({"queries": ["q"] * 1025}, "at most 1024 queries"),
        ({"queries": ["q"], "topk": 0}, "topk must be between 1 and 100"),
        ({"queries": ["q"], "topk": 101}, "topk must be between 1 and 100"),
    ],
)
async def test_bad_requests_are_422_with_a_message(
    client: httpx.AsyncClient, body: dict[str, Any], message: str
) -> None:
    response = await client.post("/retrieve", json=body)
    assert response.status_code == 422
    assert message in response.json()["detail"]


@pytest.mark.parametrize("body", [{}, {"queries": "not a list"}, {"queries": [1, 2]}, {"queries": ["q"], "topk": "x"}])
async def test_malformed_bodies_are_422(client: httpx.AsyncClient, body: dict[str, Any]) -> None:
    assert (await client.post("/retrieve", json=body)).status_code == 422


async def test_healthz(client: httpx.AsyncClient) -> None:
    body = (await client.get("/healthz")).json()
    assert body["status"] == "ok" and body["passages"] == 12_324 and body["default_topk"] == 3


def test_app_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        create_retrieval_app(shared_index(), default_topk=0)


def test_http_retriever_against_a_real_server_matches_in_process(tmp_path: Path) -> None:
    index = BM25Index.load_or_build(write_jsonl(tmp_path / "tiny.jsonl", TINY_CORPUS), tmp_path / "cache")
    with serve_app(create_retrieval_app(index)) as url:
        remote = HttpRetriever(url, timeout_s=5)
        try:
            queries = ["highest peak of Veloria", "nothing matches zzz", "Silverrun"]
            got = remote.search(queries, 2)
            assert got == LocalRetriever(index).search(queries, 2)
            assert got[0][0].passage.title == "Mount Kest" and got[1] == []
            # full endpoint URLs work too
            assert HttpRetriever(f"{url}/retrieve/").search(["Aurelia"], 1)[0][0].passage.id == "0"
        finally:
            remote.close()


def test_unreachable_server_is_a_retrieval_error() -> None:
    with pytest.raises(RetrievalError, match="unreachable"):
        HttpRetriever(closed_port_url(), timeout_s=2).search(["q"], 3)


def test_slow_server_times_out() -> None:
    with (
        serve_app(stub_retriever_app("slow", delay_s=1.0)) as url,
        pytest.raises(RetrievalError, match=r"did not answer within 0\.2s"),
    ):
        HttpRetriever(url, timeout_s=0.2).search(["q"], 3)


@pytest.mark.parametrize(("behaviour", "message"), [("error", "HTTP 500: index offline"), ("garbage", "unusable")])
def test_bad_server_replies_are_retrieval_errors(behaviour: str, message: str) -> None:
    with serve_app(stub_retriever_app(behaviour)) as url, pytest.raises(RetrievalError, match=message):
        HttpRetriever(url, timeout_s=5).search(["q"], 3)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"result": [[]]}, "2 queries"),
        ({"result": [[], "x"]}, "list of documents"),
        ({"result": [[], [{"document": {"id": 1}}]]}, "contents"),
        ({"result": [[], [{"document": {"contents": "x"}, "score": "high"}]]}, "float"),
        ([], "'result' list"),
    ],
)
def test_parse_rejects_malformed_payloads(payload: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_retrieve_response(payload, 2)


def test_parse_accepts_bare_documents() -> None:
    hits = parse_retrieve_response({"result": [[{"id": "9", "contents": '"T"\nbody'}]]}, 1)
    assert hits[0][0].passage.title == "T" and hits[0][0].passage.text == "body" and hits[0][0].score == 0.0


@pytest.mark.parametrize("url", ["ftp://host/retrieve", "not a url", "http://", ""])
def test_bad_search_urls_are_rejected(url: str) -> None:
    with pytest.raises(ValueError, match="search URL"):
        retrieve_url(url)
    assert retrieve_url("http://h:1/") == "http://h:1/retrieve"


def test_build_only_entry_point(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = write_jsonl(tmp_path / "tiny.jsonl", TINY_CORPUS)
    main(["--build-only", "--corpus", str(corpus), "--cache-dir", str(tmp_path / "cache")])
    assert "4 passages; index built" in capsys.readouterr().out
    main(["--build-only", "--corpus", str(corpus), "--cache-dir", str(tmp_path / "cache")])
    assert "4 passages; index loaded" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="cannot read corpus"):
        main(["--build-only", "--corpus", str(tmp_path / "missing.jsonl")])


def test_module_entry_point_serves_over_http(tmp_path: Path) -> None:
    corpus = write_jsonl(tmp_path / "tiny.jsonl", TINY_CORPUS)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "agentgym.envs.deepsearch.retriever", "--port", str(port)]
    command += ["--corpus", str(corpus), "--cache-dir", str(tmp_path / "cache"), "--topk", "2"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
            try:
                if httpx.get(f"{url}/healthz", timeout=1).json()["passages"] == 4:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the retriever did not come up"
            time.sleep(0.1)
        result = httpx.post(f"{url}/retrieve", json={"queries": ["Veloria island"]}, timeout=5).json()["result"]
        assert len(result[0]) == 2 and result[0][0]["contents"].startswith('"Veloria"\n')
    finally:
        process.terminate()
        process.wait(timeout=10)
