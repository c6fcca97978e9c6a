"""WebArena task configs: site URLs, placeholder substitution, validation, loading, origins."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
from webarena_pages import SAMPLE_CONFIGS

from agentgym.envs.webarena.configs import (
    SITE_ENV_VARS,
    MissingSiteUrlError,
    SiteUrls,
    TaskConfigError,
    WebArenaTask,
    allowed_origins,
    load_task_configs,
    origin_of,
    parse_task_config,
)

ENV = {
    "WA_SHOPPING": "http://wa.internal:7770/",
    "WA_SHOPPING_ADMIN": "http://wa.internal:7780/admin",
    "WA_REDDIT": "http://wa.internal:9999",
    "WA_GITLAB": "http://wa.internal:8023",
    "WA_WIKIPEDIA": "http://wa.internal:8888",
    "WA_MAP": "http://wa.internal:3000",
    "WA_HOMEPAGE": "http://wa.internal:4399",
}


@pytest.fixture
def urls() -> SiteUrls:
    return SiteUrls.from_env(ENV)


@pytest.fixture
def raw_json(tmp_path: Path) -> Path:
    path = tmp_path / "test.raw.json"
    path.write_text(json.dumps(SAMPLE_CONFIGS), encoding="utf-8")
    return path


def by_id(tasks: list[WebArenaTask]) -> dict[int, WebArenaTask]:
    return {t.task_id: t for t in tasks}


def sample(task_id: int) -> dict[str, Any]:
    return copy.deepcopy(next(c for c in SAMPLE_CONFIGS if c["task_id"] == task_id))


def test_site_urls_from_env_strips_slash_and_names_missing_variable() -> None:
    urls = SiteUrls.from_env({"WA_SHOPPING": "http://localhost:7770/", "WA_GITLAB": ""})
    assert urls.url("shopping") == "http://localhost:7770"
    assert urls.available() == ("shopping",)
    with pytest.raises(MissingSiteUrlError, match="WA_GITLAB"):
        urls.url("gitlab")
    with pytest.raises(ValueError, match="WA_REDDIT"):
        SiteUrls.from_env({"WA_REDDIT": "localhost:9999"})  # no scheme: a common slip
    assert SITE_ENV_VARS["shopping_admin"] == "WA_SHOPPING_ADMIN"


def test_load_list_substitutes_placeholders_recursively(raw_json: Path, urls: SiteUrls) -> None:
    tasks = by_id(load_task_configs(raw_json, urls))
    assert sorted(tasks) == sorted(c["task_id"] for c in SAMPLE_CONFIGS)
    admin = tasks[0]
    assert admin.sites == ("shopping_admin",)
    assert admin.start_urls == ("http://wa.internal:7780/admin",)
    assert admin.intent == "What is the top-1 best-selling product in 2022"
    assert admin.require_login and not admin.require_reset
    assert admin.storage_state == "./.auth/shopping_admin_state.json"
    assert admin.eval["reference_answers"] == {"exact_match": "Quest Lumaflex™ Band"}
    # Nested strings (eval section, program_html targets) and the intent are substituted too.
    assert tasks[45].eval["reference_url"] == (
        "http://wa.internal:8023/a11yproject/a11yproject.com/-/issues/?sort=created_asc&state=opened"
    )
    assert tasks[604].eval["reference_url"].split(" |OR| ")[1] == "http://wa.internal:9999/f/MachineLearning"
    assert "http://wa.internal:9999/f/programming" in tasks[791].intent
    assert not re.search(r"__[A-Z_]+__", json.dumps([t.raw for t in tasks.values()]))
    assert tasks[638].raw["start_url"] == "http://wa.internal:9999"


def test_start_urls_split_on_and(raw_json: Path, urls: SiteUrls) -> None:
    task = by_id(load_task_configs(raw_json, urls))[165]
    assert task.start_urls == (
        "http://wa.internal:7770/mouth-guard-a.html",
        "http://wa.internal:7770/mouth-guard-b.html",
    )


def test_login_sites_follow_the_storage_state_name(raw_json: Path, urls: SiteUrls) -> None:
    tasks = by_id(load_task_configs(raw_json, urls))
    assert tasks[791].login_sites == ("gitlab", "reddit")
    assert tasks[436].login_sites == ("shopping",)
    assert tasks[7].login_sites == ()  # map: no login


def test_load_directory_of_per_task_files(tmp_path: Path, raw_json: Path, urls: SiteUrls) -> None:
    configs = tmp_path / "config_files"
    configs.mkdir()
    for config in SAMPLE_CONFIGS[:3]:
        (configs / f"{config['task_id']}.json").write_text(json.dumps(config), encoding="utf-8")
    (configs / "test.raw.json").write_text(raw_json.read_text(), encoding="utf-8")  # ignored in a directory
    tasks = load_task_configs(configs, urls)
    assert [t.task_id for t in tasks] == [0, 13, 22]
    single = load_task_configs(configs / "13.json", urls)
    assert [t.task_id for t in single] == [13]
    with pytest.raises(FileNotFoundError):
        load_task_configs(tmp_path / "config_files" / "missing", urls)


def test_missing_site_url_raises_naming_the_variable_or_skips(raw_json: Path) -> None:
    only_shop = SiteUrls(shopping="http://localhost:7770")
    with pytest.raises(MissingSiteUrlError, match=r"task 0 .*WA_SHOPPING_ADMIN"):
        load_task_configs(raw_json, only_shop)
    tasks = load_task_configs(raw_json, only_shop, skip_unavailable=True)
    assert [t.task_id for t in tasks] == [22, 165, 436]
    # A placeholder of a site outside "sites" counts too (task 791 mentions __REDDIT__ in its intent).
    no_reddit = SiteUrls(gitlab="http://localhost:8023")
    with pytest.raises(MissingSiteUrlError, match="WA_REDDIT"):
        parse_task_config(sample(791) | {"sites": ["gitlab"]}, no_reddit)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda c: c.pop("intent"), "'intent' is missing"),
        (lambda c: c.update(task_id="7"), "'task_id' must be int"),
        (lambda c: c.update(sites=["shopping", "amazon"]), "'sites' has unknown site 'amazon'"),
        (lambda c: c["eval"].update(eval_types=["string_match", "vibe_match"]), "'eval.eval_types' has unknown"),
        (lambda c: c["eval"].update(reference_answers=None), "'eval.reference_answers' must be dict"),
        (lambda c: c["eval"]["reference_answers"].update(must_include="2"), "'eval.reference_answers.must_include'"),
        (lambda c: c.update(require_login="yes"), "'require_login' must be bool"),
    ],
)
def test_malformed_config_names_task_and_field(mutate: Any, field: str, urls: SiteUrls) -> None:
    config = sample(13)
    mutate(config)
    with pytest.raises(TaskConfigError, match=f"task (13|<unknown>|config).*{field}"):
        parse_task_config(config, urls)


def test_malformed_program_html_and_url_match_name_the_field(urls: SiteUrls) -> None:
    config = sample(436)
    del config["eval"]["program_html"][0]["required_contents"]
    with pytest.raises(TaskConfigError, match=r"task 436: field 'eval.program_html\[0\].required_contents'"):
        parse_task_config(config, urls)
    config = sample(45)
    config["eval"]["reference_url"] = None
    with pytest.raises(TaskConfigError, match=r"task 45: field 'eval\.reference_url' must be str"):
        parse_task_config(config, urls)


def test_duplicate_task_ids_and_bad_json(tmp_path: Path, urls: SiteUrls) -> None:
    path = tmp_path / "dup.json"
    path.write_text(json.dumps([sample(0), sample(0)]), encoding="utf-8")
    with pytest.raises(TaskConfigError, match=r"task 0 .*'task_id' duplicates"):
        load_task_configs(path, urls)
    path.write_text("[{", encoding="utf-8")
    with pytest.raises(TaskConfigError, match="not valid JSON"):
        load_task_configs(path, urls)


def test_allowed_origins(raw_json: Path) -> None:
    urls = SiteUrls.from_env(ENV | {"WA_EXTRA_ORIGINS": "http://tiles.internal:8080/, https://route.internal:443"})
    tasks = by_id(load_task_configs(raw_json, urls))
    assert allowed_origins(tasks[0], urls) == {
        "http://wa.internal:7780",  # the admin's path (/admin) is not part of the origin
        "http://tiles.internal:8080",
        "https://route.internal",  # default port dropped, as the browser reports it
    }
    assert allowed_origins(tasks[791], SiteUrls.from_env(ENV)) == {
        "http://wa.internal:8023",
        "http://wa.internal:9999",
    }
    assert origin_of("HTTP://Example.COM:80/a?b") == "http://example.com"
    assert origin_of("http://[::1]:8080/x") == "http://[::1]:8080"
