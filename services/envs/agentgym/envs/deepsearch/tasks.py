"""Deep Search tasks: the shipped FanOutQA sets and user-supplied QA files.

Shipped (from the FanOutQA dev set in the `fanoutqa` wheel, ``data/fanout-final-dev.json``, found
by path; checked against the shipped corpus, see `agentgym.envs.deepsearch.corpus`):

* ``fanoutqa-sub/<sub-question id>``: single-hop. FanOutQA's leaf sub-questions (at any depth of a
  decomposition) with one answer (a string or number; booleans count as yes/no) whose evidence
  article's title is in the corpus. Duplicates (same normalised question and answer) keep their
  first occurrence in file order. Reward: exact match against the answer.
* ``fanoutqa-multi/<question id>``: multi-hop fan-out questions, scored by answer-set match
  (FanOutQA's accuracy): every list item, dict key and dict value of the gold answer must occur
  (normalised, on word boundaries) in the agent's answer; the share found is reported as recall.

Splits (deterministic; a task's split never changes):

* ``sub``: the single-hop tasks that the shipped corpus can answer: the normalised answer occurs in
  the evidence article's lead (the only part of an article the corpus has). ``sub-all``: every
  single-hop task, answerable here or not (use it with the full wiki-18 behind ``SEARCH_URL``).
* ``multi``: the fan-out questions all of whose evidence articles are in the corpus;
  ``multi-all``: all 310 dev fan-out questions.
* ``train`` / ``test``: ``sub`` + ``multi`` (in that order, file order within each), cut by the
  SHA-256 of ``deepsearch:<normalised question>``: test when its first 8 bytes mod 10 < 3 (~30 %).
  Tasks outside ``sub``/``multi`` are in neither (``describe`` names their ``-all`` split).
* One split per user dataset, named as registered.

User datasets (Search-R1 / FlashRAG format: NQ, TriviaQA, PopQA, HotpotQA, 2Wiki, MuSiQue,
Bamboogle) load by path from ``.jsonl``, ``.json`` (a list of rows) or ``.parquet`` (needs
`pyarrow`): each row needs ``question`` and gold answers, taken from ``golden_answers`` (FlashRAG,
Search-R1), else ``reward_model.ground_truth.target`` (Search-R1's processed parquet), else
``answers`` / ``answer``. Task ids are ``<name>/<row number>`` (0-based, in file order). Register
them with ``DeepSearchEnv(datasets={name: path})`` / ``--set datasets='{"nq": "/data/nq.jsonl"}'``,
or for the whole process with ``AGENTGYM_DEEPSEARCH_DATASETS`` (a JSON object, or
``name=path,name=path``), which the catalog reads when it is first built.

AgentGym data indices (its SearchQA ``/create {id}``): AgentGym numbers its merged test set first,
then its train set. Here index ``i`` is the ``i``-th task of ``test``, then of ``train``, then of
each user dataset in registration order (`DeepSearchCatalog.compat_task_id`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

from agentgym.envs.base import TaskCatalog, UnknownTaskError
from agentgym.envs.deepsearch.corpus import Article, load_articles
from agentgym.envs.deepsearch.scoring import (
    answer_items,
    answer_set_recall,
    exact_match,
    f1_score,
    normalize_answer,
)

SUB_PREFIX = "fanoutqa-sub"
MULTI_PREFIX = "fanoutqa-multi"
SHIPPED_SPLITS = ("train", "test", "sub", "multi", "sub-all", "multi-all")
DATASETS_ENV = "AGENTGYM_DEEPSEARCH_DATASETS"
TEST_SHARE_TENTHS = 3
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_RESERVED = frozenset({*SHIPPED_SPLITS, SUB_PREFIX, MULTI_PREFIX})
_FANOUTQA_DEV = ("data", "fanout-final-dev.json")

TaskKind = Literal["single", "set"]


class DatasetError(ValueError):
    """A QA file that cannot be loaded or registered."""


@dataclass(frozen=True)
class AnswerScore:
    correct: bool  # the reward criterion: exact match (single) or every item found (set)
    em: float
    f1: float
    recall: float | None = None  # set tasks: share of the gold items found


@dataclass(frozen=True)
class QATask:
    task_id: str
    question: str
    answers: tuple[str, ...]  # single: the gold answers; set: the items that must all be found
    kind: TaskKind
    dataset: str
    split: str  # the task's own split (train/test/sub-all/multi-all/user name)
    reference: str  # one answer text that scores 1 (the oracle's)
    evidence: tuple[str, ...] = ()  # evidence article titles, where known
    answerable: bool | None = None  # single: answer in the evidence lead; set: all evidence in the corpus
    source_id: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def score(self, prediction: str) -> AnswerScore:
        if self.kind == "set":
            recall = answer_set_recall(prediction, self.answers)
            f1 = f1_score(prediction, [self.reference])
            return AnswerScore(correct=recall == 1.0, em=float(recall == 1.0), f1=f1, recall=recall)
        em = exact_match(prediction, self.answers)
        return AnswerScore(correct=em == 1.0, em=em, f1=f1_score(prediction, self.answers))


def _in_test(question: str) -> bool:
    digest = hashlib.sha256(f"deepsearch:{normalize_answer(question)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 10 < TEST_SHARE_TENTHS


def fanoutqa_dev_path() -> Path:
    """The FanOutQA dev set shipped in the `fanoutqa` wheel (found without importing it)."""
    spec = importlib.util.find_spec("fanoutqa")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(location).joinpath(*_FANOUTQA_DEV)
        if path.is_file():
            return path
    raise DatasetError("the 'fanoutqa' package (with data/fanout-final-dev.json) is not installed")


def _leaves(question: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    for sub in question.get("decomposition") or []:
        if sub.get("evidence") is not None:
            yield sub
        yield from _leaves(sub)


def _reference(answer: Any) -> str:
    if isinstance(answer, Mapping):
        return "; ".join(f"{key}: {_reference(value)}" for key, value in answer.items())
    if isinstance(answer, list | tuple):
        return ", ".join(_reference(item) for item in answer)
    if isinstance(answer, bool):
        return "yes" if answer else "no"
    return str(answer).strip()


def fanoutqa_tasks(dev_path: Path | str | None = None, articles: Sequence[Article] | None = None) -> list[QATask]:
    """The shipped tasks (single-hop then multi-hop, file order), each with its own split."""
    path = Path(dev_path) if dev_path is not None else fanoutqa_dev_path()
    questions = json.loads(path.read_text(encoding="utf-8"))
    leads = {article.title: article.text for article in (articles if articles is not None else load_articles())}
    normalised_leads: dict[str, str] = {}

    def lead_has(title: str, answer: str) -> bool:
        lead = normalised_leads.get(title)
        if lead is None:
            lead = normalised_leads[title] = f" {normalize_answer(leads[title])} "
        return f" {normalize_answer(answer)} " in lead

    singles: list[QATask] = []
    seen: set[tuple[str, str]] = set()
    for question in questions:
        for sub in _leaves(question):
            answer, title = sub["answer"], sub["evidence"]["title"]
            if not isinstance(answer, str | int | float) or title not in leads:
                continue
            gold = _reference(answer)
            key = (normalize_answer(sub["question"]), normalize_answer(gold))
            if not key[1] or key in seen:
                continue
            seen.add(key)
            answerable = not isinstance(answer, bool) and lead_has(title, gold)
            split = ("test" if _in_test(sub["question"]) else "train") if answerable else "sub-all"
            singles.append(
                QATask(
                    task_id=f"{SUB_PREFIX}/{sub['id']}",
                    question=sub["question"].strip(),
                    answers=(gold,),
                    kind="single",
                    dataset=SUB_PREFIX,
                    split=split,
                    reference=gold,
                    evidence=(title,),
                    answerable=answerable,
                    source_id=sub["id"],
                    extra={"parent_id": question["id"]},
                )
            )
    multis: list[QATask] = []
    for question in questions:
        items = answer_items(question["answer"])
        if not items:
            continue
        titles = tuple(dict.fromkeys(sub["evidence"]["title"] for sub in _leaves(question)))
        covered = bool(titles) and all(title in leads for title in titles)
        split = ("test" if _in_test(question["question"]) else "train") if covered else "multi-all"
        multis.append(
            QATask(
                task_id=f"{MULTI_PREFIX}/{question['id']}",
                question=question["question"].strip(),
                answers=tuple(items),
                kind="set",
                dataset=MULTI_PREFIX,
                split=split,
                reference=_reference(question["answer"]),
                evidence=titles,
                answerable=covered,
                source_id=question["id"],
                extra={"categories": list(question.get("categories") or [])},
            )
        )
    return singles + multis


# -- user datasets --------------------------------------------------------------------------------


def read_rows(path: Path | str) -> list[dict[str, Any]]:
    """Rows of a ``.jsonl``, ``.json`` (list) or ``.parquet`` file."""
    file = Path(path)
    if not file.is_file():
        raise DatasetError(f"no such dataset file: {file}")
    suffix = file.suffix.lower()
    try:
        if suffix == ".parquet":
            try:
                import pyarrow.parquet as pq
            except ImportError as error:
                raise DatasetError(f"{file}: reading parquet needs pyarrow (pip install pyarrow)") from error
            rows: list[Any] = pq.read_table(file).to_pylist()
        elif suffix == ".jsonl":
            rows = []
            with file.open(encoding="utf-8") as lines:
                for number, line in enumerate(lines, start=1):
                    if line.strip():
                        try:
                            rows.append(json.loads(line))
                        except json.JSONDecodeError as error:
                            raise DatasetError(f"{file}:{number}: not JSON: {error}") from error
        elif suffix == ".json":
            loaded = json.loads(file.read_text(encoding="utf-8"))
            if not isinstance(loaded, list):
                raise DatasetError(f"{file}: a .json dataset must be a list of rows")
            rows = loaded
        else:
            raise DatasetError(f"{file}: unsupported dataset format {suffix!r} (use .jsonl, .json or .parquet)")
    except DatasetError:
        raise
    except Exception as error:  # unreadable file, bad JSON, bad parquet
        raise DatasetError(f"cannot read dataset {file}: {type(error).__name__}: {error}") from error
    for number, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DatasetError(f"{file}: row {number} is not an object")
    return rows


def _golden_answers(row: Mapping[str, Any]) -> Any:
    if row.get("golden_answers") is not None:
        return row["golden_answers"]
    reward_model = row.get("reward_model")
    if isinstance(reward_model, Mapping):
        truth = reward_model.get("ground_truth")
        if isinstance(truth, Mapping) and truth.get("target") is not None:
            return truth["target"]
    for key in ("answers", "answer"):
        if row.get(key) is not None:
            return row[key]
    return None


def user_tasks(name: str, path: Path | str) -> list[QATask]:
    """The tasks of a user QA file: ``<name>/<row>``, all in split `name`."""
    rows = read_rows(path)
    if not rows:
        raise DatasetError(f"{path}: the dataset has no rows")
    tasks: list[QATask] = []
    for number, row in enumerate(rows):
        question = row.get("question")
        if not isinstance(question, str) or not question.strip():
            raise DatasetError(f"{path}: row {number} has no 'question' text")
        raw = _golden_answers(row)
        values = list(raw) if isinstance(raw, list | tuple) else [] if raw is None else [raw]
        answers = tuple(dict.fromkeys(str(value).strip() for value in values if normalize_answer(str(value))))
        if not answers:
            raise DatasetError(f"{path}: row {number} has no gold answer ('golden_answers')")
        extra = {key: row[key] for key in ("data_source",) if isinstance(row.get(key), str)}
        tasks.append(
            QATask(
                task_id=f"{name}/{number}",
                question=question.strip(),
                answers=answers,
                kind="single",
                dataset=name,
                split=name,
                reference=answers[0],
                source_id=str(row.get("id", number)),
                extra=extra,
            )
        )
    return tasks


def datasets_from_env(value: str | None = None) -> dict[str, str]:
    """Parse ``AGENTGYM_DEEPSEARCH_DATASETS``: a JSON object, or ``name=path,name=path``."""
    text = (os.environ.get(DATASETS_ENV, "") if value is None else value).strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as error:
            raise DatasetError(f"{DATASETS_ENV} is not valid JSON: {error}") from error
        if not isinstance(parsed, dict) or not all(isinstance(v, str) for v in parsed.values()):
            raise DatasetError(f"{DATASETS_ENV} must map dataset names to file paths")
        return {str(k): v for k, v in parsed.items()}
    pairs: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise DatasetError(f"{DATASETS_ENV}: expected name=path, got {item!r}")
        pairs[name.strip()] = path.strip()
    return pairs


# -- the catalog -----------------------------------------------------------------------------------


class DeepSearchCatalog(TaskCatalog):
    """Shipped tasks plus registered user datasets; registration is thread-safe."""

    def __init__(self, shipped: Sequence[QATask], datasets: Mapping[str, str | Path] | None = None) -> None:
        self._lock = threading.Lock()
        tasks = {task.task_id: task for task in shipped}
        if len(tasks) != len(shipped):
            raise ValueError("duplicate task ids among the shipped tasks")
        ordered = list(shipped)
        answerable = [t for t in ordered if t.split in ("train", "test")]
        splits: dict[str, tuple[str, ...]] = {
            "train": tuple(t.task_id for t in answerable if t.split == "train"),
            "test": tuple(t.task_id for t in answerable if t.split == "test"),
            "sub": tuple(t.task_id for t in answerable if t.dataset == SUB_PREFIX),
            "multi": tuple(t.task_id for t in answerable if t.dataset == MULTI_PREFIX),
            "sub-all": tuple(t.task_id for t in ordered if t.dataset == SUB_PREFIX),
            "multi-all": tuple(t.task_id for t in ordered if t.dataset == MULTI_PREFIX),
        }
        self._tasks: Mapping[str, QATask] = MappingProxyType(tasks)
        self._splits: Mapping[str, tuple[str, ...]] = MappingProxyType(splits)
        self._user: dict[str, Path] = {}
        for name, path in (datasets or {}).items():
            self.register_dataset(name, path)

    # TaskCatalog

    def splits(self) -> dict[str, int]:
        return {name: len(ids) for name, ids in self._splits.items()}

    def task_id(self, split: str, index: int) -> str:
        self._check_split_index(split, index)
        return self._splits[split][index]

    def task_ids(self, split: str, limit: int | None = None) -> tuple[str, ...]:
        ids = self._splits.get(split)
        if ids is None:
            raise UnknownTaskError(f"unknown split {split!r}; splits are {sorted(self._splits)}")
        return ids if limit is None else ids[: max(limit, 0)]

    def task(self, task_id: str) -> QATask:
        """The task with its gold answers (for the environment and the expert)."""
        task = self._tasks.get(task_id) if isinstance(task_id, str) else None
        if task is None:
            raise UnknownTaskError(
                f"unknown Deep Search task {task_id!r}; ids look like '{SUB_PREFIX}/<id>', "
                f"'{MULTI_PREFIX}/<id>' or '<dataset>/<row>' (list them with GET /v1/tasks?split=test)"
            )
        return task

    def describe(self, task_id: str) -> dict[str, Any]:
        task = self.task(task_id)
        return {
            "task_id": task.task_id,
            "split": task.split,
            "splits": [name for name, ids in self._splits.items() if name == task.split or task_id in ids],
            "dataset": task.dataset,
            "kind": task.kind,
            "question": task.question,
            "evidence": list(task.evidence),
            "answerable_in_shipped_corpus": task.answerable,
            "source_id": task.source_id,
            **dict(task.extra),
        }

    # user datasets

    def datasets(self) -> dict[str, str]:
        """Registered user datasets: name -> path."""
        return {name: str(path) for name, path in self._user.items()}

    def register_dataset(self, name: str, path: str | Path) -> int:
        """Add a user QA file as split `name`; returns its size. Same name and file again: no-op."""
        if not isinstance(name, str) or not _NAME.match(name) or name in _RESERVED:
            raise DatasetError(
                f"invalid dataset name {name!r}: use letters, digits, '_', '-', '.' (not {sorted(_RESERVED)})"
            )
        file = Path(path).expanduser().resolve()
        with self._lock:
            known = self._user.get(name)
            if known is not None:
                if known == file:
                    return len(self._splits[name])
                raise DatasetError(f"dataset {name!r} is already registered from {known}")
            tasks = user_tasks(name, file)
            merged = dict(self._tasks)
            merged.update((task.task_id, task) for task in tasks)
            splits = dict(self._splits)
            splits[name] = tuple(task.task_id for task in tasks)
            self._tasks = MappingProxyType(merged)
            self._splits = MappingProxyType(splits)
            self._user[name] = file
            return len(tasks)

    # AgentGym data indices

    def _compat_order(self) -> list[tuple[str, ...]]:
        return [self._splits["test"], self._splits["train"], *(self._splits[name] for name in self._user)]

    def compat_size(self) -> int:
        return sum(len(ids) for ids in self._compat_order())

    def compat_task_id(self, index: int) -> str:
        """AgentGym's data index -> task id: test tasks, then train, then user datasets."""
        if index >= 0:
            offset = index
            for ids in self._compat_order():
                if offset < len(ids):
                    return ids[offset]
                offset -= len(ids)
        raise UnknownTaskError(f"data index {index} is out of range (0..{self.compat_size() - 1})")


_CATALOG: DeepSearchCatalog | None = None
_CATALOG_LOCK = threading.Lock()


def load_catalog() -> DeepSearchCatalog:
    """The process-wide catalog: shipped tasks plus ``AGENTGYM_DEEPSEARCH_DATASETS`` (thread-safe)."""
    global _CATALOG
    catalog = _CATALOG
    if catalog is None:
        with _CATALOG_LOCK:
            catalog = _CATALOG
            if catalog is None:
                catalog = _CATALOG = DeepSearchCatalog(fanoutqa_tasks(), datasets_from_env())
    return catalog
