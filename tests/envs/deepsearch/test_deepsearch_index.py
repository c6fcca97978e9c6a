"""The shipped corpus as wiki-18 passages, and the BM25 index: search, cache, rebuild on change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from deepsearch_helpers import TINY_CORPUS, write_jsonl

from agentgym.envs.deepsearch.corpus import (
    CorpusError,
    Passage,
    chunk_words,
    default_corpus_path,
    load_articles,
    load_passages,
)
from agentgym.envs.deepsearch.index import BM25Index, cache_key, default_cache_dir, shared_index, tokenize


def test_shipped_corpus_is_cut_into_wiki18_passages() -> None:
    path = default_corpus_path()
    assert path.name == "summaries_en-us.json"
    articles = load_articles(path)
    passages = load_passages(path)
    assert len(articles) == 10_033
    assert len(passages) == 12_324
    assert [p.id for p in passages[:3]] == ["0", "1", "2"]
    assert len({p.id for p in passages}) == len(passages)
    assert all(1 <= len(p.text.split()) <= 100 for p in passages)
    # every word of every lead is in exactly one passage, in order
    by_title: dict[str, list[str]] = {}
    for passage in passages:
        by_title.setdefault(passage.title, []).extend(passage.text.split())
    assert all(by_title[a.title] == a.text.split() for a in articles)
    russia = next(p for p in passages if p.title == "Russia")
    assert russia.contents.startswith('"Russia"\nRussia, or the Russian Federation, is a country')


def test_chunking_and_contents_round_trip() -> None:
    words = [f"w{i}" for i in range(250)]
    chunks = chunk_words(words, 100)
    assert [len(c.split()) for c in chunks] == [100, 100, 50]
    assert chunk_words([], 100) == []
    with pytest.raises(ValueError):
        chunk_words(words, 0)
    passage = Passage("7", 'Title "quoted"', "Some text.")
    assert passage.contents == '"Title "quoted""\nSome text.'
    assert Passage.from_contents("7", passage.contents) == passage


def test_corpus_errors(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="cannot read corpus"):
        load_passages(tmp_path / "missing.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(CorpusError, match="expected a JSON object"):
        load_passages(tmp_path / "list.json")
    (tmp_path / "bad.jsonl").write_text('{"id": "0"}\n')
    with pytest.raises(CorpusError, match=r"bad\.jsonl:1"):
        load_passages(tmp_path / "bad.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(CorpusError, match="no passages"):
        load_passages(tmp_path / "empty.jsonl")


def test_tokenize_folds_case_and_accents_and_drops_stopwords() -> None:
    assert tokenize("The Capital of BRASÍLIA, a city!") == ["capital", "brasilia", "city"]
    assert tokenize("a I ?") == []


def test_search_ranks_and_handles_queries_without_known_terms(tmp_path: Path) -> None:
    corpus = write_jsonl(tmp_path / "tiny.jsonl", TINY_CORPUS)
    index = BM25Index.load_or_build(corpus, tmp_path / "cache")
    assert len(index) == 4
    results = index.search(["highest peak of Veloria", "zzz qqq", "the", "Silverrun river"], topk=2)
    assert results[0][0].passage.title == "Mount Kest"
    assert len(results[0]) == 2 and results[0][0].score >= results[0][1].score > 0
    assert results[1] == [] and results[2] == []
    assert {hit.passage.title for hit in results[3]} == {"Silverrun", "Veloria"}
    # topk larger than the corpus: only passages that match at all
    assert {hit.passage.id for hit in index.search(["Aurelia"], topk=50)[0]} == {"0", "2"}
    with pytest.raises(ValueError):
        index.search(["x"], topk=0)


def test_index_is_cached_and_rebuilt_when_the_corpus_changes(tmp_path: Path) -> None:
    corpus = write_jsonl(tmp_path / "tiny.jsonl", TINY_CORPUS)
    cache = tmp_path / "cache"
    first = BM25Index.load_or_build(corpus, cache)
    assert not first.from_cache and first.cache_path is not None and first.cache_path.is_dir()
    again = BM25Index.load_or_build(corpus, cache)
    assert again.from_cache and again.key == first.key
    assert again.search(["Mount Kest"], 3)[0] == first.search(["Mount Kest"], 3)[0]

    write_jsonl(corpus, [*TINY_CORPUS, {"id": "4", "contents": '"Kestrel"\nA kestrel is a bird of Mount Kest.'}])
    changed = BM25Index.load_or_build(corpus, cache)
    assert not changed.from_cache and changed.key != first.key and len(changed) == 5
    assert "Kestrel" in {hit.passage.title for hit in changed.search(["kestrel bird"], 3)[0]}
    # a changed setting is a different index too
    assert cache_key(corpus, max_words=100, k1=0.9, b=0.4) != cache_key(corpus, max_words=50, k1=0.9, b=0.4)
    assert len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 2


def test_corrupt_cache_is_rebuilt(tmp_path: Path) -> None:
    corpus = write_jsonl(tmp_path / "tiny.jsonl", TINY_CORPUS)
    cache = tmp_path / "cache"
    built = BM25Index.load_or_build(corpus, cache)
    assert built.cache_path is not None
    (built.cache_path / "meta.json").write_text(json.dumps({"key": "someone else's", "passages": 4}))
    rebuilt = BM25Index.load_or_build(corpus, cache)
    assert not rebuilt.from_cache and rebuilt.search(["Aurelia"], 1)[0][0].passage.id == "0"
    assert BM25Index.load_or_build(corpus, cache).from_cache
    assert rebuilt.cache_path is not None
    (rebuilt.cache_path / "data.csc.index.npy").write_bytes(b"not numpy")
    assert not BM25Index.load_or_build(corpus, cache).from_cache


def test_cache_file_in_the_way_keeps_the_index_in_memory(tmp_path: Path) -> None:
    corpus = write_jsonl(tmp_path / "tiny.jsonl", TINY_CORPUS)
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache folder should be")
    index = BM25Index.load_or_build(corpus, blocker)
    assert index.cache_path is None and len(index.search(["Aurelia"], 1)[0]) == 1


def test_default_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AGENTGYM_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path / "deepsearch"
    monkeypatch.delenv("AGENTGYM_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "agentgym" / "deepsearch"


def test_shared_index_of_the_shipped_corpus() -> None:
    index = shared_index()
    assert index is shared_index() and len(index) == 12_324
    hits = index.search(["Beatles rock band formed in Liverpool"], 3)[0]
    assert hits[0].passage.title == "The Beatles"
