"""The browser environment on real Chromium: MiniWoB++ tasks, actions, safety, crashes."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from webarena_site import serve_pages

from agentgym.envs.base import UnknownTaskError
from agentgym.envs.webarena.actions import parse_action
from agentgym.envs.webarena.browser import BrowserCrashedError, shared_host
from agentgym.envs.webarena.env import WebArenaEnv, WebArenaExpert, run_solver
from agentgym.envs.webarena.miniwob import CURATED_TASKS, SOLVERS, html_root, tree_lines
from agentgym.envs.webarena.session import BrowserSession, SessionLimits

pytestmark = pytest.mark.skipif(not os.path.exists("/usr/bin/chromium"), reason="needs Debian's chromium")


@pytest.fixture
def env() -> Iterator[WebArenaEnv]:
    instance = WebArenaEnv()
    yield instance
    instance.close()


def play(env: WebArenaEnv, task_id: str) -> tuple[float, list[str]]:
    first = env.reset(task_id)
    solver = SOLVERS[task_id.split("/")[1]]

    def step(action: str) -> tuple[str, float, bool]:
        result = env.step(action)
        assert not result.info["invalid_action"], result.observation[:300]
        return result.observation, result.reward, result.done

    return run_solver(solver, str(first.info["objective"]), step, first.observation)


def test_catalog_splits_and_curated_pages_exist() -> None:
    catalog = WebArenaEnv.catalog()
    assert catalog.splits() == {
        "train": len(CURATED_TASKS) * 1000,
        "test": len(CURATED_TASKS) * 100,
        "train-solvable": len(SOLVERS) * 1000,
        "test-solvable": len(SOLVERS) * 100,
    }
    assert catalog.task_id("train", 0) == f"miniwob/{CURATED_TASKS[0]}/0"
    assert catalog.task_id("test", len(CURATED_TASKS) + 1) == f"miniwob/{CURATED_TASKS[1]}/1000001"
    assert catalog.describe("miniwob/click-button/5")["scripted_solver"] is True
    for name in CURATED_TASKS:
        assert (html_root() / "miniwob" / f"{name}.html").is_file(), name
    assert len(SOLVERS) >= 5 and set(SOLVERS) <= set(CURATED_TASKS)


def test_solvable_views_hold_the_solved_tasks_interleaved_with_their_base_ids() -> None:
    catalog = WebArenaEnv.catalog()
    solvable = [name for name in CURATED_TASKS if name in SOLVERS]
    n = len(solvable)
    assert catalog.task_ids("test-solvable", n + 1) == [
        *(f"miniwob/{name}/1000000" for name in solvable),
        f"miniwob/{solvable[0]}/1000001",
    ]
    assert catalog.task_id("train-solvable", 3 * n + 2) == f"miniwob/{solvable[2]}/3"
    last = catalog.task_id("train-solvable", 1000 * n - 1)
    assert last == f"miniwob/{solvable[-1]}/999" and catalog.describe(last)["split"] == "train"
    with pytest.raises(UnknownTaskError, match="test-easy"):
        catalog.task_id("test-easy", 0)


def test_the_same_page_prints_the_same_ids_and_a_demonstration_replays_in_another_episode() -> None:
    """Element ids are numbered per episode: the expert plays its own episode, the SFT data builder replays the
    actions in a fresh one (after other pages, in a reused browser), and they must mean the same elements."""
    expert = WebArenaExpert()
    env = WebArenaEnv()
    try:
        for name in sorted(SOLVERS):
            for seed in (1, 2):
                task_id = f"miniwob/{name}/{seed}"
                actions = expert.demonstrate(task_id)
                first = env.reset(task_id)
                assert env.reset(task_id).observation == first.observation, task_id
                for action in actions:
                    result = env.step(action)
                assert result.done and result.reward == 1.0, (task_id, actions, result.observation[:400])
    finally:
        env.close()


@pytest.mark.parametrize("name", sorted(SOLVERS))
def test_scripted_solvers_reach_reward_one(env: WebArenaEnv, name: str) -> None:
    for seed in (1_000_000, 1_000_001):
        reward, actions = play(env, f"miniwob/{name}/{seed}")
        assert reward == 1.0, (name, seed, actions)


def test_observation_has_webarena_fields(env: WebArenaEnv) -> None:
    first = env.reset("miniwob/click-button/3")
    text = first.observation
    assert text.startswith("Tab 0 (current): Click Button Task")
    assert "\n[" in text and "] button '" in text
    assert "URL: http://127.0.0.1:" in text and "/miniwob/click-button.html" in text
    assert 'OBJECTIVE: Click on the "' in text
    assert text.endswith("PREVIOUS ACTION: None")
    assert "Last reward" not in text  # MiniWoB's score board is hidden
    assert env.observe() == text


def test_wrong_click_scores_zero_and_ends(env: WebArenaEnv) -> None:
    first = env.reset("miniwob/click-button/4")
    (label,) = [part for part in first.info["objective"].split('"')[1:2]]
    wrong = next(line for line in tree_lines(first.observation) if line.role == "button" and line.name != label)
    result = env.step(f"click [{wrong.node_id}]")
    assert result.done and result.reward == 0.0 and result.info["raw_reward"] == -1.0
    assert result.info["success"] is False
    again = env.step("click [1]")
    assert again.done and again.info["invalid_action"] and "over" in again.observation


def test_bad_actions_are_observations(env: WebArenaEnv) -> None:
    env.reset("miniwob/click-button/5")
    unparsable = env.step("please click the button")
    assert unparsable.info["invalid_action"] and not unparsable.done
    assert "Unknown action" in unparsable.observation and "OBJECTIVE:" in unparsable.observation
    missing = env.step("click [999999]")
    assert missing.info["invalid_action"] and "no element [999999]" in missing.observation
    not_http = env.step("goto [file:///etc/passwd]")
    assert not_http.info["invalid_action"] and "only http(s)" in not_http.observation
    bad_tab = env.step("tab_focus [7]")
    assert bad_tab.info["invalid_action"] and "no tab 7" in bad_tab.observation
    assert env.step("scroll [down]").info["invalid_action"] is False


def test_outside_urls_are_blocked(env: WebArenaEnv) -> None:
    env.reset("miniwob/click-button/6")
    result = env.step("goto [http://example.com/]")
    assert not result.done
    assert "Navigation to http://example.com/ was blocked" in result.observation
    assert "/miniwob/click-button.html" in result.observation.split("URL: ")[1]


def test_links_and_popups_to_other_origins_are_blocked_and_tabs_bounded() -> None:
    outside = '<a href="http://127.0.0.1:9/secret" id="out">outside</a>'
    popups = "<button onclick=\"for (let i = 0; i < 5; i++) window.open('/')\">many</button>"
    host = shared_host()
    with serve_pages({"/": f"<title>Home</title>{outside}{popups}<a href='/next'>next</a>", "/next": "ok"}) as origin:

        async def scenario() -> dict[str, Any]:
            session = await BrowserSession.open(host, {origin}, SessionLimits(max_pages=3, spare_sessions=0))
            try:
                await session.goto(origin + "/")
                await session.settle()
                view = await session.view()
                ids = {node.name: node.node_id for node in view.tree.nodes}
                await session.execute(parse_action(f"click [{ids['outside']}]"))
                blocked = await session.view()
                await session.execute(parse_action("go_back"))
                view = await session.view()
                ids = {node.name: node.node_id for node in view.tree.nodes}
                await session.execute(parse_action(f"click [{ids['many']}]"))
                tabs = await session.view()
                return {"blocked": blocked.notes, "pages": len(session.pages()), "tabs": tabs.notes + tabs.tabs}
            finally:
                await session.close()

        outcome = host.call(scenario, 60)
    assert any("127.0.0.1:9/secret was blocked" in note for note in outcome["blocked"])
    assert outcome["pages"] == 3
    assert any("at most 3 tabs" in str(line) for line in outcome["tabs"])


def test_tabs_and_history(env: WebArenaEnv) -> None:
    env.reset("miniwob/click-button/7")
    opened = env.step("new_tab")
    assert "Tab 1 (current)" in opened.observation and "URL: about:blank" in opened.observation
    back = env.step("tab_focus [0]")
    assert "Tab 0 (current): Click Button Task" in back.observation
    closed = env.step("close_tab")
    assert "Tab 0 (current)" in closed.observation and "Tab 1" not in closed.observation


def test_a_spare_session_whose_tab_closed_is_not_taken() -> None:
    """A reset takes a spare session (a context with a blank tab, opened ahead); one whose tab closed meanwhile
    (seen once in a learning run at load ~20) is dropped, not taken: it failed the reset with an IndexError."""
    from agentgym.envs.webarena import session as sessions

    env = WebArenaEnv()
    try:
        play(env, "miniwob/click-button/10")  # leaves spares made
        host = shared_host()

        async def close_spare_tabs() -> int:
            spares = [spare for pool in sessions._spares.values() for spare in pool]
            for spare in spares:
                for page in spare.pages():
                    await page.close()
            return len(spares)

        assert host.call(close_spare_tabs, 30) >= 1
        reward, _ = play(env, "miniwob/click-button/11")
        assert reward == 1.0
    finally:
        env.close()


def test_killed_browser_fails_the_episode_and_is_replaced() -> None:
    host = shared_host()
    env = WebArenaEnv()
    try:
        env.reset("miniwob/click-button/8")
        generation = host.generation
        pid = host.call(host.browser_pid, 30)
        assert pid is not None
        scratch_dir = Path(host.scratch_dirs[generation])  # this Chromium's TMPDIR
        assert any(entry.name.startswith("org.chromium.Chromium.") for entry in scratch_dir.iterdir())
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while (host.alive(generation) or scratch_dir.exists()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not scratch_dir.exists()  # what the killed browser left there went with it
        with pytest.raises(Exception, match=r"(?i)crash|closed|target"):
            env.step("scroll [down]")
    finally:
        env.close()
    fresh = WebArenaEnv()
    try:
        reward, _ = play(fresh, "miniwob/click-button/9")
        assert reward == 1.0 and host.generation == generation + 1
    finally:
        fresh.close()


def test_vanished_tabs_are_a_crash_only_when_the_browser_goes_down() -> None:
    # Playwright reports a dead Chromium's pages closed a moment before the browser itself: a step in
    # between finds no tab. That is a crash when the browser disconnects within the grace, else the page's own.
    host = shared_host()
    env = WebArenaEnv()
    try:
        env.reset("miniwob/click-button/11")
        session = env._session
        assert session is not None
        host.call(lambda: session.pages()[0].close(), 10)
        own = env.step("scroll [down]")
        assert own.info["invalid_action"] and not own.done and "no tab is open" in own.observation

        env.reset("miniwob/click-button/12")
        session = env._session
        assert session is not None
        generation, pid = session.generation, host.call(host.browser_pid, 30)
        assert pid is not None
        host.call(lambda: session.pages()[0].close(), 10)
        threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()  # the disconnect comes after the tabs
        with pytest.raises(BrowserCrashedError):
            env.step("scroll [down]")
        assert not host.alive(generation)
    finally:
        env.close()


def test_expert_demonstrates() -> None:
    expert = WebArenaExpert()
    assert expert.solvable("miniwob/enter-text/3") and not expert.solvable("miniwob/navigate-tree/3")
    actions = expert.demonstrate("miniwob/enter-text/3")
    assert actions[0].startswith("type [") and actions[-1].startswith("click [")


def test_sft_data_from_the_observing_expert_is_its_demonstrations_replayed() -> None:
    # The expert chooses each action inside the SFT replay's own episode (one play of each task, not a
    # demonstration played and then replayed): the examples must be what the replay would have built.
    from agentgym.envs.base import ObservingExpert
    from agentgym.inference.models import load_tokenizer, resolve_model
    from agentgym.rollout.tokens import ChatTokenizer
    from agentgym.trainer.sft import SFTBuildReport, expert_sft_examples

    class DemonstrateOnly:  # the same solvers, seen as an Expert that only demonstrates
        def __init__(self) -> None:
            self.expert = WebArenaExpert()

        def demonstrate(self, task_id: str) -> list[str]:
            return self.expert.demonstrate(task_id)

    assert isinstance(WebArenaExpert(), ObservingExpert) and not isinstance(DemonstrateOnly(), ObservingExpert)
    chat = ChatTokenizer(load_tokenizer(resolve_model("builtin:tiny")))
    tasks = ["miniwob/enter-text/3", "miniwob/click-checkboxes/5", "miniwob/login-user/7", "miniwob/click-link/2"]
    observed, replayed = SFTBuildReport(), SFTBuildReport()
    once = expert_sft_examples("webarena", tasks, chat, report=observed)
    twice = expert_sft_examples("webarena", tasks, chat, make_expert=lambda _: DemonstrateOnly(), report=replayed)
    assert observed == replayed == SFTBuildReport(built=4)
    assert once == twice
