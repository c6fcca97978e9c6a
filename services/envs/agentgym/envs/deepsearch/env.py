"""Deep Search: answer a question by searching a Wikipedia corpus over several turns (Search-R1).

On reset the agent sees the instructions and the question. Actions (the first complete tag in the
text counts, so a whole model response works too; an opening tag never closed runs to the end):

* ``<search>query</search>`` -> ``<information>Doc 1(Title: "X") text\\nDoc 2(...) ...</information>``,
  the top-k passages (Search-R1's format); reward 0;
* ``<answer>text</answer>`` -> reward 1, done, when it matches the gold answer: exact match after
  normalisation (single-hop) or every gold item found (fan-out questions); ``info`` reports
  ``em``, ``f1`` (and ``recall`` for fan-out). A wrong answer says so and the episode goes on,
  unless ``end_on_wrong_answer`` (then it ends, score 0);
* anything else (no tag, an empty tag) -> an observation explaining the format,
  ``info["invalid_action"] = True``.

Search backend: the in-process BM25 index over the shipped corpus by default; with ``search_url``
(or the ``SEARCH_URL`` environment variable) any Search-R1-compatible ``/retrieve`` server, e.g. the
full wiki-18 e5 setup. ``search_url="local"`` forces the in-process index even when ``SEARCH_URL``
is set. External searches time out after ``search_timeout_s``; on failure the episode fails with
the reason (``on_search_error="fail"``, default: a failed episode is flagged data, not a silent
learning signal) or the agent is told and may go on (``"observe"``).

With ``max_steps`` set, an episode not solved after that many steps is truncated. ``datasets``
registers user QA files (name -> path, or ``"name=path,..."``; see `agentgym.envs.deepsearch.tasks`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from agentgym.envs.base import Environment, EpisodeNotStartedError, ResetResult, StepResult
from agentgym.envs.deepsearch.index import Hit
from agentgym.envs.deepsearch.retriever import (
    MAX_QUERY_CHARS,
    LocalRetriever,
    RetrievalError,
    Retriever,
    shared_http_retriever,
)
from agentgym.envs.deepsearch.tasks import DeepSearchCatalog, QATask, datasets_from_env, load_catalog

SEARCH_URL_ENV = "SEARCH_URL"
MAX_TOPK = 20
_COMPLETE = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
_OPEN = re.compile(r"<(search|answer)>(.*)\Z", re.DOTALL)

INSTRUCTIONS = (
    "Answer the question below. You can search a Wikipedia corpus as often as you need: write "
    "<search> your query </search> and the top passages come back between <information> and "
    "</information>. When you know the answer, write it between <answer> and </answer>, in a few "
    "words, without explanation, e.g. <answer> Beijing </answer>."
)
FORMAT_HELP = (
    "To search, put the query between <search> and </search>; to answer, put the answer between <answer> and </answer>."
)
EPISODE_OVER = "The episode is over; reset to start a new one."

SearchErrorMode = Literal["fail", "observe"]


def parse_action(text: str) -> tuple[str | None, str]:
    """(``"search"`` | ``"answer"`` | None, content): the first complete tag, else a trailing open one."""
    match = _COMPLETE.search(text) or _OPEN.search(text)
    if match is None:
        return None, ""
    return match.group(1), match.group(2).strip()


def format_passages(hits: list[Hit]) -> str:
    """Search-R1's rendering: ``Doc i(Title: <first line of contents>) <rest>`` per passage."""
    lines = []
    for number, hit in enumerate(hits, start=1):
        title_line, _, text = hit.passage.contents.partition("\n")
        lines.append(f"Doc {number}(Title: {title_line}) {' '.join(text.split())}")
    return "\n".join(lines)


