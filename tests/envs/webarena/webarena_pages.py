"""Helpers for the WebArena config/evaluator/login tests: loopback sites, saved pages, Chromium.

`LoopbackSite` is a real HTTP server on 127.0.0.1 (stdlib `http.server` in a thread) that serves a
directory of saved pages (``pages/<site>/...``, ``index.html`` per path, as the real sites' URLs
look) plus scripted routes: the shop's REST API, a login form, a `/v1/completions` judge.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from playwright.async_api import Browser, async_playwright

PAGES = Path(__file__).parent / "pages"
CHROMIUM = os.environ.get("AGENTGYM_CHROMIUM", "/usr/bin/chromium")


@dataclass
class Request:
    """What a scripted route sees of a request."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body or b"null")

    def form(self) -> dict[str, str]:
        return {k: v[0] for k, v in parse_qs(self.body.decode()).items()}


@dataclass
class Reply:
    """A scripted route's answer."""

    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


def json_reply(value: Any, status: int = 200) -> Reply:
    return Reply(status, json.dumps(value).encode(), {"Content-Type": "application/json"})


def html_reply(text: str, status: int = 200, headers: dict[str, str] | None = None) -> Reply:
    return Reply(status, text.encode(), {"Content-Type": "text/html; charset=utf-8", **(headers or {})})


def redirect(location: str, headers: dict[str, str] | None = None) -> Reply:
    return Reply(302, b"", {"Location": location, **(headers or {})})


Route = Callable[[Request], Reply]


class LoopbackSite:
    """A site on a free loopback port: static files under `root` plus ``(METHOD, path)`` routes.

    Every request is recorded in `requests` (method, path), routed ones in full in `routed`, so
    tests can check what was asked.
    """

    def __init__(self, root: Path | None = None, routes: dict[tuple[str, str], Route] | None = None) -> None:
        self.root = root
        self.routes = dict(routes or {})
        self.requests: list[tuple[str, str]] = []
        self.routed: list[Request] = []
        site = self

        class Handler(SimpleHTTPRequestHandler):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, directory=str(site.root or PAGES / "_none"), **kwargs)

            def _route(self, method: str) -> bool:
                parts = urlsplit(self.path)
                site.requests.append((method, parts.path))
                route = site.routes.get((method, parts.path))
                if route is None:
                    return False
                length = int(self.headers.get("Content-Length") or 0)
                request = Request(
                    method, parts.path, parse_qs(parts.query), dict(self.headers.items()), self.rfile.read(length)
                )
                site.routed.append(request)
                reply = route(request)
                self.send_response(reply.status)
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(reply.body)))
                self.end_headers()
                self.wfile.write(reply.body)
                return True

            def do_GET(self) -> None:
                if not self._route("GET"):
                    super().do_GET()

            def do_POST(self) -> None:
                if not self._route("POST"):
                    self.send_error(404)

            def log_message(self, format: str, *args: Any) -> None:  # quiet test output
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def __enter__(self) -> LoopbackSite:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


@asynccontextmanager
async def chromium() -> AsyncIterator[Browser]:
    """Debian's Chromium, headless, through async Playwright."""
    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            await browser.close()


def completions_server(verdict: Callable[[str], str]) -> LoopbackSite:
    """An OpenAI-style ``/v1/completions`` stub replying ``verdict(prompt)`` (requests in `routed`)."""

    def complete(request: Request) -> Reply:
        text = verdict(request.json()["prompt"])
        return json_reply({"object": "text_completion", "choices": [{"index": 0, "text": text}]})

    return LoopbackSite(routes={("POST", "/v1/completions"): complete})


