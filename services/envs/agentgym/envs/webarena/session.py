"""One episode's browser: an isolated context, its tabs, the navigation allowlist, and actions.

Everything here runs on the `BrowserHost` loop. A `BrowserSession`:

* opens its own `BrowserContext` (downloads refused, service workers blocked) with a route that lets
  requests through only to the allowed origins (the task's sites, the loopback task server) and to
  ``data:``/``blob:``/``about:`` URLs; everything else is aborted and remembered, so the next
  observation says which navigation was blocked. ``file://`` is never allowed;
* keeps at most `max_pages` tabs: a page opened beyond that (``target=_blank`` floods) is closed;
* executes parsed `BrowserAction`s on the element ids that the last observation printed (`ElementIds`)
  (real mouse and keyboard input through Playwright, positions from CDP), and waits for the page
  to settle: the load event of a navigation, no requests in flight, and a short window with no DOM
  mutations, all event driven, each bounded;
* renders observations: open tabs, the accessibility tree (`axtree`), URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from playwright.async_api import BrowserContext, CDPSession, Page, Route
from playwright.async_api import Error as PlaywrightError

from agentgym.envs.webarena.actions import BrowserAction
from agentgym.envs.webarena.axtree import AXTree, ElementIds, build_tree
from agentgym.envs.webarena.browser import BrowserCrashedError, BrowserHost
from agentgym.envs.webarena.configs import origin_of

log = logging.getLogger(__name__)

# Resolves when the document has had no mutations for `quiet` ms (or after `cap` ms at most).
_DOM_QUIET_JS = """([quiet, cap]) => new Promise((resolve) => {
  let timer = null;
  const finish = () => { observer.disconnect(); clearTimeout(limit); resolve(true); };
  const observer = new MutationObserver(() => { clearTimeout(timer); timer = setTimeout(finish, quiet); });
  observer.observe(document, {subtree: true, childList: true, attributes: true, characterData: true});
  timer = setTimeout(finish, quiet);
  const limit = setTimeout(finish, cap);
})"""
_PASSTHROUGH_SCHEMES = frozenset({"data", "blob", "about"})


class ActionError(ValueError):
    """An action that is well formed but cannot be carried out on this page (unknown id, hidden)."""


class NoOpenTabError(ActionError):
    """Every tab of the episode is closed: the page closed itself, or the browser is going down."""


@dataclass(frozen=True)
class SessionLimits:
    max_pages: int = 8
    action_timeout_s: float = 10.0
    navigation_timeout_s: float = 30.0
    settle_quiet_ms: int = 25
    settle_cap_ms: int = 2_000
    max_observation_chars: int = 16_000
    viewport: tuple[int, int] = (1280, 720)
    # Contexts kept open and ready (a blank tab each), so a reset skips the context and renderer
    # start-up (~150-200 ms); replenished in the background after each take.
    spare_sessions: int = 1


@dataclass
class PageView:
    """What an observation shows: tabs, the current page's tree and URL."""

    url: str
    title: str
    tabs: list[str]
    tree: AXTree
    notes: list[str] = field(default_factory=list)

    def render(self, max_chars: int | None) -> str:
        tab_line = " | ".join(self.tabs)
        parts = [tab_line, "", self.tree.text(max_chars) or "(the page is empty)"]
        return "\n".join(parts)