class DeepSearchEnv(Environment):
    """One Deep Search episode. Instances are light: the index, HTTP pools and catalog are shared."""

    name: ClassVar[str] = "deepsearch"

    def __init__(
        self,
        search_url: str | None = None,
        topk: int = 3,
        search_timeout_s: float = 10.0,
        max_steps: int | None = None,
        end_on_wrong_answer: bool = False,
        on_search_error: SearchErrorMode = "fail",
        datasets: Mapping[str, str] | str | None = None,
    ) -> None:
        if not isinstance(topk, int) or not 1 <= topk <= MAX_TOPK:
            raise ValueError(f"topk must be an integer in 1..{MAX_TOPK}, not {topk!r}")
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"max_steps must be a positive number of steps or None, not {max_steps!r}")
        if on_search_error not in ("fail", "observe"):
            raise ValueError(f"on_search_error must be 'fail' or 'observe', not {on_search_error!r}")
        if isinstance(datasets, str):  # `--set datasets=nq=/data/nq.jsonl,hotpotqa=/data/hotpotqa.parquet`
            datasets = datasets_from_env(datasets)
        if datasets is not None and not isinstance(datasets, Mapping):
            raise ValueError("datasets must map dataset names to file paths")
        self.topk = topk
        self.max_steps = max_steps
        self.end_on_wrong_answer = bool(end_on_wrong_answer)
        self.on_search_error: SearchErrorMode = on_search_error
        self._catalog = load_catalog()
        for dataset, path in (datasets or {}).items():
            self._catalog.register_dataset(dataset, path)
        url = os.environ.get(SEARCH_URL_ENV, "") if search_url is None else search_url
        url = url.strip()
        self.retriever: Retriever
        if url and url != "local":
            self.retriever = shared_http_retriever(url, search_timeout_s)
        else:
            self.retriever = LocalRetriever()
        self._task: QATask | None = None
        self._prompt = ""
        self._observation = ""
        self._steps = 0
        self._searches = 0
        self._success = False
        self._over = False
        self._truncated = False
        self._best_f1 = 0.0

    @classmethod
    def catalog(cls) -> DeepSearchCatalog:
        return load_catalog()

    # -- episode ------------------------------------------------------------------------------

    def reset(self, task_id: str) -> ResetResult:
        task = self._catalog.task(task_id)  # raises UnknownTaskError
        self._task = task
        self._steps = self._searches = 0
        self._success = self._over = self._truncated = False
        self._best_f1 = 0.0
        self._prompt = self._observation = f"{INSTRUCTIONS}\n\nQuestion: {task.question}"
        return ResetResult(
            observation=self._observation,
            available_actions=None,
            info={"task_id": task.task_id, "split": task.split, "dataset": task.dataset, "kind": task.kind},
        )

    def observe(self) -> str:
        self._require_episode()
        return self._observation

    def prompt(self) -> str:
        """The episode's first observation: instructions and question (AgentGym's /observation)."""
        self._require_episode()
        return self._prompt

    def step(self, action: str) -> StepResult:
        task = self._require_episode()
        if self._success or self._over or self._truncated:
            return self._result(EPISODE_OVER, info={"invalid_action": False, "episode_over": True})
        self._steps += 1
        kind, content = parse_action(action if isinstance(action, str) else str(action))
        reward = 0.0
        info: dict[str, Any] = {"invalid_action": False, "action": kind}
        if kind is None:
            info["invalid_action"] = True
            observation = f"Your action has neither a search nor an answer. {FORMAT_HELP}"
        elif not content:
            info["invalid_action"] = True
            observation = f"The {kind} is empty. {FORMAT_HELP}"
        elif kind == "search":
            observation = self._search(content, info)
        else:
            score = task.score(content)
            self._best_f1 = max(self._best_f1, score.f1)
            info.update(em=score.em, f1=score.f1)
            if score.recall is not None:
                info["recall"] = score.recall
            if score.correct:
                self._success = True
                reward = 1.0
                observation = "Your answer is correct."
            elif self.end_on_wrong_answer:
                self._over = True
                observation = "Your answer is incorrect. The episode is over."
            else:
                observation = "Your answer is incorrect. Search for more information or give another answer."
        if not (self._success or self._over) and self.max_steps is not None and self._steps >= self.max_steps:
            self._truncated = True
        self._observation = observation
        return self._result(observation, reward=reward, info=info)

    # -- helpers ------------------------------------------------------------------------------

    def _search(self, query: str, info: dict[str, Any]) -> str:
        if len(query) > MAX_QUERY_CHARS:
            query = query[:MAX_QUERY_CHARS]
            info["query_truncated"] = True
        self._searches += 1
        try:
            hits = self.retriever.search([query], self.topk)[0]
        except RetrievalError as error:
            if self.on_search_error == "fail":
                raise
            info["search_error"] = str(error)
            return f"The search failed: {error}. You may search again or answer."
        info["results"] = len(hits)
        if not hits:
            return "<information>No passage matches this query; try other words.</information>"
        return f"<information>{format_passages(hits)}</information>"

    def _require_episode(self) -> QATask:
        if self._task is None:
            raise EpisodeNotStartedError("reset(task_id) must be called before step/observe")
        return self._task

    def _result(self, observation: str, *, reward: float = 0.0, info: dict[str, Any]) -> StepResult:
        info.update(
            success=self._success,
            steps=self._steps,
            searches=self._searches,
            best_f1=self._best_f1,
        )
        return StepResult(
            observation=observation,
            reward=reward,
            done=self._success or self._over,
            truncated=self._truncated,
            score=1.0 if self._success else 0.0,
            available_actions=None,
            info=info,
        )
