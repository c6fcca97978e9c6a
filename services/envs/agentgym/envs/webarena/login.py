"""Logged-in browser state for WebArena sites: one login recipe per site, cached storage states.

Most WebArena tasks start logged in (as the customer on the shop, the admin on its back office, a
user on the forum and on GitLab). As WebArena's `auto_login.py` does, we log into each site once in
a fresh browser context, save Playwright's storage state (cookies + local storage) and start task
contexts from it; the combined state of a task's sites is cached per site set on disk.

Accounts default to WebArena's public test accounts (they ship with the site images); override one
with ``WA_<ACCOUNT>_USERNAME`` / ``WA_<ACCOUNT>_PASSWORD`` (e.g. ``WA_GITLAB_PASSWORD``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from playwright.async_api import Browser, BrowserContext, Locator, Page
from playwright.async_api import Error as PlaywrightError

from agentgym.envs.webarena.configs import SiteUrls

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Credentials:
    """A username (or e-mail) and password for one site account."""

    username: str
    password: str

    def __repr__(self) -> str:  # keep passwords out of logs and tracebacks
        return f"Credentials(username={self.username!r}, password='***')"


# WebArena's public default accounts (browser_env/env_config.py of web-arena-x/webarena).
# "shopping_site_admin" is the storefront's admin API account, used by some evaluators.
DEFAULT_ACCOUNTS: dict[str, Credentials] = {
    "shopping": Credentials("emma.lopez@gmail.com", "Password.123"),
    "shopping_admin": Credentials("admin", "admin1234"),
    "shopping_site_admin": Credentials("admin", "admin1234"),
    "reddit": Credentials("MarvelsGrantMan136", "test1234"),
    "gitlab": Credentials("byteblaze", "hello1234"),
}


def credentials_for(account: str, environ: Mapping[str, str] = os.environ) -> Credentials:
    """The account's credentials: ``WA_<ACCOUNT>_USERNAME/_PASSWORD`` over WebArena's defaults."""
    prefix = f"WA_{account.upper()}"
    default = DEFAULT_ACCOUNTS.get(account)
    username = environ.get(f"{prefix}_USERNAME") or (default.username if default else None)
    password = environ.get(f"{prefix}_PASSWORD") or (default.password if default else None)
    if username is None or password is None:
        raise KeyError(f"no credentials for {account!r}: set {prefix}_USERNAME and {prefix}_PASSWORD")
    return Credentials(username, password)


@dataclass(frozen=True)
class LoginRecipe:
    """Where a site's login form is and how to find its fields.

    Each field is found by its form ``name`` (stable across themes and languages), falling back to
    its visible label; the form is submitted with its own submit button.
    """

    path: str  # login page, relative to the site's base URL
    username_name: str
    username_label: str
    password_name: str
    password_label: str


LOGIN_RECIPES: dict[str, LoginRecipe] = {
    # Magento 2 storefront (Luma): customer login.
    "shopping": LoginRecipe("/customer/account/login/", "login[username]", "Email", "login[password]", "Password"),
    # Magento 2 back office: the admin base URL shows the login form.
    "shopping_admin": LoginRecipe("/", "login[username]", "Username", "login[password]", "Password"),
    # Postmill (Symfony form login).
    "reddit": LoginRecipe("/login", "_username", "Username", "_password", "Password"),
    # GitLab CE: standard sign-in form.
    "gitlab": LoginRecipe("/users/sign_in", "user[login]", "Username or email", "user[password]", "Password"),
}


class LoginError(RuntimeError):
    """Logging into a site failed (wrong credentials, unexpected page, site down)."""


async def _field(page: Page, name: str, label: str) -> Locator:
    """The input named `name`, else the one labelled `label` (first match, in page order)."""
    by_name = page.locator(f'input[name="{name}"]')
    return by_name.first if await by_name.count() else page.get_by_label(label, exact=True).first


async def login_site(
    context: BrowserContext, site: str, base_url: str, credentials: Credentials, *, timeout_s: float = 30.0
) -> None:
    """Log `context` into `site` (at `base_url`) by filling and submitting its login form.

    Raises `LoginError` when the site has no recipe or the login form is still shown afterwards
    (the sites re-render the form with an error message on bad credentials).
    """
    recipe = LOGIN_RECIPES.get(site)
    if recipe is None:
        raise LoginError(f"no login recipe for site {site!r}; sites with one: {sorted(LOGIN_RECIPES)}")
    url = base_url.rstrip("/") + recipe.path
    page = await context.new_page()
    page.set_default_timeout(timeout_s * 1000)
    try:
        await page.goto(url, wait_until="load")
        username = await _field(page, recipe.username_name, recipe.username_label)
        password = await _field(page, recipe.password_name, recipe.password_label)
        await username.fill(credentials.username)
        await password.fill(credentials.password)
        # Submit the form holding the password field (pages also carry search/newsletter forms).
        form = page.locator("form").filter(has=password).first
        submit = form.locator("button:not([type=button]):not([type=reset]), input[type=submit]").first
        async with page.expect_navigation(wait_until="load"):
            await submit.click()
        if await page.locator("input[type=password]:visible").count():
            raise LoginError(f"login to {site} at {url} as {credentials.username!r} failed: the form is still shown")
    except PlaywrightError as error:
        raise LoginError(f"login to {site} at {url} failed: {error.message.splitlines()[0]}") from error
    finally:
        await page.close()
    log.info("logged into %s as %s", site, credentials.username)


# One lock per cache file (and event loop): concurrent episodes needing the same site set log in once.
_cache_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Path, asyncio.Lock]] = (
    weakref.WeakKeyDictionary()
)


async def storage_state_for(
    browser: Browser,
    sites: Iterable[str],
    site_urls: SiteUrls,
    cache_dir: str | os.PathLike[str],
    *,
    credentials: Mapping[str, Credentials] | None = None,
    max_age_s: float = 1800.0,
) -> Path:
    """A storage-state JSON logged into every site of `sites` that has a recipe; cached per site set.

    Each site is logged into in its own fresh context (concurrently) and the states are merged
    (cookies and local storage of all sites, in site-name order). A cached file younger than
    `max_age_s` is reused, so sessions are renewed before the sites expire them. Sites without a
    login (wikipedia, map, homepage) are skipped; with none left the state is empty.
    `credentials` overrides `credentials_for(site)` per site.
    """
    login = sorted({s for s in sites if s in LOGIN_RECIPES})
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / f"{'.'.join(login) or 'anonymous'}_state.json"
    locks = _cache_locks.setdefault(asyncio.get_running_loop(), {})
    lock = locks.setdefault(path, asyncio.Lock())
    async with lock:
        if path.exists() and time.time() - path.stat().st_mtime < max_age_s:
            return path
        states = await asyncio.gather(*(_login_state(browser, site, site_urls, credentials) for site in login))
        merged: dict[str, Any] = {"cookies": [], "origins": []}
        for site, state in zip(login, states, strict=True):
            _merge_state(merged, state, site)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(merged, indent=1), encoding="utf-8")
        os.replace(tmp, path)  # atomic: readers never see a half-written file
    return path


async def _login_state(
    browser: Browser, site: str, site_urls: SiteUrls, credentials: Mapping[str, Credentials] | None
) -> dict[str, Any]:
    """Log into one site in a fresh context and return that context's storage state."""
    creds = (credentials or {}).get(site) or credentials_for(site)
    context = await browser.new_context()
    try:
        await login_site(context, site, site_urls.url(site), creds)
        return dict(await context.storage_state())
    finally:
        await context.close()


def _merge_state(merged: dict[str, Any], state: Mapping[str, Any], site: str) -> None:
    """Add one site's storage state to `merged`, warning when a cookie of an earlier site is replaced.

    Cookies are per host, not per port: sites deployed on one host under different ports share the
    cookie jar, and two sites that both use e.g. ``PHPSESSID`` overwrite each other's session.
    """
    cookies: list[dict[str, Any]] = merged["cookies"]
    for cookie in state.get("cookies", []):
        key = (cookie.get("name"), cookie.get("domain"), cookie.get("path"))
        clash = [c for c in cookies if (c.get("name"), c.get("domain"), c.get("path")) == key]
        if clash:
            log.warning("cookie %s for %s (from %s) replaces an earlier site's session", key[0], key[1], site)
            cookies[:] = [c for c in cookies if c not in clash]
        cookies.append(dict(cookie))
    merged["origins"].extend(dict(o) for o in state.get("origins", []))