class BrowserSession:
    """One episode's context and tabs. Create with `open`; every method runs on the host loop."""

    def __init__(self, host: BrowserHost, context: BrowserContext, generation: int, limits: SessionLimits) -> None:
        self.host = host
        self.context = context
        self.generation = generation
        self.limits = limits
        self.allowed_origins: set[str] = set()
        self.blocked: list[str] = []
        self.notes: list[str] = []
        self.active: Page | None = None
        self._cdp: dict[int, CDPSession] = {}
        self._inflight: dict[int, int] = {}
        self._idle: dict[int, asyncio.Event] = {}  # set while a page has no request in flight
        self._last_ids: frozenset[int] = frozenset()  # element ids of the last observation
        self._element_ids = ElementIds()

    # -- lifecycle -------------------------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        host: BrowserHost,
        allowed_origins: set[str] | frozenset[str],
        limits: SessionLimits | None = None,
        storage_state: str | dict[str, Any] | None = None,
    ) -> BrowserSession:
        """A new session; a spare one when available (contexts with stored logins are always new)."""
        limits = limits or SessionLimits()
        session = None
        if storage_state is None and limits.spare_sessions > 0:
            session = _take_spare(host, limits)
            _replenish(host, limits)
        if session is None:
            session = await cls._create(host, limits, storage_state)
        session.allowed_origins = {origin_of(origin) for origin in allowed_origins}
        return session

    @classmethod
    async def _create(
        cls, host: BrowserHost, limits: SessionLimits, storage_state: str | dict[str, Any] | None
    ) -> BrowserSession:
        width, height = limits.viewport
        options: dict[str, Any] = {
            "accept_downloads": False,
            "service_workers": "block",
            "viewport": {"width": width, "height": height},
        }
        if storage_state is not None:
            options["storage_state"] = storage_state
        context, generation = await host.new_context(**options)
        session = cls(host, context, generation, limits)
        context.set_default_timeout(limits.action_timeout_s * 1000)
        context.set_default_navigation_timeout(limits.navigation_timeout_s * 1000)
        await context.route("**/*", session._route)
        context.on("page", session._on_page)
        session.active = await context.new_page()
        session._watch(session.active)
        return session

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.context.close()

    def check_alive(self) -> None:
        if not self.host.alive(self.generation):
            raise BrowserCrashedError("the browser of this episode crashed or was closed")

    # -- allowlist, tabs, settling -------------------------------------------------------------------

    def allows(self, url: str) -> bool:
        scheme = urlsplit(url).scheme.lower()
        if scheme in _PASSTHROUGH_SCHEMES:
            return True
        if scheme not in ("http", "https"):
            return False
        try:
            return origin_of(url) in self.allowed_origins
        except ValueError:  # a malformed port: not a URL of any allowed site
            return False

    async def _route(self, route: Route) -> None:
        url = route.request.url
        if self.allows(url):
            await route.continue_()
            return
        if route.request.is_navigation_request():
            self.blocked.append(url)
        await route.abort("blockedbyclient")

    def _on_page(self, page: Page) -> None:
        if page in self.context.pages and len(self.context.pages) > self.limits.max_pages:
            self.notes.append(f"A new tab was closed: at most {self.limits.max_pages} tabs are allowed.")
            _in_background(page.close())
            return
        self._watch(page)
        self.active = page  # a tab opened by the page (target=_blank) takes the focus, as in a browser

    def _watch(self, page: Page) -> None:
        key = id(page)
        if key in self._inflight:
            return
        self._inflight[key] = 0
        idle = self._idle[key] = asyncio.Event()
        idle.set()

        def started(_request: Any) -> None:
            self._inflight[key] = self._inflight.get(key, 0) + 1
            idle.clear()

        def ended(_request: Any) -> None:
            self._inflight[key] = max(0, self._inflight.get(key, 0) - 1)
            if self._inflight[key] == 0:
                idle.set()

        page.on("request", started)
        page.on("requestfinished", ended)
        page.on("requestfailed", ended)
        page.on("close", lambda _page: self._forget(key))

    def _forget(self, key: int) -> None:
        self._inflight.pop(key, None)
        self._idle.pop(key, None)
        self._cdp.pop(key, None)

    def pages(self) -> list[Page]:
        return [page for page in self.context.pages if not page.is_closed()]

    def page(self) -> Page:
        if self.active is None or self.active.is_closed():
            pages = self.pages()
            if not pages:
                raise NoOpenTabError("no tab is open; use new_tab or goto [url]")
            self.active = pages[-1]
        return self.active

    async def settle(self, page: Page | None = None) -> None:
        """Wait (bounded) until the page has loaded, its requests are done and its DOM is quiet."""
        page = page or self.page()
        cap_s = self.limits.settle_cap_ms / 1000
        for _ in range(3):
            with contextlib.suppress(PlaywrightError, TimeoutError):
                await page.wait_for_load_state("load", timeout=self.limits.navigation_timeout_s * 1000)
            idle = self._idle.get(id(page))
            if idle is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(idle.wait(), cap_s)
            try:
                await page.evaluate(_DOM_QUIET_JS, [self.limits.settle_quiet_ms, self.limits.settle_cap_ms])
                return
            except PlaywrightError:
                # The document navigated away while we waited (a click on a link): settle the new one.
                continue

    async def goto(self, url: str, page: Page | None = None) -> None:
        if not self.allows(url):
            self.blocked.append(url)
            return
        page = page or self.page()
        try:
            await page.goto(url, wait_until="load")
        except PlaywrightError as error:
            if self.blocked and self.blocked[-1] == url:
                return
            raise ActionError(f"could not open {url}: {str(error).splitlines()[0]}") from error

    # -- observation ---------------------------------------------------------------------------------

    async def cdp(self, page: Page) -> CDPSession:
        key = id(page)
        session = self._cdp.get(key)
        if session is None:
            session = self._cdp[key] = await self.context.new_cdp_session(page)
        return session

    async def view(self) -> PageView:
        self.check_alive()
        page = self.page()
        session = await self.cdp(page)
        raw = await session.send("Accessibility.getFullAXTree")
        for _ in range(3):
            # A document still loading has a `busy` root and no content yet: wait for it.
            if not _busy(raw.get("nodes", [])):
                break
            await self.settle(page)
            raw = await session.send("Accessibility.getFullAXTree")
        tree = self._element_ids.number(build_tree(raw.get("nodes", [])), id(page))
        self._last_ids = tree.ids
        tabs = []
        for index, tab in enumerate(self.pages()):
            with contextlib.suppress(PlaywrightError):
                title = await tab.title()
                tabs.append(f"Tab {index}{' (current)' if tab is page else ''}: {title}")
        notes = [f"Navigation to {url} was blocked: it is outside this task's sites." for url in self.blocked]
        notes += self.notes
        self.blocked.clear()
        self.notes = []
        return PageView(url=page.url, title=await page.title(), tabs=tabs, tree=tree, notes=notes)

    # -- actions -------------------------------------------------------------------------------------

    async def _center(self, page: Page, node_id: int) -> tuple[float, float]:
        backend_id = self._element_ids.backend_id(node_id, id(page))
        if node_id not in self._last_ids or backend_id is None:
            raise ActionError(f"there is no element [{node_id}] on the page; use an id from the current page")
        session = await self.cdp(page)
        try:
            with contextlib.suppress(PlaywrightError):
                await session.send("DOM.scrollIntoViewIfNeeded", {"backendNodeId": backend_id})
            quads = (await session.send("DOM.getContentQuads", {"backendNodeId": backend_id})).get("quads", [])
        except PlaywrightError as error:
            raise ActionError(f"element [{node_id}] is no longer on the page") from error
        if not quads:
            raise ActionError(f"element [{node_id}] is not visible, so it cannot be used")
        quad = quads[0]
        xs, ys = quad[0::2], quad[1::2]
        return sum(xs) / 4, sum(ys) / 4

    async def execute(self, action: BrowserAction) -> None:
        """Carry out one action; raises ActionError when it cannot be done on this page."""
        self.check_alive()
        page = self.page()
        match action.kind:
            case "click":
                assert action.element_id is not None
                x, y = await self._center(page, action.element_id)
                await page.mouse.click(x, y)
            case "hover":
                assert action.element_id is not None
                x, y = await self._center(page, action.element_id)
                await page.mouse.move(x, y)
            case "type":
                assert action.element_id is not None
                x, y = await self._center(page, action.element_id)
                await page.mouse.click(x, y)
                # Replace what the field holds: agents mean "the field says <text>".
                await page.keyboard.press("Control+a")
                await page.keyboard.press("Delete")
                await page.keyboard.type(action.text)
                if action.press_enter:
                    await page.keyboard.press("Enter")
            case "press":
                try:
                    await page.keyboard.press(action.keys)
                except PlaywrightError as error:
                    raise ActionError(f"unknown key combination {action.keys!r} (e.g. Enter, Control+a)") from error
            case "scroll":
                height = (page.viewport_size or {"height": self.limits.viewport[1]})["height"]
                await page.mouse.wheel(0, height if action.direction == "down" else -height)
            case "new_tab":
                if len(self.pages()) >= self.limits.max_pages:
                    raise ActionError(f"at most {self.limits.max_pages} tabs can be open")
                self.active = await self.context.new_page()
            case "tab_focus":
                pages = self.pages()
                if not 0 <= action.tab_index < len(pages):
                    raise ActionError(f"there is no tab {action.tab_index}; tabs are 0..{len(pages) - 1}")
                self.active = pages[action.tab_index]
                await self.active.bring_to_front()
            case "close_tab":
                await page.close()
                pages = self.pages()
                self.active = pages[-1] if pages else await self.context.new_page()
            case "goto":
                if urlsplit(action.url).scheme.lower() not in ("http", "https"):
                    raise ActionError(f"only http(s) URLs can be opened, not {action.url!r}")
                await self.goto(action.url, page)
            case "go_back":
                await page.go_back(wait_until="load")
            case "go_forward":
                await page.go_forward(wait_until="load")
            case "stop":
                return
        await self.settle(self.page())


