"""Site login recipes against loopback login forms in real Chromium; cached storage states."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from playwright.async_api import Browser
from webarena_pages import LoopbackSite, Reply, Request, chromium, html_reply, redirect

from agentgym.envs.webarena.configs import SiteUrls
from agentgym.envs.webarena.login import (
    DEFAULT_ACCOUNTS,
    Credentials,
    LoginError,
    credentials_for,
    login_site,
    storage_state_for,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

# A Magento-like storefront login page: a newsletter form and a header link come first, as on Luma.
MAGENTO_LOGIN = """<!doctype html><html lang="en"><head><title>Customer Login</title></head><body>
<header><a href="/customer/account/login/">Sign In</a></header>
<form class="form subscribe" action="/newsletter/subscriber/new/" method="post">
  <label for="newsletter">Sign Up for Our Newsletter:</label><input name="email" id="newsletter" type="email">
  <button type="submit" class="action subscribe primary">Subscribe</button></form>
<h1 class="page-title">Customer Login</h1>{error}
<form class="form form-login" action="/customer/account/loginPost/" method="post" id="login-form">
  <input name="form_key" type="hidden" value="Xy12">
  <fieldset class="fieldset login"><legend>Registered Customers</legend>
  <div class="field email required"><label class="label" for="email"><span>Email</span></label>
    <input name="{user_field}" id="email" type="email" class="input-text" autocomplete="off"></div>
  <div class="field password required"><label for="pass" class="label"><span>Password</span></label>
    <input name="{pass_field}" type="password" autocomplete="off" class="input-text" id="pass"></div>
  <div class="actions-toolbar"><button type="submit" class="action login primary" name="send" id="send2">
    <span>Sign In</span></button><a class="action remind" href="/customer/account/forgotpassword/">Forgot?</a></div>
  </fieldset></form></body></html>"""

# A Postmill-like login page (Symfony form login).
POSTMILL_LOGIN = """<!doctype html><html lang="en"><head><title>Log in</title></head><body>
<form action="/login_check" method="post" class="form"><h1 class="page-heading">Log in</h1>
  <div class="form__row"><label for="login-username" class="form__label">Username</label>
    <input type="text" id="login-username" name="_username" class="form-control" required></div>
  <div class="form__row"><label for="login-password" class="form__label">Password</label>
    <input type="password" id="login-password" name="_password" class="form-control" required></div>
  <div class="form__row"><input type="checkbox" name="_remember_me" id="remember-me">
    <label for="remember-me">Remember me</label></div>
  <div class="form__button-row"><button type="submit" class="button">Log in</button></div>