def wa_config(
    task_id: int,
    sites: list[str],
    start_url: str,
    intent: str,
    eval_section: dict[str, Any],
    *,
    storage_state: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A config shaped like an entry of WebArena's `test.raw.json`."""
    eval_full = {"reference_answers": None, "reference_url": "", "program_html": [], **eval_section}
    return {
        "sites": sites,
        "task_id": task_id,
        "require_login": True,
        "storage_state": storage_state,
        "start_url": start_url,
        "geolocation": None,
        "intent_template": intent,
        "instantiation_dict": {},
        "intent": intent,
        "require_reset": False,
        "eval": eval_full,
        "intent_template_id": 1000 + task_id,
        **extra,
    }


# Modelled on real WebArena tasks (same shapes, placeholders, separators and quirks).
SAMPLE_CONFIGS: list[dict[str, Any]] = [
    wa_config(
        0,
        ["shopping_admin"],
        "__SHOPPING_ADMIN__",
        "What is the top-1 best-selling product in 2022",
        {"eval_types": ["string_match"], "reference_answers": {"exact_match": "Quest Lumaflex™ Band"}},
        storage_state="./.auth/shopping_admin_state.json",
    ),
    wa_config(
        13,
        ["shopping_admin"],
        "__SHOPPING_ADMIN__",
        'Tell me the number of reviews that our store received by far that mention term "zoe"',
        {"eval_types": ["string_match"], "reference_answers": {"must_include": ["2"]}},
        storage_state="./.auth/shopping_admin_state.json",
    ),
    wa_config(
        22,
        ["shopping"],
        "__SHOPPING__/sony-dsc-w800.html",
        "List out reviewers, if exist, who mention about under water photo",
        {
            "eval_types": ["string_match"],
            "reference_answers": {"fuzzy_match": "N/A"},
            "string_note": "There is no review about under water photo",
        },
        storage_state="./.auth/shopping_state.json",
    ),
    wa_config(
        45,
        ["gitlab"],
        "__GITLAB__",
        "Checkout the issues of a11yproject that are open, sorted by the oldest first",
        {
            "eval_types": ["url_match"],
            "reference_url": "__GITLAB__/a11yproject/a11yproject.com/-/issues/?sort=created_asc&state=opened",
            "url_note": "GOLD in PRED",
        },
        storage_state="./.auth/gitlab_state.json",
    ),
    wa_config(
        165,
        ["shopping"],
        "__SHOPPING__/mouth-guard-a.html |AND| __SHOPPING__/mouth-guard-b.html",
        "Compare the two mouth guards I have open",
        {"eval_types": ["string_match"], "reference_answers": {"must_include": ["65 |OR| 3"]}},
        storage_state="./.auth/shopping_state.json",
    ),
    wa_config(
        436,
        ["shopping"],
        "__SHOPPING__",
        "Reorder the mouth guard I bought in spring",
        {
            "eval_types": ["program_html"],
            "program_html": [
                {
                    "url": "func:shopping_get_latest_order_url()",
                    "locator": 'document.querySelector(".order-details-items.ordered").outerText',
                    "required_contents": {"must_include": ["B07DFJ5XKH"]},
                }
            ],
        },
        storage_state="./.auth/shopping_state.json",
    ),
    wa_config(
        604,
        ["reddit"],
        "__REDDIT__",
        "Open a forum about deep learning",
        {
            "eval_types": ["url_match"],
            "reference_url": "__REDDIT__/f/deeplearning |OR| __REDDIT__/f/MachineLearning",
            "url_note": "GOLD in PRED",
        },
        storage_state="./.auth/reddit_state.json",
    ),
    wa_config(
        638,
        ["reddit"],
        "__REDDIT__",
        "Post in the most appropriate subreddit and ask for recommendations for must-have products around $30",
        {
            "eval_types": ["url_match", "program_html"],
            "reference_url": "__REDDIT__/f/BuyItForLife",
            "program_html": [
                {
                    "url": "func:reddit_get_post_url('__last_url__')",
                    "locator": "document.querySelector('.submission__inner').outerText",
                    "required_contents": {"must_include": ["30", "must-have", "product", "life"]},
                }
            ],
        },
        storage_state="./.auth/reddit_state.json",
    ),
    wa_config(
        791,
        ["gitlab", "reddit"],
        "__GITLAB__",
        "Share the README of my timeit project on the forum __REDDIT__/f/programming",
        {"eval_types": ["string_match"], "reference_answers": {"must_include": ["timeit"]}},
        storage_state="./.auth/gitlab.reddit_state.json",
    ),
    wa_config(
        7,
        ["map"],
        "__MAP__",
        "Tell me the full address of all international airports within a driving distance of 50 km to CMU",
        {"eval_types": ["string_match"], "reference_answers": {"fuzzy_match": ["Pittsburgh International Airport"]}},
    ),
]