def _busy(nodes: list[dict[str, Any]]) -> bool:
    """Whether the tree's root document is marked busy (still loading)."""
    for node in nodes:
        if not node.get("parentId"):
            return any(
                p.get("name") == "busy" and (p.get("value") or {}).get("value") for p in node.get("properties", [])
            )
    return False


# Spare sessions per (host, limits); only touched on the host's loop.
_spares: dict[tuple[int, SessionLimits], list[BrowserSession]] = {}
_refilling: set[tuple[int, SessionLimits]] = set()


def _take_spare(host: BrowserHost, limits: SessionLimits) -> BrowserSession | None:
    spares = _spares.get((id(host), limits), [])
    while spares:
        session = spares.pop()
        if host.alive(session.generation) and session.pages():  # its blank tab may have closed meanwhile
            return session
        _in_background(session.close())
    return None


def _replenish(host: BrowserHost, limits: SessionLimits) -> None:
    key = (id(host), limits)
    if key in _refilling:
        return
    _refilling.add(key)

    async def refill() -> None:
        try:
            spares = _spares.setdefault(key, [])
            while len(spares) < limits.spare_sessions and host.accepting:
                spares.append(await BrowserSession._create(host, limits, None))
        except Exception as error:  # a spare is an optimisation: the next reset opens its own
            log.debug("could not prepare a spare browser context: %s", error)
        finally:
            _refilling.discard(key)

    _in_background(refill())


_background_tasks: set[asyncio.Future[Any]] = set()


def _in_background(awaitable: Awaitable[Any]) -> None:
    """Run `awaitable` on the loop without waiting; keep a reference until it is done."""
    task = asyncio.ensure_future(awaitable)
    _background_tasks.add(task)
    task.add_done_callback(_background_tasks.discard)
