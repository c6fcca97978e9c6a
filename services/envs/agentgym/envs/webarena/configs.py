"""Real-WebArena task configs: site URLs from the environment, `test.raw.json` loading, origins.

WebArena's task files (`config_files/test.raw.json`, or one `N.json` per task) name the sites with
placeholders such as ``__GITLAB__``; a deployment sets where each site lives. Here every site's base
URL comes from an environment variable (``WA_GITLAB=http://gitlab.internal:8023``, see
`SITE_ENV_VARS`), the placeholders of every string in a config are replaced by those URLs, and each
config becomes a checked, immutable `WebArenaTask` the environment can reset to and evaluate.

>>> urls = SiteUrls.from_env()                       # reads WA_SHOPPING, WA_GITLAB, ...
>>> tasks = load_task_configs("test.raw.json", urls, skip_unavailable=True)
>>> allowed_origins(tasks[0], urls)                   # what the browser may visit in that task
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

# Site name (as in a config's "sites") -> environment variable holding its base URL.
SITE_ENV_VARS: dict[str, str] = {
    "shopping": "WA_SHOPPING",
    "shopping_admin": "WA_SHOPPING_ADMIN",
    "reddit": "WA_REDDIT",
    "gitlab": "WA_GITLAB",
    "wikipedia": "WA_WIKIPEDIA",
    "map": "WA_MAP",
    "homepage": "WA_HOMEPAGE",
}
# Site name -> the placeholder WebArena's config files use for its base URL.
PLACEHOLDERS: dict[str, str] = {site: f"__{site.upper()}__" for site in SITE_ENV_VARS}
# Extra origins every task may reach (e.g. the map's tile and routing servers), comma-separated.
EXTRA_ORIGINS_ENV_VAR = "WA_EXTRA_ORIGINS"

# One alternation over all placeholders, longest first (``__SHOPPING_ADMIN__`` before ``__SHOPPING__``).
_PLACEHOLDER_RE = re.compile("|".join(re.escape(p) for p in sorted(PLACEHOLDERS.values(), key=len, reverse=True)))
_SITE_OF_PLACEHOLDER = {placeholder: site for site, placeholder in PLACEHOLDERS.items()}
# WebArena joins several start pages of one task with " |AND| ".
_AND_RE = re.compile(r"\s*\|AND\|\s*")
EVAL_TYPES = frozenset({"string_match", "url_match", "program_html"})


class MissingSiteUrlError(LookupError):
    """A task needs a site whose base URL is not configured (the message names the variable)."""


class TaskConfigError(ValueError):
    """A task config is malformed; the message names the task and the offending field."""


def origin_of(url: str) -> str:
    """The ``scheme://host[:port]`` origin of `url`, lower-cased and without a default port.

    Browsers report ``http://h:80/x`` as ``http://h/x``; normalising both sides the same way lets the
    environment compare request URLs with `allowed_origins` by plain string equality.
    """
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError as error:
        raise ValueError(f"bad port in URL {url!r}") from error
    default = {"http": 80, "https": 443}.get(scheme)
    return f"{scheme}://{host}" if port is None or port == default else f"{scheme}://{host}:{port}"


def _check_base_url(site: str, url: str) -> str:
    """Strip the trailing slash and insist on an absolute http(s) URL (a common set-up slip)."""
    url = url.strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        env_var = SITE_ENV_VARS.get(site, EXTRA_ORIGINS_ENV_VAR)
        raise ValueError(f"{env_var}={url!r} is not an absolute http(s) URL (e.g. http://localhost:7770)")
    return url


@dataclass(frozen=True)
class SiteUrls:
    """Base URL of each WebArena site (``None`` = not deployed here), trailing slash stripped.

    `extra_origins` are further origins every task may reach: WebArena's map site loads tiles and
    routes from servers on other ports, which the environment would otherwise block.
    """

    shopping: str | None = None
    shopping_admin: str | None = None
    reddit: str | None = None
    gitlab: str | None = None
    wikipedia: str | None = None
    map: str | None = None
    homepage: str | None = None
    extra_origins: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for site in SITE_ENV_VARS:
            url = getattr(self, site)
            if url is not None:
                object.__setattr__(self, site, _check_base_url(site, url))
        origins = tuple(origin_of(_check_base_url("extra", o)) for o in self.extra_origins)
        object.__setattr__(self, "extra_origins", origins)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> SiteUrls:
        """Read ``WA_<SITE>`` (unset or empty = site absent) and ``WA_EXTRA_ORIGINS``."""
        urls = {site: environ.get(var) or None for site, var in SITE_ENV_VARS.items()}
        extra = tuple(o for o in re.split(r"[,\s]+", environ.get(EXTRA_ORIGINS_ENV_VAR, "")) if o)
        return cls(**urls, extra_origins=extra)

    def url(self, site: str) -> str:
        """The base URL of `site`; raises `MissingSiteUrlError` naming the variable to set."""
        if site not in SITE_ENV_VARS:
            raise MissingSiteUrlError(f"unknown WebArena site {site!r}; known: {sorted(SITE_ENV_VARS)}")
        url: str | None = getattr(self, site)
        if url is None:
            raise MissingSiteUrlError(
                f"WebArena site {site!r} has no URL: set {SITE_ENV_VARS[site]} to its base URL "
                f"(e.g. {SITE_ENV_VARS[site]}=http://<host>:<port>)"
            )
        return url

    def available(self) -> tuple[str, ...]:
        """The sites that have a URL, in `SITE_ENV_VARS` order."""
        return tuple(site for site in SITE_ENV_VARS if getattr(self, site) is not None)


# Keep the dataclass and the site table in step: one field per site, plus extra_origins.
assert [f.name for f in fields(SiteUrls)] == [*SITE_ENV_VARS, "extra_origins"]


@dataclass(frozen=True)
class WebArenaTask:
    """One WebArena task, placeholders already replaced by this deployment's site URLs.

    `eval` is the config's ``eval`` section as WebArena defines it (``eval_types``,
    ``reference_answers``, ``reference_url``, ``program_html``, ...); `raw` is the whole config.
    """

    task_id: int
    sites: tuple[str, ...]
    start_urls: tuple[str, ...]
    intent: str
    require_login: bool
    storage_state: str | None
    require_reset: bool
    eval: dict[str, Any]
    raw: dict[str, Any]

    @property
    def login_sites(self) -> tuple[str, ...]:
        """The sites to be logged into before the task starts.

        WebArena encodes them in the storage-state file name (``./.auth/gitlab.reddit_state.json``),
        which is not always `sites`: e.g. shopping+reddit tasks log into reddit only, map tasks none.
        """
        if not self.require_login or not self.storage_state:
            return ()
        return _sites_of_storage_state(self.storage_state)


def _sites_of_storage_state(path: str) -> tuple[str, ...]:
    name = Path(path).name
    stem = name.removesuffix("_state.json") if name.endswith("_state.json") else Path(name).stem
    return tuple(s for s in stem.split(".") if s)


def substitute(value: Any, site_urls: SiteUrls) -> Any:
    """`value` with every site placeholder in every string (recursively) replaced by its URL."""
    if isinstance(value, str):
        return _PLACEHOLDER_RE.sub(lambda m: site_urls.url(_SITE_OF_PLACEHOLDER[m.group(0)]), value)
    if isinstance(value, list):
        return [substitute(v, site_urls) for v in value]
    if isinstance(value, dict):
        return {k: substitute(v, site_urls) for k, v in value.items()}
    return value


def _placeholder_sites(value: Any) -> set[str]:
    """The sites whose placeholders occur anywhere in `value`."""
    text = json.dumps(value)
    return {_SITE_OF_PLACEHOLDER[m] for m in _PLACEHOLDER_RE.findall(text)}


class _Checker:
    """Small typed accessors that raise `TaskConfigError` naming the task and field path."""

    def __init__(self, label: str) -> None:
        self.label = label

    def fail(self, path: str, problem: str) -> TaskConfigError:
        return TaskConfigError(f"{self.label}: field {path!r} {problem}")

    def get(self, obj: Mapping[str, Any], path: str, key: str, kind: type | tuple[type, ...]) -> Any:
        full = f"{path}.{key}" if path else key
        if key not in obj:
            raise self.fail(full, "is missing")
        value = obj[key]
        # bool is an int subclass: never accept it where a number or string is meant.
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
            names = "/".join(k.__name__ for k in _as_tuple(kind))
            raise self.fail(full, f"must be {names}, got {type(value).__name__} {value!r:.80}")
        return value

    def strings(self, value: Any, path: str) -> list[str]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail(path, f"must be a list of strings, got {value!r:.80}")
        return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _check_eval(check: _Checker, section: Mapping[str, Any]) -> None:
    """The parts of ``eval`` that the chosen ``eval_types`` read must be present and well-typed."""
    eval_types = check.strings(check.get(section, "eval", "eval_types", list), "eval.eval_types")
    if not eval_types:
        raise check.fail("eval.eval_types", "is empty")
    for kind in eval_types:
        if kind not in EVAL_TYPES:
            raise check.fail("eval.eval_types", f"has unknown type {kind!r}; known: {sorted(EVAL_TYPES)}")
    if "string_match" in eval_types:
        answers = check.get(section, "eval", "reference_answers", dict)
        if not answers:
            raise check.fail("eval.reference_answers", "is empty")
        for approach, value in answers.items():
            path = f"eval.reference_answers.{approach}"
            if approach == "exact_match":
                check.get(answers, "eval.reference_answers", approach, str)
            elif approach == "must_include":
                check.strings(value, path)
            elif approach == "fuzzy_match":
                if not isinstance(value, str):
                    check.strings(value, path)
            else:
                raise check.fail(path, "is not exact_match, must_include or fuzzy_match")
    if "url_match" in eval_types and not check.get(section, "eval", "reference_url", str).strip():
        raise check.fail("eval.reference_url", "is empty")
    if "program_html" in eval_types:
        targets = check.get(section, "eval", "program_html", list)
        if not targets:
            raise check.fail("eval.program_html", "is empty")
        for i, target in enumerate(targets):
            path = f"eval.program_html[{i}]"
            if not isinstance(target, dict):
                raise check.fail(path, "must be an object")
            check.get(target, path, "url", str)
            check.get(target, path, "locator", str)
            if "prep_actions" in target:
                check.strings(target["prep_actions"], f"{path}.prep_actions")
            required = check.get(target, path, "required_contents", dict)
            if "exact_match" in required:
                check.get(required, f"{path}.required_contents", "exact_match", str)
            elif "must_include" in required:
                check.strings(required["must_include"], f"{path}.required_contents.must_include")
            else:
                raise check.fail(f"{path}.required_contents", "needs exact_match or must_include")


def parse_task_config(config: Any, site_urls: SiteUrls, *, label: str = "task config") -> WebArenaTask:
    """Check one WebArena config (a dict as in `test.raw.json`) and substitute the site URLs.

    Raises `TaskConfigError` for a malformed config and `MissingSiteUrlError` when one of its sites
    (or a placeholder it uses) has no URL.
    """
    check = _Checker(label)
    if not isinstance(config, dict):
        raise check.fail("<config>", f"must be an object, got {type(config).__name__}")
    task_id = check.get(config, "", "task_id", int)
    check.label = f"task {task_id}" + (f" ({label})" if label != "task config" else "")
    sites = tuple(check.strings(check.get(config, "", "sites", list), "sites"))
    if not sites:
        raise check.fail("sites", "is empty")
    for site in sites:
        if site not in SITE_ENV_VARS:
            raise check.fail("sites", f"has unknown site {site!r}; known: {sorted(SITE_ENV_VARS)}")
    check.get(config, "", "start_url", str)
    check.get(config, "", "intent", str)
    require_login = check.get(config, "", "require_login", bool) if "require_login" in config else False
    storage_state = config.get("storage_state")
    if storage_state is not None and not isinstance(storage_state, str):
        raise check.fail("storage_state", f"must be a string or null, got {storage_state!r:.80}")
    if storage_state:
        for site in _sites_of_storage_state(storage_state):
            if site not in SITE_ENV_VARS:
                raise check.fail("storage_state", f"names unknown site {site!r}")
    require_reset = check.get(config, "", "require_reset", bool) if "require_reset" in config else False
    _check_eval(check, check.get(config, "", "eval", dict))

    for site in sorted(set(sites) | _placeholder_sites(config)):
        try:
            site_urls.url(site)
        except MissingSiteUrlError as error:
            raise MissingSiteUrlError(f"{check.label}: {error}") from None
    raw: dict[str, Any] = substitute(config, site_urls)
    start_urls = tuple(u for u in _AND_RE.split(raw["start_url"].strip()) if u)
    if not start_urls:
        raise check.fail("start_url", "is empty")
    return WebArenaTask(
        task_id=task_id,
        sites=sites,
        start_urls=start_urls,
        intent=raw["intent"],
        require_login=require_login,
        storage_state=storage_state,
        require_reset=require_reset,
        eval=raw["eval"],
        raw=raw,
    )


def load_task_configs(
    path: str | os.PathLike[str], site_urls: SiteUrls, *, skip_unavailable: bool = False
) -> list[WebArenaTask]:
    """Load WebArena task configs, sorted by task id.

    `path` is WebArena's `test.raw.json` (a JSON list of configs), a single config file, or a
    directory of per-task ``N.json`` files (other files there, such as `test.raw.json`, are ignored).
    With `skip_unavailable`, tasks that need a site without a URL are left out instead of raising
    `MissingSiteUrlError`, so a deployment with only some sites can still use their tasks.
    """
    path = Path(path)
    entries: list[tuple[str, Any]] = []
    if path.is_dir():
        files = sorted((p for p in path.glob("*.json") if p.stem.isdigit()), key=lambda p: int(p.stem))
        if not files:
            raise FileNotFoundError(f"no per-task N.json configs in {path}")
        entries = [(p.name, _read_json(p)) for p in files]
    else:
        data = _read_json(path)
        if isinstance(data, list):
            entries = [(f"{path.name}[{i}]", item) for i, item in enumerate(data)]
        else:
            entries = [(path.name, data)]

    tasks: list[WebArenaTask] = []
    seen: dict[int, str] = {}
    for label, config in entries:
        try:
            task = parse_task_config(config, site_urls, label=label)
        except MissingSiteUrlError:
            if skip_unavailable:
                continue
            raise
        if task.task_id in seen:
            raise TaskConfigError(f"task {task.task_id} ({label}): field 'task_id' duplicates {seen[task.task_id]}")
        seen[task.task_id] = label
        tasks.append(task)
    return sorted(tasks, key=lambda t: t.task_id)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise TaskConfigError(f"{path}: not valid JSON ({error})") from error


def allowed_origins(task: WebArenaTask, site_urls: SiteUrls) -> frozenset[str]:
    """The origins the browser may load in `task`: its sites' plus `site_urls.extra_origins`.

    Everything else (the open internet, sites of other tasks) is blocked by the environment, so an
    agent cannot look answers up elsewhere or change state it is not evaluated on.
    """
    return frozenset(origin_of(site_urls.url(site)) for site in task.sites) | frozenset(site_urls.extra_origins)
