"""Search-R1's retrieval API over the BM25 index, and the retrievers the environment searches with.

Service (``python -m agentgym.envs.deepsearch.retriever --host 0.0.0.0 --port 8001``):

* ``POST /retrieve`` ``{"queries": ["..."], "topk": 3, "return_scores": true}`` ->
  ``{"result": [[{"document": {"id": "17", "contents": "\\"Title\\"\\ntext"}, "score": 12.5}, ...], ...]}``
  (one list per query, best first; without ``return_scores`` each item is the bare document, as in
  Search-R1). ``topk`` defaults to the service's (3). A query sharing no term with the corpus gets
  an empty list. Bad input (no queries, a blank or over-long query, too many queries, ``topk``
  outside 1..max) is answered 422 with a ``detail`` message.
* ``GET /healthz`` -> ``{"status": "ok", "passages": N, ...}``.

Retrievers (`Retriever`): `LocalRetriever` searches the in-process index; `HttpRetriever` posts to
any Search-R1-compatible ``/retrieve`` (this service, or the full wiki-18 e5 server) with a
timeout, and turns every failure (unreachable, timeout, HTTP error, malformed reply) into a
`RetrievalError` with a readable message.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import httpx
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

from agentgym.envs.deepsearch.corpus import CorpusError, Passage
from agentgym.envs.deepsearch.index import BM25Index, Hit, shared_index

log = logging.getLogger(__name__)

DEFAULT_TOPK = 3
MAX_TOPK = 100
MAX_QUERIES = 1024
MAX_QUERY_CHARS = 4096
DEFAULT_PORT = 8001


class RetrievalError(RuntimeError):
    """Searching failed (the external retriever is down, slow, or answered something unusable)."""


class Retriever(Protocol):
    def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]: ...


class LocalRetriever:
    """The in-process BM25 index (default: the shipped corpus, shared by the whole process)."""

    def __init__(self, index: BM25Index | None = None) -> None:
        self.index = index if index is not None else shared_index()

    def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        return self.index.search(queries, topk)

    def __repr__(self) -> str:
        return f"LocalRetriever({len(self.index)} passages)"


def retrieve_url(url: str) -> str:
    """The ``/retrieve`` endpoint of a base URL (``http://host:8001``) or of a full endpoint URL."""
    cleaned = url.strip().rstrip("/")
    parsed = httpx.URL(cleaned)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"search URL must be http(s)://host[:port][/retrieve], not {url!r}")
    return cleaned if cleaned.endswith("/retrieve") else f"{cleaned}/retrieve"


class HttpRetriever:
    """A Search-R1-compatible ``/retrieve`` server. Thread-safe; one connection pool per instance."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, not {timeout_s}")
        self.url = retrieve_url(url)
        self.timeout_s = timeout_s
        self._client = httpx.Client(timeout=httpx.Timeout(timeout_s), follow_redirects=False)

    def __repr__(self) -> str:
        return f"HttpRetriever({self.url!r})"

    def close(self) -> None:
        self._client.close()

    def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        batch = list(queries)
        body = {"queries": batch, "topk": topk, "return_scores": True}
        try:
            response = self._client.post(self.url, json=body)
        except httpx.TimeoutException as error:
            raise RetrievalError(f"search service {self.url} did not answer within {self.timeout_s:g}s") from error
        except httpx.HTTPError as error:
            reason = f"{type(error).__name__}: {error}"
            raise RetrievalError(f"search service {self.url} is unreachable: {reason}") from error
        if response.status_code != 200:
            raise RetrievalError(
                f"search service {self.url} answered HTTP {response.status_code}: {response.text[:300].strip()}"
            )
        try:
            return parse_retrieve_response(response.json(), len(batch))
        except (ValueError, TypeError, KeyError) as error:
            raise RetrievalError(f"search service {self.url} sent an unusable reply: {error}") from error


def parse_retrieve_response(payload: Any, expected: int) -> list[list[Hit]]:
    """Search-R1's ``{"result": [[{"document": {...}, "score": s} | {...document...}]]}`` -> hits."""
    if not isinstance(payload, dict) or not isinstance(payload.get("result"), list):
        raise ValueError("expected an object with a 'result' list")
    result = payload["result"]
    if len(result) != expected:
        raise ValueError(f"{len(result)} result lists for {expected} queries")
    parsed: list[list[Hit]] = []
    for row in result:
        if not isinstance(row, list):
            raise ValueError("each result must be a list of documents")
        hits: list[Hit] = []
        for item in row:
            if not isinstance(item, dict):
                raise ValueError("each document must be an object")
            document = item.get("document", item)
            score = item.get("score", 0.0) if "document" in item else 0.0
            contents = document.get("contents") if isinstance(document, dict) else None
            if not isinstance(contents, str):
                raise ValueError("a document has no 'contents' text")
            hits.append(Hit(Passage.from_contents(str(document.get("id", "")), contents), float(score)))
        parsed.append(hits)
    return parsed


