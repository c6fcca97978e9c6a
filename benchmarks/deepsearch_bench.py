"""Deep Search retrieval benchmark: index build, /retrieve latency over HTTP, recall@3.

Prints:
  1. index build time from scratch (read corpus, cut passages, tokenize, index, write the cache)
     and the cached load time (target: build <= 30 s);
  2. per-query latency of the retrieval service (`python -m agentgym.envs.deepsearch.retriever`,
     a separate process on loopback) with batched requests against the unbatched baseline (one
     query per request) measured in the same run; p50/p95 per query, and in-process search time
     for reference (target: batched p50 <= 5 ms per query);
  3. recall@3 of the answer string on the shipped single-hop set (split ``sub``): the share of
     questions whose normalised gold answer occurs in one of the top 3 passages retrieved for the
     question itself, over HTTP (target: >= 0.7); ``sub-all`` is shown for contrast.
Exits 1 when a target is missed.

Usage: python benchmarks/deepsearch_bench.py [--queries 512] [--batch 32] [--topk 3]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import httpx

from agentgym.envs.deepsearch.index import BM25Index
from agentgym.envs.deepsearch.scoring import contains_answer
from agentgym.envs.deepsearch.tasks import load_catalog
from agentgym.messaging import free_port

TARGET_P50_MS = 5.0
TARGET_BUILD_S = 30.0
TARGET_RECALL = 0.7


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@contextmanager
def retrieval_service(cache_dir: str) -> Iterator[str]:
    port = free_port()
    cmd = [sys.executable, "-m", "agentgym.envs.deepsearch.retriever", "--port", str(port)]
    cmd += ["--cache-dir", cache_dir, "--log-level", "warning"]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        with httpx.Client(timeout=2) as client:
            while True:
                if process.poll() is not None:
                    err = process.stderr.read().decode() if process.stderr else ""
                    raise SystemExit(f"the retrieval service exited: {err[-2000:]}")
                try:
                    if client.get(f"{url}/healthz").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("the retrieval service did not become healthy in 120 s")
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def timed_requests(client: httpx.Client, url: str, batches: list[list[str]], topk: int) -> list[float]:
    """Seconds per query of each request (request latency / queries in it)."""
    per_query: list[float] = []
    for batch in batches:
        started = time.perf_counter()
        response = client.post(f"{url}/retrieve", json={"queries": batch, "topk": topk, "return_scores": True})
        elapsed = time.perf_counter() - started
        response.raise_for_status()
        per_query.append(elapsed / len(batch))
    return per_query


def recall_at(client: httpx.Client, url: str, split: str, k: int) -> tuple[float, int]:
    catalog = load_catalog()
    tasks = [catalog.task(task_id) for task_id in catalog.task_ids(split)]
    found = 0
    for start in range(0, len(tasks), 64):
        chunk = tasks[start : start + 64]
        body = {"queries": [task.question for task in chunk], "topk": k, "return_scores": True}
        result = client.post(f"{url}/retrieve", json=body).json()["result"]
        for task, hits in zip(chunk, result, strict=True):
            text = " ".join(hit["document"]["contents"] for hit in hits)
            found += any(contains_answer(text, answer) for answer in task.answers)
    return found / len(tasks), len(tasks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queries", type=int, default=512, help="queries per latency measurement")
    parser.add_argument("--batch", type=int, default=32, help="queries per batched request")
    parser.add_argument("--topk", type=int, default=3)
    args = parser.parse_args()
    if args.queries < args.batch or args.queries % args.batch:
        parser.error("--queries must be a positive multiple of --batch")
    failures: list[str] = []

    with tempfile.TemporaryDirectory(prefix="deepsearch-bench-") as cache_dir:
        print("== index build (shipped corpus) ==")
        started = time.perf_counter()
        built = BM25Index.load_or_build(cache_dir=cache_dir)
        build_s = time.perf_counter() - started
        assert not built.from_cache
        started = time.perf_counter()
        loaded = BM25Index.load_or_build(cache_dir=cache_dir)
        load_s = time.perf_counter() - started
        assert loaded.from_cache
        print(f"passages            {len(built):>8}")
        print(f"build from scratch  {build_s:>8.2f} s   (tokenize + index only: {built.build_seconds:.2f} s)")
        print(f"load from cache     {load_s:>8.2f} s")
        if build_s > TARGET_BUILD_S:
            failures.append(f"build {build_s:.1f} s > {TARGET_BUILD_S} s")

        catalog = load_catalog()
        questions = [catalog.task(t).question for s in ("sub-all", "multi-all") for t in catalog.task_ids(s)]
        queries = list(itertools.islice(itertools.cycle(questions), args.queries))

        in_process = []
        for query in queries:
            t0 = time.perf_counter()
            loaded.search([query], args.topk)
            in_process.append(time.perf_counter() - t0)

        with retrieval_service(cache_dir) as url, httpx.Client(timeout=30) as client:
            warm = [[q] for q in queries[:32]]
            timed_requests(client, url, warm, args.topk)
            single = timed_requests(client, url, [[q] for q in queries], args.topk)
            batches = [queries[i : i + args.batch] for i in range(0, len(queries), args.batch)]
            batched = timed_requests(client, url, batches, args.topk)
            print(f"\n== /retrieve latency per query, top-{args.topk}, {len(queries)} queries, 1 HTTP client ==")
            print(f"{'mode':<28}{'p50 ms':>10}{'p95 ms':>10}{'queries/s':>12}")
            rows = [
                ("in-process (no HTTP)", in_process),
                ("HTTP unbatched (baseline)", single),
                (f"HTTP batched x{args.batch}", batched),
            ]
            for name, values in rows:
                total = sum(values) * (args.batch if values is batched else 1)
                rate = len(queries) / total if total else float("inf")  # batches are full: --queries % --batch == 0
                ms50, ms95 = percentile(values, 0.5) * 1e3, percentile(values, 0.95) * 1e3
                print(f"{name:<28}{ms50:>10.3f}{ms95:>10.3f}{rate:>12.0f}")
            p50_batched = percentile(batched, 0.5) * 1e3
            speedup = statistics.median(single) / statistics.median(batched)
            print(f"batched vs unbatched: {speedup:.1f}x faster per query (p50)")
            if p50_batched > TARGET_P50_MS:
                failures.append(f"batched p50 {p50_batched:.2f} ms > {TARGET_P50_MS} ms")

            print("\n== recall@3 of the answer string (question as the query, over HTTP) ==")
            recall, count = recall_at(client, url, "sub", 3)
            print(f"sub      (shipped single-hop, {count:>3} questions)  {recall:.3f}")
            recall_all, count_all = recall_at(client, url, "sub-all", 3)
            print(f"sub-all  (answer may be outside the leads, {count_all} questions)  {recall_all:.3f}")
            if recall < TARGET_RECALL:
                failures.append(f"recall@3 {recall:.3f} < {TARGET_RECALL}")

    targets = f"batched p50 <= {TARGET_P50_MS} ms, build <= {TARGET_BUILD_S} s, recall@3 >= {TARGET_RECALL}"
    print(f"\ncpus: {os.cpu_count()}; targets: {targets}")
    if failures:
        print("MISSED: " + "; ".join(failures))
        sys.exit(1)
    print("all targets met")


if __name__ == "__main__":
    main()
