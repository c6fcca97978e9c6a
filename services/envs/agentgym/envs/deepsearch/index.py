"""The BM25 index over the corpus passages (`bm25s`), built once and cached on disk.

Cache: ``$AGENTGYM_CACHE_DIR/deepsearch`` (default ``~/.cache/agentgym/deepsearch``), one folder
``bm25-<key>`` per index, where the key is a SHA-256 of the corpus file's bytes, the chunking and
BM25 parameters and the tokenizer version: a changed corpus (or setting) gets a new folder and a
fresh build; an unchanged one loads in a fraction of a second. Folders are written under a temporary
name and renamed into place, so concurrent builders and interrupted builds never leave a half index;
an unreadable or inconsistent cached index is rebuilt. Where the cache cannot be written (a read-only
image), the index is built in memory and a warning logged.

Scoring is Lucene's BM25 with Anserini's defaults (k1=0.9, b=0.4, as in Search-R1's BM25
retriever). Tokens: lowercased, accents folded, runs of 2+ word characters, English stopwords
dropped, no stemming. A query without any indexed token matches nothing (empty result), as do
passages scoring 0.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bm25s
import numpy as np
from bm25s.stopwords import STOPWORDS_EN

from agentgym.envs.deepsearch.corpus import (
    DEFAULT_MAX_WORDS,
    CorpusError,
    Passage,
    default_corpus_path,
    load_passages,
)

log = logging.getLogger(__name__)

TOKENIZER_VERSION = 1
INDEX_FORMAT = 1
DEFAULT_K1 = 0.9
DEFAULT_B = 0.4
_TOKEN = re.compile(r"\w\w+")
_STOPWORDS = frozenset(STOPWORDS_EN)
_META = "meta.json"


def default_cache_dir() -> Path:
    """``$AGENTGYM_CACHE_DIR/deepsearch``, or ``~/.cache/agentgym/deepsearch``."""
    base = os.environ.get("AGENTGYM_CACHE_DIR")
    root = Path(base) if base else Path.home() / ".cache" / "agentgym"
    return root / "deepsearch"


def tokenize(text: str) -> list[str]:
    """Index/query tokens: lowercase, accents folded, words of 2+ characters, stopwords dropped."""
    lowered = text.lower()
    if not lowered.isascii():
        lowered = "".join(c for c in unicodedata.normalize("NFKD", lowered) if not unicodedata.combining(c))
    return [token for token in _TOKEN.findall(lowered) if token not in _STOPWORDS]


@dataclass(frozen=True, slots=True)
class Hit:
    passage: Passage
    score: float


class BM25Index:
    """Passages plus their BM25 index; `search` is thread-safe (read-only after construction)."""

    def __init__(
        self,
        passages: Sequence[Passage],
        model: bm25s.BM25,
        *,
        key: str = "",
        from_cache: bool = False,
        build_seconds: float = 0.0,
        cache_path: Path | None = None,
    ) -> None:
        self.passages = list(passages)
        self._model = model
        self._vocab: dict[str, int] = dict(model.vocab_dict)
        self.key = key
        self.from_cache = from_cache
        self.build_seconds = build_seconds
        self.cache_path = cache_path
        num_docs = int(model.scores["num_docs"])
        if num_docs != len(self.passages):
            raise ValueError(f"index has {num_docs} documents but there are {len(self.passages)} passages")

    def __len__(self) -> int:
        return len(self.passages)

    # -- building ---------------------------------------------------------------------------------

    @classmethod
    def build(cls, passages: Sequence[Passage], *, k1: float = DEFAULT_K1, b: float = DEFAULT_B) -> BM25Index:
        """Index `passages` in memory (title and text both count)."""
        started = time.perf_counter()
        tokens = [tokenize(f"{passage.title} {passage.text}") for passage in passages]
        model = bm25s.BM25(k1=k1, b=b, method="lucene")
        model.index(tokens, show_progress=False)
        return cls(passages, model, build_seconds=time.perf_counter() - started)

    @classmethod
    def load_or_build(
        cls,
        corpus_path: Path | str | None = None,
        cache_dir: Path | str | None = None,
        *,
        max_words: int = DEFAULT_MAX_WORDS,
        k1: float = DEFAULT_K1,
        b: float = DEFAULT_B,
    ) -> BM25Index:
        """The index of a corpus file (default: the shipped one), from the cache when it is current."""
        corpus = Path(corpus_path) if corpus_path is not None else default_corpus_path()
        cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        key = cache_key(corpus, max_words=max_words, k1=k1, b=b)
        passages = load_passages(corpus, max_words)
        folder = cache / f"bm25-{key[:24]}"
        if folder.is_dir():
            try:
                return cls._load(folder, passages, key)
            except Exception as error:  # corrupt or foreign folder: rebuild it
                log.warning("cached index %s is unusable (%s); rebuilding", folder, error)
                shutil.rmtree(folder, ignore_errors=True)
        index = cls.build(passages, k1=k1, b=b)
        index.key = key
        index.cache_path = _save(index._model, folder, key, len(passages), corpus)
        return index

    @classmethod
    def _load(cls, folder: Path, passages: list[Passage], key: str) -> BM25Index:
        started = time.perf_counter()
        meta = json.loads((folder / _META).read_text(encoding="utf-8"))
        if meta.get("key") != key or meta.get("passages") != len(passages):
            raise ValueError(f"metadata does not match (key {meta.get('key')!r}, {meta.get('passages')} passages)")
        model = bm25s.BM25.load(str(folder), show_progress=False, verbosity=0)
        index = cls(passages, model, key=key, from_cache=True, cache_path=folder)
        index.build_seconds = time.perf_counter() - started
        return index

    # -- searching --------------------------------------------------------------------------------

    def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
        """The `topk` best passages of each query (best first; ties by passage order)."""
        if topk < 1:
            raise ValueError(f"topk must be at least 1, not {topk}")
        results: list[list[Hit]] = []
        for query in queries:
            ids = [self._vocab[token] for token in tokenize(query) if token in self._vocab]
            if not ids:
                results.append([])
                continue
            scores = self._model.get_scores_from_ids(ids)
            k = min(topk, len(scores))
            top = np.argpartition(-scores, k - 1)[:k]
            ordered = top[np.lexsort((top, -scores[top]))]
            results.append([Hit(self.passages[i], float(scores[i])) for i in ordered.tolist() if scores[i] > 0])
        return results


def cache_key(corpus: Path, *, max_words: int, k1: float, b: float) -> str:
    """SHA-256 of the corpus bytes and every setting that changes the index."""
    digest = hashlib.sha256()
    try:
        with corpus.open("rb") as file:
            for block in iter(lambda: file.read(1 << 20), b""):
                digest.update(block)
    except OSError as error:
        raise CorpusError(f"cannot read corpus {corpus}: {error}") from error
    settings = {
        "format": INDEX_FORMAT,
        "tokenizer": TOKENIZER_VERSION,
        "max_words": max_words,
        "k1": k1,
        "b": b,
        "bm25s": bm25s.__version__,
    }
    digest.update(json.dumps(settings, sort_keys=True).encode())
    return digest.hexdigest()


def _save(model: bm25s.BM25, folder: Path, key: str, passages: int, corpus: Path) -> Path | None:
    """Write the index to `folder` atomically; None (and a warning) when the cache is not writable."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    except OSError as error:
        log.warning("cannot write the index cache under %s (%s); keeping the index in memory", folder.parent, error)
        return None
    try:
        model.save(str(staging), show_progress=False)
        meta: dict[str, Any] = {"key": key, "passages": passages, "corpus": str(corpus), "created": time.time()}
        (staging / _META).write_text(json.dumps(meta), encoding="utf-8")
        try:
            staging.rename(folder)
        except OSError:
            if not folder.is_dir():  # not a concurrent builder winning the race
                raise
            shutil.rmtree(staging, ignore_errors=True)
        return folder
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        log.warning("cannot write the index cache %s (%s); keeping the index in memory", folder, error)
        return None


_DEFAULT: dict[tuple[str, str], BM25Index] = {}
_DEFAULT_LOCK = threading.Lock()


def shared_index(corpus_path: Path | str | None = None, cache_dir: Path | str | None = None) -> BM25Index:
    """The process-wide index of a corpus (default: the shipped one), loaded or built on first use."""
    corpus = Path(corpus_path) if corpus_path is not None else default_corpus_path()
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    slot = (str(corpus.resolve()), str(cache.resolve()))
    index = _DEFAULT.get(slot)
    if index is None:
        with _DEFAULT_LOCK:
            index = _DEFAULT.get(slot)
            if index is None:
                index = _DEFAULT[slot] = BM25Index.load_or_build(corpus, cache)
                log.info(
                    "deepsearch index: %d passages, %s in %.2fs",
                    len(index),
                    "loaded" if index.from_cache else "built",
                    index.build_seconds,
                )
    return index