_HTTP: dict[tuple[str, float], HttpRetriever] = {}
_HTTP_LOCK = threading.Lock()


def shared_http_retriever(url: str, timeout_s: float = 10.0) -> HttpRetriever:
    """One `HttpRetriever` (connection pool) per URL and timeout, shared by every episode."""
    key = (retrieve_url(url), timeout_s)
    with _HTTP_LOCK:
        retriever = _HTTP.get(key)
        if retriever is None:
            retriever = _HTTP[key] = HttpRetriever(url, timeout_s)
        return retriever


# -- the service ------------------------------------------------------------------------------------


class RetrieveIn(BaseModel):
    queries: list[str] = Field(description="Search queries (answered in order)")
    topk: int | None = Field(default=None, description="Passages per query (default: the service's)")
    return_scores: bool = Field(default=False, description="Wrap each document as {document, score}")


def create_retrieval_app(
    index: BM25Index | None = None,
    *,
    default_topk: int = DEFAULT_TOPK,
    max_topk: int = MAX_TOPK,
    max_queries: int = MAX_QUERIES,
) -> FastAPI:
    """Search-R1's retrieval API over `index` (default: the shared index of the shipped corpus)."""
    if not 1 <= default_topk <= max_topk:
        raise ValueError(f"default_topk must be in 1..{max_topk}, not {default_topk}")
    searcher = index if index is not None else shared_index()
    app = FastAPI(
        title="AgentGym Deep Search retriever",
        version="v1",
        description="Search-R1-compatible BM25 retrieval over a Wikipedia corpus in wiki-18 format.",
    )
    app.state.index = searcher

    @app.post("/retrieve")
    def retrieve(body: RetrieveIn) -> dict[str, Any]:
        """Top-k passages of each query."""
        topk = default_topk if body.topk is None else body.topk
        if not body.queries:
            raise HTTPException(422, "queries must be a non-empty list of query strings")
        if len(body.queries) > max_queries:
            raise HTTPException(422, f"at most {max_queries} queries per request, got {len(body.queries)}")
        for position, query in enumerate(body.queries):
            if not query.strip():
                raise HTTPException(422, f"queries[{position}] is empty")
            if len(query) > MAX_QUERY_CHARS:
                raise HTTPException(422, f"queries[{position}] is longer than {MAX_QUERY_CHARS} characters")
        if not 1 <= topk <= max_topk:
            raise HTTPException(422, f"topk must be between 1 and {max_topk}, got {topk}")
        results = searcher.search(body.queries, topk)
        if body.return_scores:
            return {
                "result": [
                    [{"document": _document(hit.passage), "score": hit.score} for hit in hits] for hits in results
                ]
            }
        return {"result": [[_document(hit.passage) for hit in hits] for hits in results]}

    @app.get("/healthz")
    def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "passages": len(searcher),
            "index": "bm25",
            "default_topk": default_topk,
            "max_topk": max_topk,
        }

    return app


def _document(passage: Passage) -> dict[str, str]:
    return {"id": passage.id, "contents": passage.contents}


def serve(
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    *,
    corpus_path: Path | str | None = None,
    cache_dir: Path | str | None = None,
    default_topk: int = DEFAULT_TOPK,
    log_level: str = "info",
) -> None:
    """Load (or build) the index, then serve the retrieval API until interrupted."""
    import uvicorn

    started = time.perf_counter()
    index = shared_index(corpus_path, cache_dir)
    log.warning(
        "retriever: %d passages (%s in %.2fs); serving on http://%s:%d",
        len(index),
        "index loaded" if index.from_cache else "index built",
        time.perf_counter() - started,
        host,
        port,
    )
    app = create_retrieval_app(index, default_topk=default_topk)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=False)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m agentgym.envs.deepsearch.retriever",
        description="Search-R1-compatible BM25 retrieval service over the shipped Wikipedia corpus.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--corpus", default=None, help="ovos summaries JSON or wiki-18 JSONL (default: shipped)")
    parser.add_argument("--cache-dir", default=None, help="index cache (default: $AGENTGYM_CACHE_DIR/deepsearch)")
    parser.add_argument("--topk", type=int, default=DEFAULT_TOPK, help="passages per query when a request names none")
    parser.add_argument("--build-only", action="store_true", help="build (or check) the cached index and exit")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.build_only:
        started = time.perf_counter()
        try:
            index = BM25Index.load_or_build(args.corpus, args.cache_dir)
        except CorpusError as error:
            raise SystemExit(f"error: {error}") from None
        where = index.cache_path or "memory only: the cache is not writable"
        action = "loaded" if index.from_cache else "built"
        print(f"{len(index)} passages; index {action} in {time.perf_counter() - started:.2f}s ({where})")
        return
    serve(
        args.host,
        args.port,
        corpus_path=args.corpus,
        cache_dir=args.cache_dir,
        default_topk=args.topk,
        log_level=args.log_level.lower(),
    )


if __name__ == "__main__":
    main()
