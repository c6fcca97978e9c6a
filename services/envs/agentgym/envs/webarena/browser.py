"""One Chromium per service process, driven by async Playwright on a background event loop.

The environment interface is synchronous (the service runs episodes on worker threads), while
Playwright's sync API binds a browser to the thread that started it. So a `BrowserHost` owns one
thread running an asyncio loop with async Playwright and one Chromium; episodes submit coroutines
to it with `BrowserHost.call` and wait. Each episode gets its own `BrowserContext` (cookies,
storage and cache isolated); Chromium starts a renderer per site as it needs one.

Crashes: when Chromium disconnects (killed, out of memory) the host marks that browser generation
dead; contexts from it raise `BrowserCrashedError` (the service ends those episodes as failed) and
the next `new_context` launches a fresh browser. The Playwright driver is restarted as well when
it went down with the browser. Each Chromium gets its own `TMPDIR` (`scratch_dirs`), removed once it has
gone: what a killed browser leaves there (its `org.chromium.Chromium.*` singleton folder) goes too.

Settings come from the environment's keyword settings (`BrowserSettings`): the Chromium binary
(``AGENTGYM_CHROMIUM``, default Debian's ``/usr/bin/chromium``), headless, and the launch flags.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from playwright.async_api import Browser, BrowserContext, Playwright, async_playwright

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_CHROMIUM = "/usr/bin/chromium"
# Flags for a quiet, lean, headless browser in a container: no background traffic (updates,
# safe-browsing, metrics), no GPU process work, /dev/shm (often 64 MB in containers) not used for
# shared memory, no first-run or default-app set-up.
BASE_FLAGS: tuple[str, ...] = (
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-domain-reliability",
    "--disable-sync",
    "--disable-extensions",
    "--disable-breakpad",
    "--disable-client-side-phishing-detection",
    "--disable-features=Translate,MediaRouter,OptimizationHints,InterestFeedContentSuggestions",
    "--disable-dev-shm-usage",
    "--disable-gpu",
    "--metrics-recording-only",
    "--mute-audio",
    "--no-first-run",
    "--no-default-browser-check",
    "--password-store=basic",
    "--use-mock-keychain",
)


class BrowserCrashedError(RuntimeError):
    """The browser behind an episode went away; the episode cannot go on (a fresh browser follows)."""


@dataclass(frozen=True)
class BrowserSettings:
    executable_path: str = ""
    headless: bool = True
    extra_args: tuple[str, ...] = ()
    launch_timeout_s: float = 30.0

    def chromium(self) -> str:
        return self.executable_path or os.environ.get("AGENTGYM_CHROMIUM", DEFAULT_CHROMIUM)

    def args(self) -> list[str]:
        flags = list(BASE_FLAGS)
        # Chromium refuses to start its sandbox as root (containers): run without it there.
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            flags.append("--no-sandbox")
        return flags + list(self.extra_args)


class BrowserHost:
    """A background event loop with one Playwright driver and one Chromium, relaunched on crash."""

    def __init__(self, settings: BrowserSettings | None = None) -> None:
        self.settings = settings or BrowserSettings()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="browser-host", daemon=True)
        self._thread.start()
        self._playwright: Playwright | None = None
        self._browser: Browser | None = None
        self._launching: asyncio.Lock | None = None
        self._gone: dict[int, asyncio.Event] = {}  # set when that generation's browser disconnects
        self.generation = 0  # increments with every browser launch
        self.scratch_dirs: dict[int, str] = {}  # each live generation's TMPDIR
        self.launches = 0
        self.crashes = 0
        self._closed = False
        self._closing = False

    @property
    def accepting(self) -> bool:
        """False once shutdown began (no new contexts, e.g. spares, should be opened)."""
        return not (self._closing or self._closed)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    # -- calls from other threads ------------------------------------------------------------------

    def call(self, fn: Callable[[], Awaitable[T]], timeout: float | None = None) -> T:
        """Run the coroutine `fn()` on the browser loop and wait for its result (or `timeout`)."""
        if self._closed:
            raise RuntimeError("the browser host is closed")
        future = asyncio.run_coroutine_threadsafe(self._invoke(fn), self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"browser call did not finish within {timeout:g}s") from None

    @staticmethod
    async def _invoke(fn: Callable[[], Awaitable[T]]) -> T:
        return await fn()

    # -- on the loop -------------------------------------------------------------------------------

    async def browser(self) -> tuple[Browser, int]:
        """The live browser and its generation, launching one when there is none (or it crashed)."""
        if self._launching is None:
            self._launching = asyncio.Lock()
        async with self._launching:
            if self._browser is not None and self._browser.is_connected():
                return self._browser, self.generation
            if self._playwright is None:
                self._playwright = await async_playwright().start()
            scratch_dir = tempfile.mkdtemp(prefix="agentgym-chromium-")
            try:
                try:
                    browser = await self._launch(scratch_dir)
                except Exception:
                    # The driver may have died with the browser: restart it once.
                    with contextlib.suppress(Exception):
                        await self._playwright.stop()
                    self._playwright = await async_playwright().start()
                    browser = await self._launch(scratch_dir)
            except BaseException:
                shutil.rmtree(scratch_dir, ignore_errors=True)
                raise
            self.generation += 1
            self.launches += 1
            generation = self.generation
            self.scratch_dirs[generation] = scratch_dir
            self._gone[generation] = asyncio.Event()
            browser.on("disconnected", lambda _browser: self._on_disconnect(generation))
            self._browser = browser
            log.info("Chromium launched (generation %d)", generation)
            return browser, generation

    async def _launch(self, scratch_dir: str) -> Browser:
        assert self._playwright is not None
        return await self._playwright.chromium.launch(
            executable_path=self.settings.chromium(),
            env={**os.environ, "TMPDIR": scratch_dir},
            headless=self.settings.headless,
            args=self.settings.args(),
            timeout=self.settings.launch_timeout_s * 1000,
            handle_sigint=False,
            handle_sigterm=False,
            handle_sighup=False,
        )

    def _on_disconnect(self, generation: int) -> None:
        scratch_dir = self.scratch_dirs.pop(generation, None)
        if scratch_dir is not None:
            shutil.rmtree(scratch_dir, ignore_errors=True)
        gone = self._gone.pop(generation, None)
        if gone is not None:
            gone.set()
        if generation == self.generation and self.accepting:
            self.crashes += 1
            log.warning("Chromium (generation %d) disconnected; the next episode relaunches it", generation)

    def alive(self, generation: int) -> bool:
        """Whether the browser of `generation` is still the live one."""
        return generation == self.generation and self._browser is not None and self._browser.is_connected()

    async def went_away(self, generation: int, within_s: float) -> bool:
        """Whether the browser of `generation` is gone, waiting up to `within_s` for its disconnect.

        When Chromium dies, Playwright closes its pages and then the browser in separate messages: an
        episode can see its tabs vanish (or a call fail) a moment before the browser reads as
        disconnected. Waiting briefly for the disconnect tells a crash from a page's own doing.
        """
        if not self.alive(generation):
            return True
        gone = self._gone.get(generation)
        if gone is None:
            return not self.alive(generation)
        try:
            await asyncio.wait_for(gone.wait(), within_s)
        except TimeoutError:
            return not self.alive(generation)
        return True

    async def new_context(self, **options: Any) -> tuple[BrowserContext, int]:
        """A fresh isolated context on the live browser, and that browser's generation."""
        browser, generation = await self.browser()
        try:
            context = await browser.new_context(**options)
        except Exception as error:
            if browser.is_connected():
                raise
            # Died between the check and the call: one retry on a fresh browser.
            log.warning("Chromium died while opening a context (%s); relaunching", error)
            browser, generation = await self.browser()
            context = await browser.new_context(**options)
        return context, generation

    async def browser_pid(self) -> int | None:
        """The browser process id (from Chromium itself), for tests and memory accounting."""
        browser, _ = await self.browser()
        session = await browser.new_browser_cdp_session()
        try:
            info = await session.send("SystemInfo.getProcessInfo")
        finally:
            with contextlib.suppress(Exception):
                await session.detach()
        for process in info.get("processInfo", []):
            if process.get("type") == "browser":
                return int(process["id"])
        return None

    async def process_ids(self) -> list[int]:
        """Every Chromium process id (browser, renderers, utilities)."""
        browser, _ = await self.browser()
        session = await browser.new_browser_cdp_session()
        try:
            info = await session.send("SystemInfo.getProcessInfo")
        finally:
            with contextlib.suppress(Exception):
                await session.detach()
        return [int(process["id"]) for process in info.get("processInfo", [])]

    # -- shutdown ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the browser and the driver, then stop the loop (idempotent)."""
        if self._closed:
            return
        self._closing = True

        async def shutdown() -> None:
            if self._browser is not None:
                with contextlib.suppress(Exception):
                    await self._browser.close()
            if self._playwright is not None:
                with contextlib.suppress(Exception):
                    await self._playwright.stop()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(15)
        for scratch_dir in list(self.scratch_dirs.values()):
            shutil.rmtree(scratch_dir, ignore_errors=True)
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


_shared: dict[BrowserSettings, BrowserHost] = {}
_shared_lock = threading.Lock()


def shared_host(settings: BrowserSettings | None = None) -> BrowserHost:
    """The process's browser host for `settings` (one Chromium per service process)."""
    settings = settings or BrowserSettings()
    with _shared_lock:
        host = _shared.get(settings)
        if host is None or host._closed:
            host = _shared[settings] = BrowserHost(settings)
        return host


@atexit.register
def _close_shared_hosts() -> None:
    with _shared_lock:
        hosts = list(_shared.values())
        _shared.clear()
    for host in hosts:
        host.close()
