"""The environment on WebArena task configs, against a loopback stand-in for the shopping site:
start URLs, the site allowlist, and `stop [answer]` graded by the task's evaluators."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from webarena_pages import wa_config
from webarena_site import serve_pages

from agentgym.envs.webarena.env import WebArenaEnv
from agentgym.envs.webarena.miniwob import tree_lines

pytestmark = pytest.mark.skipif(not os.path.exists("/usr/bin/chromium"), reason="needs Debian's chromium")

SHOP = {
    "/": "<title>One Stop Market</title><h1>Shop</h1><a href='/mug'>Blue mug</a> <a href='/tea'>Green tea</a>"
    "<a href='http://127.0.0.1:9/elsewhere'>partner site</a>",
    "/mug": "<title>Blue mug</title><h1>Blue mug</h1><p id='price'>$12.50</p><a href='/'>Home</a>",
    "/tea": "<title>Green tea</title><h1>Green tea</h1><p id='price'>$4.00</p>",
}


@pytest.fixture
def shop_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[WebArenaEnv, str]]:
    with serve_pages(SHOP) as origin:
        monkeypatch.setenv("WA_SHOPPING", origin)
        tasks = [
            wa_config(
                90001,
                ["shopping"],
                "__SHOPPING__/",
                "What is the price of the blue mug?",
                {"eval_types": ["string_match"], "reference_answers": {"must_include": ["12.50"]}},
                require_login=False,
            ),
            wa_config(
                90002,
                ["shopping"],
                "__SHOPPING__/",
                "Open the page of the green tea",
                {"eval_types": ["url_match"], "reference_url": "__SHOPPING__/tea", "url_note": "GOLD in PRED"},
                require_login=False,
            ),
            wa_config(
                90003,
                ["shopping"],
                "__SHOPPING__/mug",
                "Describe the blue mug",
                {"eval_types": ["string_match"], "reference_answers": {"fuzzy_match": ["a blue mug for $12.50"]}},
                require_login=False,
            ),
            wa_config(
                90004,
                ["shopping"],
                "__SHOPPING__/mug |AND| __SHOPPING__/tea",
                "Which of the two open products is cheaper?",
                {
                    "eval_types": ["program_html"],
                    "program_html": [
                        {
                            "url": "last",
                            "locator": "document.querySelector('#price').outerText",
                            "required_contents": {"exact_match": "$4.00"},
                        }
                    ],
                },
                require_login=False,
            ),
        ]
        path = tmp_path / "test.raw.json"
        path.write_text(json.dumps(tasks))
        env = WebArenaEnv(tasks_path=str(path))
        try:
            yield env, origin
        finally:
            env.close()


def click(env: WebArenaEnv, observation: str, name: str) -> str:
    node = next(line for line in tree_lines(observation) if line.role == "link" and line.name == name)
    result = env.step(f"click [{node.node_id}]")
    assert not result.info["invalid_action"], result.observation
    return result.observation


def test_catalog_lists_loaded_tasks(shop_env: tuple[WebArenaEnv, str]) -> None:
    catalog = WebArenaEnv.catalog()
    assert {"webarena/90001", "webarena/90004"} <= set(catalog.task_ids("webarena"))
    assert catalog.describe("webarena/90002")["source"] == "webarena"


def test_string_match_answer_graded(shop_env: tuple[WebArenaEnv, str]) -> None:
    env, origin = shop_env
    first = env.reset("webarena/90001")
    assert f"URL: {origin}/" in first.observation
    assert "OBJECTIVE: What is the price of the blue mug?" in first.observation
    page = click(env, first.observation, "Blue mug")
    assert "$12.50" in page and f"URL: {origin}/mug" in page
    right = env.step("stop [It costs $12.50]")
    assert right.done and right.reward == 1.0 and right.info["success"] is True
    env.reset("webarena/90001")
    wrong = env.step("stop [$4.00]")
    assert wrong.done and wrong.reward == 0.0 and wrong.info["success"] is False


def test_url_match_and_blocked_partner_site(shop_env: tuple[WebArenaEnv, str]) -> None:
    env, origin = shop_env
    first = env.reset("webarena/90002")
    blocked = click(env, first.observation, "partner site")
    assert "Navigation to http://127.0.0.1:9/elsewhere was blocked" in blocked
    home = env.step("go_back")
    tea = click(env, home.observation, "Green tea")
    assert f"URL: {origin}/tea" in tea
    assert env.step("stop []").reward == 1.0


def test_fuzzy_match_without_a_judge_is_reported_not_passed(shop_env: tuple[WebArenaEnv, str]) -> None:
    env, _ = shop_env
    env.reset("webarena/90003")
    result = env.step("stop [a blue mug for $12.50]")
    assert result.done and result.reward == 0.0
    assert "judge" in result.info["evaluation_error"].lower()


def test_several_start_urls_open_tabs_and_program_html(shop_env: tuple[WebArenaEnv, str]) -> None:
    env, _ = shop_env
    first = env.reset("webarena/90004")
    assert "Tab 0 (current): Blue mug" in first.observation and "Tab 1: Green tea" in first.observation
    focused = env.step("tab_focus [1]")
    assert "Tab 1 (current): Green tea" in focused.observation
    assert env.step("stop [the tea]").reward == 1.0  # the page open last shows $4.00
