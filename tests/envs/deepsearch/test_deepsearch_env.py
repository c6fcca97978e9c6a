"""DeepSearchEnv in-process: the question, search and answer actions, rewards, bad actions, the
oracle, and the external SEARCH_URL path against a second local retrieval server."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from deepsearch_helpers import TINY_CORPUS, closed_port_url, serve_app, stub_retriever_app, write_jsonl

import agentgym.envs
from agentgym.envs.base import EpisodeNotStartedError, UnknownTaskError
from agentgym.envs.deepsearch.env import EPISODE_OVER, DeepSearchEnv, parse_action
from agentgym.envs.deepsearch.expert import DeepSearchExpert
from agentgym.envs.deepsearch.index import BM25Index
from agentgym.envs.deepsearch.retriever import HttpRetriever, LocalRetriever, RetrievalError, create_retrieval_app

BEATLES = "fanoutqa-sub/60388a3ad855c948"  # What is the origin city of The Beatles? -> Liverpool
PLANETS = "fanoutqa-multi/b3b15d0277166b1d"  # planets discovered after 1700 and their discoverers


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> DeepSearchEnv:
    monkeypatch.delenv("SEARCH_URL", raising=False)
    environment = DeepSearchEnv()
    environment.reset(BEATLES)
    return environment


@pytest.fixture
def tiny_server(tmp_path: Path) -> Iterator[str]:
    """A second retrieval service, over a made-up corpus, so its answers are recognisable."""
    index = BM25Index.load_or_build(write_jsonl(tmp_path / "tiny.jsonl", TINY_CORPUS), tmp_path / "cache")
    with serve_app(create_retrieval_app(index)) as url:
        yield url


def test_make_catalog_and_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SEARCH_URL", raising=False)
    env = agentgym.envs.make("deepsearch")
    assert isinstance(env, DeepSearchEnv) and env.name == "deepsearch"
    assert env.catalog() is DeepSearchEnv.catalog() and isinstance(env.retriever, LocalRetriever)
    with pytest.raises(TypeError):
        agentgym.envs.make("deepsearch", unknown_option=1)
    for bad in ({"topk": 0}, {"topk": 21}, {"max_steps": 0}, {"on_search_error": "ignore"}, {"datasets": ["x"]}):
        with pytest.raises(ValueError):
            DeepSearchEnv(**bad)
    with pytest.raises(ValueError, match="search URL"):
        DeepSearchEnv(search_url="ftp://example/retrieve")


def test_reset_shows_the_question(env: DeepSearchEnv) -> None:
    first = env.reset(BEATLES)
    assert first.observation.endswith("\n\nQuestion: What is the origin city of The Beatles?")
    assert "<search>" in first.observation and "<answer>" in first.observation
    assert first.info == {"task_id": BEATLES, "split": "test", "dataset": "fanoutqa-sub", "kind": "single"}
    assert env.observe() == first.observation == env.prompt()
    with pytest.raises(UnknownTaskError):
        env.reset("fanoutqa-sub/does-not-exist")
    with pytest.raises(EpisodeNotStartedError):
        DeepSearchEnv().step("<search>x</search>")


def test_search_returns_titled_passages(env: DeepSearchEnv) -> None:
    result = env.step("<search>Beatles band formed in Liverpool</search>")
    assert not result.done and result.reward == 0.0 and not result.info["invalid_action"]
    assert result.observation.startswith("<information>Doc 1(Title: ") and result.observation.endswith("</information>")
    lines = result.observation.removeprefix("<information>").removesuffix("</information>").split("\n")
    assert len(lines) == 3
    assert all(re.fullmatch(rf'Doc {n}\(Title: "[^"\n]+"\) \S.*', line) for n, line in enumerate(lines, start=1))
    assert lines[0].startswith('Doc 1(Title: "The Beatles") ')
    assert "formed in Liverpool" in result.observation
    assert result.info["results"] == 3 and result.info["searches"] == 1 and result.info["action"] == "search"
    assert env.observe() == result.observation and env.prompt().startswith("Answer the question")


def test_topk_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SEARCH_URL", raising=False)
    env = DeepSearchEnv(topk=5)
    env.reset(BEATLES)
    assert env.step("<search>city in England</search>").observation.count("Doc ") == 5


def test_whole_model_responses_and_unclosed_tags(env: DeepSearchEnv) -> None:
    response = "<think>I should look this up.</think>\n<search> The Beatles </search>"
    assert env.step(response).observation.startswith("<information>")
    assert env.step("<think>Sure now.</think> <answer>Liverpool").reward == 1.0


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("<search>a b</search>", ("search", "a b")),
        ("x <answer> Paris </answer> <search>y</search>", ("answer", "Paris")),
        ("<search>open ended", ("search", "open ended")),
        ("<search>q</answer>", ("search", "q</answer>")),
        ("Paris", (None, "")),
        ("<SEARCH>q</SEARCH>", (None, "")),
    ],
)
def test_parse_action(text: str, parsed: tuple[str | None, str]) -> None:
    assert parse_action(text) == parsed


@pytest.mark.parametrize(
    ("action", "message"),
    [
        ("Liverpool", "neither a search nor an answer"),
        ("", "neither a search nor an answer"),
        ("<search>   </search>", "The search is empty"),
        ("<answer></answer>", "The answer is empty"),
    ],
)
def test_invalid_actions_explain_the_format(env: DeepSearchEnv, action: str, message: str) -> None:
    result = env.step(action)
    assert message in result.observation and "<search> and </search>" in result.observation
    assert result.info["invalid_action"] is True and result.reward == 0.0 and not result.done


def test_query_with_no_match(env: DeepSearchEnv) -> None:
    result = env.step("<search>zzqqxx</search>")
    assert result.observation == "<information>No passage matches this query; try other words.</information>"
    assert result.info["results"] == 0


def test_wrong_answer_continues_then_right_answer_wins(env: DeepSearchEnv) -> None:
    wrong = env.step("<answer>Liverpool, England</answer>")
    assert not wrong.done and wrong.reward == 0.0 and wrong.score == 0.0
    assert "incorrect" in wrong.observation
    assert wrong.info["em"] == 0.0 and wrong.info["f1"] == pytest.approx(2 / 3) and not wrong.info["success"]
    right = env.step("<answer>the Liverpool</answer>")
    assert right.done and right.reward == 1.0 and right.score == 1.0 and right.info["success"]
    assert right.info["em"] == 1.0 and right.info["f1"] == 1.0 and right.info["best_f1"] == 1.0
    after = env.step("<answer>Liverpool</answer>")
    assert after.observation == EPISODE_OVER and after.reward == 0.0 and after.info["episode_over"]


def test_end_on_wrong_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SEARCH_URL", raising=False)
    env = DeepSearchEnv(end_on_wrong_answer=True)
    env.reset(BEATLES)
    result = env.step("<answer>London</answer>")
    assert result.done and result.reward == 0.0 and result.score == 0.0 and not result.info["success"]
    assert env.step("<answer>Liverpool</answer>").observation == EPISODE_OVER
    env.reset(BEATLES)  # a reset starts over
    assert env.step("<answer>Liverpool</answer>").reward == 1.0


def test_max_steps_truncates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SEARCH_URL", raising=False)
    env = DeepSearchEnv(max_steps=2)
    env.reset(BEATLES)
    assert not env.step("<search>Beatles</search>").truncated
    last = env.step("nonsense")
    assert last.truncated and not last.done and last.score == 0.0
    assert env.step("<answer>Liverpool</answer>").observation == EPISODE_OVER


def test_fan_out_question_needs_every_item(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SEARCH_URL", raising=False)
    env = DeepSearchEnv()
    env.reset(PLANETS)
    partial = env.step("<answer>Uranus, by Sir William Herschel</answer>")
    assert not partial.done and partial.info["recall"] == 0.5
    full = env.step("<answer>Uranus: Sir William Herschel; Neptune: Johann Galle</answer>")
    assert full.done and full.reward == 1.0 and full.info["recall"] == 1.0


def test_oracle_scores_one_on_every_shipped_task(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SEARCH_URL", raising=False)
    env, expert = DeepSearchEnv(), DeepSearchExpert()
    catalog = env.catalog()
    answerable = {*catalog.task_ids("sub"), *catalog.task_ids("multi")}
    task_ids = [*catalog.task_ids("sub-all"), *catalog.task_ids("multi-all")]
    assert len(task_ids) == 803
    for task_id in task_ids:
        env.reset(task_id)
        actions = expert.demonstrate(task_id)
        task = catalog.task(task_id)
        assert len(actions) == min(len(task.evidence), expert.max_searches) + 1
        assert actions[-1] == f"<answer>{task.reference}</answer>"
        results = [env.step(action) for action in actions]
        assert results[-1].done and results[-1].reward == 1.0 and results[-1].score == 1.0, task_id
        assert all(not r.done and not r.info["invalid_action"] for r in results[:-1])
        if task_id in answerable:  # each search brings up its evidence article
            for title, result in zip(task.evidence, results[:-1], strict=False):
                assert f'(Title: "{title}")' in result.observation, (task_id, title)
    with pytest.raises(UnknownTaskError):
        expert.demonstrate("fanoutqa-sub/nope")
    with pytest.raises(ValueError):
        DeepSearchExpert(max_searches=-1)


def test_user_dataset_from_the_constructor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SEARCH_URL", raising=False)
    path = write_jsonl(
        tmp_path / "qa.jsonl", [{"question": "Which band formed in Liverpool in 1960?", "golden_answers": ["Beatles"]}]
    )
    env = DeepSearchEnv(datasets={"envtest-qa": str(path)})
    assert env.catalog().task_ids("envtest-qa") == ("envtest-qa/0",)
    assert DeepSearchEnv(datasets=f"envtest-qa={path}").catalog().splits()["envtest-qa"] == 1  # CLI form
    env.reset("envtest-qa/0")
    actions = DeepSearchExpert().demonstrate("envtest-qa/0")
    assert actions == ["<search>Which band formed in Liverpool in 1960?</search>", "<answer>Beatles</answer>"]
    assert "The Beatles" in env.step(actions[0]).observation
    assert env.step("<answer>The Beatles</answer>").reward == 1.0


def test_search_url_points_at_an_external_retriever(tiny_server: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEARCH_URL", tiny_server)
    env = DeepSearchEnv()
    assert isinstance(env.retriever, HttpRetriever) and env.retriever.url == f"{tiny_server}/retrieve"
    env.reset(BEATLES)
    result = env.step("<search>highest peak of Veloria</search>")
    assert result.observation.startswith('<information>Doc 1(Title: "Mount Kest") Mount Kest is the highest peak')
    # the constructor setting wins over the variable; "local" forces the shipped index
    assert isinstance(DeepSearchEnv(search_url="local").retriever, LocalRetriever)
    monkeypatch.delenv("SEARCH_URL")
    configured = DeepSearchEnv(search_url=tiny_server, topk=1)
    configured.reset(BEATLES)
    assert configured.step("<search>Silverrun</search>").observation.count("Doc ") == 1


def test_unreachable_search_service_fails_the_episode_or_tells_the_agent() -> None:
    url = closed_port_url()
    failing = DeepSearchEnv(search_url=url)
    failing.reset(BEATLES)
    with pytest.raises(RetrievalError, match="unreachable"):
        failing.step("<search>Beatles</search>")
    observing = DeepSearchEnv(search_url=url, on_search_error="observe")
    observing.reset(BEATLES)
    result = observing.step("<search>Beatles</search>")
    assert result.observation.startswith("The search failed: search service") and not result.done
    assert "unreachable" in result.info["search_error"] and not result.info["invalid_action"]
    assert observing.step("<answer>Liverpool</answer>").reward == 1.0  # the episode goes on


def test_slow_search_service_times_out_instead_of_hanging() -> None:
    with serve_app(stub_retriever_app("slow", delay_s=1.0)) as url:
        env = DeepSearchEnv(search_url=url, search_timeout_s=0.2)
        env.reset(BEATLES)
        with pytest.raises(RetrievalError, match=r"did not answer within 0\.2s"):
            env.step("<search>Beatles</search>")
