"""Deep Search tasks: the shipped FanOutQA sets, splits, user QA files, AgentGym data indices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from deepsearch_helpers import write_jsonl

from agentgym.envs.base import UnknownTaskError
from agentgym.envs.deepsearch.index import shared_index
from agentgym.envs.deepsearch.scoring import contains_answer, normalize_answer
from agentgym.envs.deepsearch.tasks import (
    DatasetError,
    DeepSearchCatalog,
    datasets_from_env,
    fanoutqa_tasks,
    load_catalog,
    user_tasks,
)


def test_shipped_splits() -> None:
    catalog = load_catalog()
    shipped = {name: size for name, size in catalog.splits().items() if name not in catalog.datasets()}
    assert shipped == {
        "train": 52,
        "test": 28,
        "sub": 72,
        "multi": 8,
        "sub-all": 493,
        "multi-all": 310,
    }
    train, test = set(catalog.task_ids("train")), set(catalog.task_ids("test"))
    assert not train & test
    assert train | test == set(catalog.task_ids("sub")) | set(catalog.task_ids("multi"))
    assert set(catalog.task_ids("sub")) <= set(catalog.task_ids("sub-all"))
    assert all(t.startswith("fanoutqa-sub/") for t in catalog.task_ids("sub-all"))
    assert all(t.startswith("fanoutqa-multi/") for t in catalog.task_ids("multi-all"))


def test_splits_are_deterministic() -> None:
    again = DeepSearchCatalog(fanoutqa_tasks())
    catalog = load_catalog()
    for split in ("train", "test", "sub", "multi", "sub-all", "multi-all"):
        assert again.task_ids(split) == catalog.task_ids(split)
    assert catalog.task_id("test", 0) == "fanoutqa-sub/60388a3ad855c948"


def test_single_hop_tasks_are_answerable_from_their_evidence_lead() -> None:
    catalog = load_catalog()
    index = shared_index()
    leads: dict[str, str] = {}
    for passage in index.passages:
        leads[passage.title] = f"{leads.get(passage.title, '')} {passage.text}"
    questions = set()
    for task_id in catalog.task_ids("sub"):
        task = catalog.task(task_id)
        assert task.kind == "single" and task.answerable is True and len(task.evidence) == 1
        assert contains_answer(leads[task.evidence[0]], task.answers[0])
        questions.add((normalize_answer(task.question), normalize_answer(task.answers[0])))
    assert len(questions) == 72  # de-duplicated


def test_multi_hop_tasks_have_all_evidence_in_the_corpus() -> None:
    catalog = load_catalog()
    titles = {passage.title for passage in shared_index().passages}
    for task_id in catalog.task_ids("multi"):
        task = catalog.task(task_id)
        assert task.kind == "set" and task.evidence and set(task.evidence) <= titles
    planets = catalog.task("fanoutqa-multi/b3b15d0277166b1d")
    assert planets.answers == ("Uranus", "Sir William Herschel", "Neptune", "Johann Galle")
    assert planets.score("Uranus (Sir William Herschel) and Neptune (Johann Galle)").correct
    partial = planets.score("Uranus, found by Sir William Herschel")
    assert not partial.correct and partial.recall == 0.5 and partial.em == 0.0 and 0 < partial.f1 < 1


def test_describe_and_unknown_ids() -> None:
    catalog = load_catalog()
    info = catalog.describe("fanoutqa-sub/60388a3ad855c948")
    assert info["question"] == "What is the origin city of The Beatles?"
    assert info["split"] == "test" and info["splits"] == ["test", "sub", "sub-all"]
    assert info["evidence"] == ["The Beatles"] and "answers" not in info
    outside = catalog.describe(catalog.task_ids("multi-all")[0])
    assert outside["split"] in ("multi-all", "train", "test")
    for bad in ("fanoutqa-sub/nope", "nq/0", "", "test"):
        with pytest.raises(UnknownTaskError, match="unknown Deep Search task"):
            catalog.describe(bad)
    with pytest.raises(UnknownTaskError, match="unknown split"):
        catalog.task_ids("nope")
    with pytest.raises(UnknownTaskError, match="out of range"):
        catalog.task_id("test", 28)


def test_compat_indices_cover_test_then_train() -> None:
    catalog = load_catalog()
    user = sum(catalog.splits()[name] for name in catalog.datasets())  # other tests may register some
    assert catalog.compat_size() == 80 + user
    assert catalog.compat_task_id(0) == catalog.task_id("test", 0)
    assert catalog.compat_task_id(27) == catalog.task_id("test", 27)
    assert catalog.compat_task_id(28) == catalog.task_id("train", 0)
    assert catalog.compat_task_id(79) == catalog.task_id("train", 51)
    for bad in (80 + user, -1):
        with pytest.raises(UnknownTaskError, match="data index"):
            catalog.compat_task_id(bad)


ROWS = [
    {"id": "test_0", "question": "who wrote hamlet", "golden_answers": ["William Shakespeare", "Shakespeare"]},
    {"id": "test_1", "question": "capital of france?", "golden_answers": ["Paris"], "data_source": "nq"},
]


def test_user_jsonl_and_json_files(tmp_path: Path) -> None:
    tasks = user_tasks("nq", write_jsonl(tmp_path / "nq.jsonl", ROWS))
    assert [t.task_id for t in tasks] == ["nq/0", "nq/1"]
    assert tasks[0].answers == ("William Shakespeare", "Shakespeare") and tasks[0].split == "nq"
    assert tasks[0].score("shakespeare").correct and tasks[1].extra == {"data_source": "nq"}
    (tmp_path / "nq.json").write_text(json.dumps(ROWS))
    assert [t.question for t in user_tasks("nq", tmp_path / "nq.json")] == [r["question"] for r in ROWS]


def test_search_r1_processed_rows_use_the_reward_model_target(tmp_path: Path) -> None:
    row = {"question": "q?", "reward_model": {"style": "rule", "ground_truth": {"target": ["A1", "A2"]}}}
    assert user_tasks("sr1", write_jsonl(tmp_path / "sr1.jsonl", [row]))[0].answers == ("A1", "A2")
    single = {"question": "q?", "answer": 42}
    assert user_tasks("hp", write_jsonl(tmp_path / "hp.jsonl", [single]))[0].answers == ("42",)


def test_user_parquet_file(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(ROWS)
    pq.write_table(table, tmp_path / "nq.parquet")
    tasks = user_tasks("nq", tmp_path / "nq.parquet")
    assert [t.answers for t in tasks] == [("William Shakespeare", "Shakespeare"), ("Paris",)]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("a.csv", "question,answer\n", "unsupported dataset format"),
        ("a.jsonl", "{not json}\n", "a.jsonl:1: not JSON"),
        ("a.json", '{"question": "q"}', "must be a list"),
        ("a.jsonl", "", "no rows"),
        ("a.jsonl", '{"question": "q", "golden_answers": []}\n', "row 0 has no gold answer"),
        ("a.jsonl", '{"question": "q", "golden_answers": ["the"]}\n', "row 0 has no gold answer"),
        ("a.jsonl", '{"golden_answers": ["x"]}\n', "row 0 has no 'question'"),
        ("a.jsonl", "[1, 2]\n", "row 0 is not an object"),
        ("a.parquet", "not parquet", "cannot read dataset"),
    ],
)
def test_bad_user_files(tmp_path: Path, name: str, content: str, message: str) -> None:
    (tmp_path / name).write_text(content)
    with pytest.raises(DatasetError, match=message):
        user_tasks("bad", tmp_path / name)
    with pytest.raises(DatasetError, match="no such dataset file"):
        user_tasks("bad", tmp_path / "missing.jsonl")


def test_registering_datasets(tmp_path: Path) -> None:
    catalog = DeepSearchCatalog(fanoutqa_tasks())
    path = write_jsonl(tmp_path / "nq.jsonl", ROWS)
    assert catalog.register_dataset("nq", path) == 2
    assert catalog.register_dataset("nq", str(path)) == 2  # same file again: no-op
    assert catalog.splits()["nq"] == 2 and catalog.task_ids("nq") == ("nq/0", "nq/1")
    assert catalog.describe("nq/1")["data_source"] == "nq" and catalog.describe("nq/1")["split"] == "nq"
    assert catalog.compat_size() == 82 and catalog.compat_task_id(80) == "nq/0"
    assert catalog.datasets() == {"nq": str(path.resolve())}
    other = write_jsonl(tmp_path / "other.jsonl", ROWS[:1])
    with pytest.raises(DatasetError, match="already registered"):
        catalog.register_dataset("nq", other)
    for bad in ("test", "fanoutqa-sub", "has/slash", "", "-x"):
        with pytest.raises(DatasetError, match="invalid dataset name"):
            catalog.register_dataset(bad, other)
    assert "nq" not in load_catalog().splits()  # a separate catalog leaves the process-wide one alone


def test_datasets_from_the_environment_variable(tmp_path: Path) -> None:
    assert datasets_from_env("") == {}
    assert datasets_from_env('{"nq": "/d/nq.jsonl", "hotpotqa": "/d/hp.parquet"}') == {
        "nq": "/d/nq.jsonl",
        "hotpotqa": "/d/hp.parquet",
    }
    assert datasets_from_env("nq=/d/nq.jsonl, popqa=/d/popqa.jsonl") == {
        "nq": "/d/nq.jsonl",
        "popqa": "/d/popqa.jsonl",
    }
    for bad in ("{nope", '{"nq": 3}', "nq", "=path"):
        with pytest.raises(DatasetError):
            datasets_from_env(bad)
    path = write_jsonl(tmp_path / "nq.jsonl", ROWS)
    catalog = DeepSearchCatalog(fanoutqa_tasks(), datasets_from_env(f"nq={path}"))
    assert catalog.splits()["nq"] == 2