</form></body></html>"""


def magento_site(user_field: str = "login[username]", pass_field: str = "login[password]") -> LoopbackSite:
    """A storefront whose login POST sets a session cookie and whose account page needs it."""

    def page(error: str = "") -> Reply:
        return html_reply(MAGENTO_LOGIN.format(error=error, user_field=user_field, pass_field=pass_field))

    def login_page(_request: Request) -> Reply:
        return page()

    def login_post(request: Request) -> Reply:
        form = request.form()
        if form.get(user_field) == "emma.lopez@gmail.com" and form.get(pass_field) == "Password.123":
            cookie = "PHPSESSID=emma-session-1; Path=/; HttpOnly; SameSite=Lax"
            return redirect("/customer/account/", {"Set-Cookie": cookie})
        error = '<div class="message-error error message">The account sign-in was incorrect.</div>'
        return page(error)

    def account(request: Request) -> Reply:
        if "emma-session-1" not in request.headers.get("Cookie", ""):
            return redirect("/customer/account/login/")
        return html_reply("<html><body><h1>My Account</h1><p>Emma Lopez</p></body></html>")

    return LoopbackSite(
        routes={
            ("GET", "/customer/account/login/"): login_page,
            ("POST", "/customer/account/loginPost/"): login_post,
            ("GET", "/customer/account/"): account,
        }
    )


def postmill_site() -> LoopbackSite:
    def login_check(request: Request) -> Reply:
        form = request.form()
        if (form.get("_username"), form.get("_password")) == ("MarvelsGrantMan136", "test1234"):
            return redirect("/", {"Set-Cookie": "PHPSESSID=marvels-session; Path=/; HttpOnly"})
        return redirect("/login")

    return LoopbackSite(
        routes={
            ("GET", "/login"): lambda _r: html_reply(POSTMILL_LOGIN),
            ("POST", "/login_check"): login_check,
            ("GET", "/"): lambda _r: html_reply("<html><body><h1>Postmill</h1></body></html>"),
        }
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def browser() -> AsyncIterator[Browser]:
    async with chromium() as browser:
        yield browser


async def test_credentials_default_to_webarena_accounts_and_env_overrides() -> None:
    assert credentials_for("gitlab", {}) == DEFAULT_ACCOUNTS["gitlab"] == Credentials("byteblaze", "hello1234")
    env = {"WA_SHOPPING_ADMIN_USERNAME": "ops", "WA_SHOPPING_ADMIN_PASSWORD": "s3cret"}
    assert credentials_for("shopping_admin", env) == Credentials("ops", "s3cret")
    assert "s3cret" not in repr(credentials_for("shopping_admin", env))
    with pytest.raises(KeyError, match="WA_WIKIPEDIA_USERNAME"):
        credentials_for("wikipedia", {})


async def test_storage_state_has_the_session_cookie_and_is_cached(browser: Browser, tmp_path: Path) -> None:
    with magento_site() as shop:
        urls = SiteUrls(shopping=shop.url, map="http://127.0.0.1:9")
        path = await storage_state_for(browser, ["shopping", "map"], urls, tmp_path)  # map has no login
        assert path == tmp_path / "shopping_state.json"
        cookies = json.loads(path.read_text())["cookies"]
        assert [(c["name"], c["value"], c["domain"]) for c in cookies] == [("PHPSESSID", "emma-session-1", "127.0.0.1")]
        assert shop.requests.count(("POST", "/customer/account/loginPost/")) == 1

        # A task context started from the state is logged in.
        context = await browser.new_context(storage_state=path)
        page = await context.new_page()
        await page.goto(f"{shop.url}/customer/account/")
        assert await page.locator("h1").inner_text() == "My Account"
        await context.close()

        # Cached per site set; renewed once older than max_age_s.
        assert await storage_state_for(browser, ["shopping"], urls, tmp_path) == path
        assert shop.requests.count(("POST", "/customer/account/loginPost/")) == 1
        await storage_state_for(browser, ["shopping"], urls, tmp_path, max_age_s=0)
        assert shop.requests.count(("POST", "/customer/account/loginPost/")) == 2


async def test_wrong_password_raises(browser: Browser) -> None:
    with magento_site() as shop:
        context = await browser.new_context()
        try:
            with pytest.raises(LoginError, match="form is still shown"):
                await login_site(context, "shopping", shop.url, Credentials("emma.lopez@gmail.com", "wrong"))
            with pytest.raises(LoginError, match="no login recipe"):
                await login_site(context, "wikipedia", shop.url, Credentials("a", "b"))
        finally:
            await context.close()


async def test_fields_are_found_by_label_when_names_differ(browser: Browser) -> None:
    with magento_site(user_field="email", pass_field="pass") as shop:
        context = await browser.new_context()
        try:
            await login_site(context, "shopping", shop.url, credentials_for("shopping", {}))
            assert [c["value"] for c in await context.cookies()] == ["emma-session-1"]
        finally:
            await context.close()


async def test_two_sites_merge_and_clashing_cookies_are_reported(
    browser: Browser, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with magento_site() as shop, postmill_site() as forum:
        # Different hosts: both sessions survive in the merged state.
        apart = SiteUrls(shopping=shop.url, reddit=forum.url.replace("127.0.0.1", "localhost"))
        path = await storage_state_for(browser, ["reddit", "shopping"], apart, tmp_path / "apart")
        assert path.name == "reddit.shopping_state.json"
        cookies = {(c["domain"], c["value"]) for c in json.loads(path.read_text())["cookies"]}
        assert cookies == {("127.0.0.1", "emma-session-1"), ("localhost", "marvels-session")}

        # Same host, same cookie name: cookies ignore ports, so one session replaces the other.
        together = SiteUrls(shopping=shop.url, reddit=forum.url)
        with caplog.at_level(logging.WARNING, logger="agentgym.envs.webarena.login"):
            path = await storage_state_for(browser, ["reddit", "shopping"], together, tmp_path / "together")
        assert "replaces an earlier site's session" in caplog.text
        assert [c["value"] for c in json.loads(path.read_text())["cookies"]] == ["emma-session-1"]
