"""The Deep Search oracle: search for the evidence, then answer with a gold answer.

For FanOutQA tasks it searches once for each evidence article (in order, at most `max_searches`),
with the first of these queries that brings the article into the shipped index's top 3: the
article's title; the title and the question; the opening words of the article's lead; else the
title. User datasets name no evidence, so it searches the question. Its answer is the task's
reference answer (the first gold answer; for fan-out questions every gold key and value,
``key: value; ...``), so it scores 1 on every task. Useful for tests, demos and SFT warm-starts.
"""

from __future__ import annotations

from agentgym.envs.deepsearch.index import BM25Index, shared_index
from agentgym.envs.deepsearch.tasks import DeepSearchCatalog, QATask, load_catalog

OPENING_WORDS = 12
CHECK_TOPK = 3


class DeepSearchExpert:
    def __init__(self, max_searches: int = 10) -> None:
        if max_searches < 0:
            raise ValueError(f"max_searches must be non-negative, not {max_searches}")
        self.max_searches = max_searches
        self._catalog: DeepSearchCatalog = load_catalog()
        self._index: BM25Index | None = None
        self._openings: dict[str, str] = {}

    def demonstrate(self, task_id: str) -> list[str]:
        """The bare actions: ``<search>...</search>`` per evidence article, then ``<answer>...</answer>``."""
        task = self._catalog.task(task_id)  # raises UnknownTaskError
        if task.evidence:
            queries = [self.evidence_query(task, title) for title in task.evidence[: self.max_searches]]
        else:
            queries = [task.question][: self.max_searches]
        return [*(f"<search>{query}</search>" for query in queries), f"<answer>{task.reference}</answer>"]

    def evidence_query(self, task: QATask, title: str) -> str:
        """A query whose top results (shipped index) include the article `title`."""
        index = self._shared()
        candidates = [title, f"{title} {task.question}"]
        opening = self._openings.get(title)
        if opening:
            candidates.append(opening)
        for query in candidates:
            if any(hit.passage.title == title for hit in index.search([query], CHECK_TOPK)[0]):
                return query
        return title

    def _shared(self) -> BM25Index:
        if self._index is None:
            self._index = shared_index()
            for passage in self._index.passages:
                if passage.title not in self._openings:
                    self._openings[passage.title] = " ".join(passage.text.split()[:OPENING_WORDS])
        return self._index
