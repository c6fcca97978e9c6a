"""WebArena's task evaluators: string, URL and program-HTML matching, plus an LLM fuzzy judge.

A WebArena config lists its checks in ``eval.eval_types``; an episode's score is the product of
all of them (so every check must pass for 1.0):

- ``string_match`` compares the agent's final answer (``stop [answer]``) with reference answers:
  ``exact_match``, ``must_include`` (every phrase present; ``a |OR| b`` alternatives), and
  ``fuzzy_match``, graded by an LLM judge. ``fuzzy_match: "N/A"`` marks an unachievable task: the
  answer "N/A" passes, any other answer passes only if the judge finds that it gives the same
  reason as the config's ``string_note``.
- ``url_match`` checks the page the agent ended on: some reference's host+path is contained in the
  final URL's, and every reference query parameter has one of its reference values (WebArena's
  ``url_note: "GOLD in PRED"``).
- ``program_html`` inspects site state: for each target, open its URL (``last`` = stay on the
  agent's final page), select content with a JavaScript expression (empty = the page's HTML) or a
  WebArena helper (``func:...``), and check it with ``exact_match`` / ``must_include``.

Answers and selected content are normalised as in WebArena: stripped, one pair of surrounding
quotes removed, lower-cased. The semantics follow web-arena-x/webarena's
``evaluation_harness/evaluators.py``; deviations are noted where they occur. LLM-judged checks run
last and only while the score is still positive, so a failed episode never needs the judge.
"""

from __future__ import annotations

import ast
import contextlib
import html
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import parse_qs, quote, unquote, urlsplit

import httpx
from playwright.async_api import Error as PlaywrightError
from playwright.async_api import Page
from playwright.async_api import TimeoutError as PlaywrightTimeoutError

from agentgym.envs.webarena.configs import SiteUrls, WebArenaTask
from agentgym.envs.webarena.login import credentials_for

_OR_RE = re.compile(r"\s*\|OR\|\s*")
# Words (with inner hyphens/apostrophes and decimal/thousands parts kept whole) or single symbols:
# close enough to NLTK's Treebank tokenizer for WebArena's one-character references ("6", "0").
_TOKEN_RE = re.compile(r"\w+(?:[-']\w+)*(?:[.,]\d+)*|[^\w\s]")


class EvaluationError(Exception):
    """Base of the errors that leave an episode unscored (as opposed to scored 0)."""


class UnsupportedEvaluation(EvaluationError):
    """The task needs something this deployment cannot do (an LLM judge, an unknown helper, ...)."""


class JudgeError(EvaluationError):
    """The LLM judge could not be asked or gave no usable verdict."""


@dataclass(frozen=True)
class EvalResult:
    """The episode's score in [0, 1] and one human-readable line per check (for logs and traces)."""

    score: float
    details: list[str] = field(default_factory=list)


class FuzzyJudge(Protocol):
    """Grades free-form answers against references (WebArena uses GPT-4 for this)."""

    async def judge(self, *, intent: str, reference: str, answer: str) -> bool:
        """Whether `answer` to the task `intent` is semantically equivalent to `reference`."""
        ...

    async def judge_unachievable(self, *, intent: str, reason: str, answer: str) -> bool:
        """Whether `answer` reports the same reason the task cannot be done as `reason`."""
        ...


# -- normalisation and string comparisons ----------------------------------------------------------


def clean_answer(text: str) -> str:
    """Strip, drop one pair of surrounding single or double quotes, lower-case."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    return text.lower()


def split_or(reference: str) -> list[str]:
    """The alternatives of a ``a |OR| b`` reference."""
    return [alt for alt in _OR_RE.split(reference) if alt] or [reference]


def exact_match(reference: str, prediction: str) -> bool:
    """Equal after normalisation."""
    return clean_answer(prediction) == clean_answer(reference)


def must_include(reference: str, prediction: str, *, tokenize: bool = False) -> bool:
    """`reference` occurs in `prediction` after normalisation.

    With `tokenize`, a one-character reference must be a whole token, so "0" does not match "10".
    """
    ref, pred = clean_answer(reference), clean_answer(prediction)
    if tokenize and len(ref) == 1:
        return ref in _TOKEN_RE.findall(pred)
    return ref in pred


def must_include_any(reference: str, prediction: str, *, tokenize: bool = False) -> bool:
    """Some ``|OR|`` alternative of `reference` occurs in `prediction`."""
    return any(must_include(alt, prediction, tokenize=tokenize) for alt in split_or(reference))


def url_match(reference_url: str, final_url: str, rule: str = "GOLD in PRED") -> bool:
    """WebArena's URL check ("GOLD in PRED"), reference alternatives separated by ``|OR|``.

    Passes when the host+path of some reference is contained in the final URL's host+path and, for
    every query parameter of the references, the final URL has one of the reference values.
    Paths are compared percent-decoded (the browser may encode what the config spells out) and
    without a trailing slash.
    """
    if rule != "GOLD in PRED":
        raise UnsupportedEvaluation(f"url_note {rule!r} is not supported (only 'GOLD in PRED')")
    pred_base, pred_query = _split_url(final_url)
    ref_bases: list[str] = []
    ref_query: dict[str, set[str]] = {}
    for ref in split_or(reference_url):
        base, query = _split_url(ref)
        ref_bases.append(base)
        for key, values in query.items():
            ref_query.setdefault(key, set()).update(values)
    base_ok = any(base in pred_base for base in ref_bases)
    query_ok = all(any(v in pred_query.get(k, []) for v in values) for k, values in ref_query.items())
    return base_ok and query_ok


def _split_url(url: str) -> tuple[str, dict[str, list[str]]]:
    # WebArena strips a trailing "/" off the whole URL; we strip it off the path, so that
    # ".../issues/?state=opened" and ".../issues?state=opened" compare equal as well.
    parts = urlsplit(url.strip())
    return parts.netloc + unquote(parts.path).rstrip("/"), parse_qs(parts.query)


# -- the evaluation ----------------------------------------------------------------------------------

# A check that needs the judge, deferred until the deterministic checks are done.
_JudgeCall = tuple[str, Callable[[FuzzyJudge], Awaitable[bool]]]


async def evaluate(
    task: WebArenaTask,
    *,
    answer: str | None,
    page: Page,
    judge: FuzzyJudge | None = None,
    site_urls: SiteUrls | None = None,
    settle_s: float = 3.0,
) -> EvalResult:
    """Score an episode of `task`: the product of its ``eval_types`` checks.

    `answer` is the agent's ``stop`` answer (``None`` = it never stopped: treated as ""), `page` the
    page it ended on (``program_html`` may navigate it). `judge` grades ``fuzzy_match``; without one
    such a task raises `UnsupportedEvaluation` instead of passing. `site_urls` is needed only by the
    Magento API helpers; `settle_s` bounds the wait for a page to go network-idle after navigating.
    Raises `EvaluationError` subclasses when the task cannot be scored here.
    """
    section = task.eval
    final_url = page.url  # before program_html navigates anywhere
    details: list[str] = []
    pending: list[_JudgeCall] = []
    score = 1.0
    for kind in section.get("eval_types", []):
        if score == 0.0:
            details.append(f"{kind}: skipped (score is already 0)")
            continue
        if kind == "string_match":
            score *= _string_match(task, answer or "", details, pending)
        elif kind == "url_match":
            ok = url_match(section["reference_url"], final_url, section.get("url_note") or "GOLD in PRED")
            details.append(f"url_match {section['reference_url']!r} vs {final_url!r}: {_verdict(ok)}")
            score *= float(ok)
        elif kind == "program_html":
            context = _HelperContext(page=page, last_url=final_url, site_urls=site_urls)
            score *= await _program_html(section["program_html"], context, details, settle_s)
        else:
            raise UnsupportedEvaluation(f"task {task.task_id}: eval type {kind!r} is not supported")

    if pending and score == 0.0:
        details.append(f"{len(pending)} LLM-judged check(s) skipped (score is already 0)")
    elif pending:
        if judge is None:
            raise UnsupportedEvaluation(
                f"task {task.task_id} needs an LLM judge for fuzzy_match; pass judge= (e.g. InferenceFuzzyJudge)"
            )
        for label, call in pending:
            ok = await call(judge)
            details.append(f"{label}: {_verdict(ok)}")
            score *= float(ok)
    return EvalResult(score=score, details=details)


def _verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def _string_match(task: WebArenaTask, answer: str, details: list[str], pending: list[_JudgeCall]) -> float:
    """The deterministic string checks; judge-graded ones are appended to `pending`."""
    answers: dict[str, Any] = task.eval["reference_answers"]
    pred = clean_answer(answer)
    score = 1.0
    for approach, value in answers.items():
        if approach == "exact_match":
            ok = exact_match(value, pred)
            details.append(f"string_match exact_match {value!r}: {_verdict(ok)}")
            score *= float(ok)
        elif approach == "must_include":
            # WebArena matches a lone one-character reference as a whole token.
            for phrase in value:
                ok = must_include_any(phrase, pred, tokenize=len(value) == 1)
                details.append(f"string_match must_include {phrase!r}: {_verdict(ok)}")
                score *= float(ok)
        elif approach == "fuzzy_match":
            score *= _fuzzy_match(task, value, answer.strip(), details, pending)
        else:
            raise UnsupportedEvaluation(f"task {task.task_id}: reference_answers.{approach} is not supported")
    return score


def _fuzzy_match(
    task: WebArenaTask, value: str | list[str], answer: str, details: list[str], pending: list[_JudgeCall]
) -> float:
    """``fuzzy_match``: "N/A" (unachievable task) or a list of references for the judge."""
    intent = task.intent
    if value == "N/A":
        if exact_match("N/A", answer):
            details.append("string_match N/A: pass (answered N/A)")
            return 1.0
        if not answer:
            details.append("string_match N/A: FAIL (empty answer)")
            return 0.0
        # WebArena then asks whether the answer explains why, the same way as the string note.
        reason = str(task.eval.get("string_note") or task.raw.get("string_note") or "")

        async def unachievable(judge: FuzzyJudge) -> bool:
            return await judge.judge_unachievable(intent=intent, reason=reason, answer=answer)

        pending.append((f"string_match N/A reason {reason!r} (judge)", unachievable))
        return 1.0
    references = [value] if isinstance(value, str) else list(value)
    if not answer:
        details.append("string_match fuzzy_match: FAIL (empty answer)")
        return 0.0
    for reference in references:

        async def fuzzy(judge: FuzzyJudge, reference: str = reference) -> bool:
            return await judge.judge(intent=intent, reference=reference, answer=answer)

        pending.append((f"string_match fuzzy_match {reference!r} (judge)", fuzzy))
    return 1.0


async def _program_html(
    targets: list[dict[str, Any]], context: _HelperContext, details: list[str], settle_s: float
) -> float:
    """Check each target's selected content; navigation follows WebArena (``last`` = no navigation)."""
    page = context.page
    score = 1.0
    for i, target in enumerate(targets):
        url: str = target["url"]
        if url.startswith("func:"):
            url = str(await _run_helper(url.removeprefix("func:"), context))
        if url != "last":
            await _goto(page, url, settle_s)
        locator: str = target["locator"].strip()
        if not locator:
            selected = await page.content()
        elif locator.startswith(("document.", "[...document.")):
            for action in target.get("prep_actions", []):
                try:
                    await page.evaluate(f"() => {action}")
                except PlaywrightError:
                    break  # as WebArena: a failing preparation is not an error, later ones are skipped
            try:
                value = await page.evaluate(f"() => {locator}")
            except PlaywrightError:
                value = None  # element not there (wrong page): nothing selected
            selected = "" if value is None else str(value)
        elif locator.startswith("func:"):
            selected = str(await _run_helper(locator.removeprefix("func:"), context))
        else:
            raise UnsupportedEvaluation(f"program_html[{i}]: unknown locator {locator!r:.80}")
        selected = html.unescape(selected)

        required: dict[str, Any] = target["required_contents"]
        where = f"program_html[{i}] {url} {locator[:60]!r}"
        if "exact_match" in required:
            ok = exact_match(required["exact_match"], selected)
            details.append(f"{where} exact_match {required['exact_match']!r}: {_verdict(ok)} (got {selected[:80]!r})")
            score *= float(ok)
        elif "must_include" in required:
            for content in required["must_include"]:
                ok = must_include_any(content, selected)
                details.append(f"{where} must_include {content!r}: {_verdict(ok)}")
                score *= float(ok)
        else:
            raise UnsupportedEvaluation(f"program_html[{i}]: required_contents {sorted(required)} not supported")
    return score


async def _goto(page: Page, url: str, settle_s: float) -> None:
    """Open `url` and let scripts render: WebArena sleeps 3 s; we wait for network idle, bounded."""
    try:
        await page.goto(url, wait_until="load")
    except PlaywrightError as error:  # unreachable site: an infrastructure problem, not the agent's
        raise EvaluationError(f"program_html could not open {url}: {error.message.splitlines()[0]}") from error
    with contextlib.suppress(PlaywrightTimeoutError):
        await page.wait_for_load_state("networkidle", timeout=settle_s * 1000)


# -- WebArena's helper functions (``func:name(args)`` in program_html) -------------------------------


@dataclass(frozen=True)
class _HelperContext:
    page: Page
    last_url: str  # the agent's final URL, for "__last_url__"
    site_urls: SiteUrls | None


class _PageArg:
    """Marks the ``__page__`` argument of a helper call."""


def _parse_helper(expression: str) -> tuple[str, list[str | _PageArg]]:
    """Parse ``name('literal', __page__, ...)`` without evaluating anything."""
    try:
        call = ast.parse(expression.strip(), mode="eval").body
    except SyntaxError as error:
        raise UnsupportedEvaluation(f"cannot parse helper call {expression!r}") from error
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.keywords:
        raise UnsupportedEvaluation(f"helper call {expression!r} is not name(arg, ...)")
    args: list[str | _PageArg] = []
    for arg in call.args:
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            args.append(arg.value)
        elif isinstance(arg, ast.Name) and arg.id in ("__page__", "page"):
            args.append(_PageArg())
        else:
            raise UnsupportedEvaluation(f"helper call {expression!r}: unsupported argument {ast.unparse(arg)}")
    return call.func.id, args


async def _run_helper(expression: str, context: _HelperContext) -> str:
    """Run a WebArena helper named in a config (``__last_url__`` = the agent's final URL)."""
    name, raw_args = _parse_helper(expression)
    helper = _HELPERS.get(name)
    if helper is None:
        raise UnsupportedEvaluation(f"WebArena helper {name!r} is not supported; supported: {sorted(_HELPERS)}")
    args = [a if isinstance(a, _PageArg) else a.replace("__last_url__", context.last_url) for a in raw_args]
    return await helper(context, *args)


async def reddit_get_post_url(context: _HelperContext, url: str | _PageArg) -> str:
    """The canonical ``/f/<forum>/<post id>/`` URL of a Postmill post or comment URL (else `url`)."""
    if not isinstance(url, str):
        raise UnsupportedEvaluation("reddit_get_post_url takes a URL string")
    return postmill_post_url(url)


def postmill_post_url(url: str) -> str:
    """``http://h/f/forum/123/slug/comment/4`` -> ``http://h/f/forum/123/``; other URLs unchanged."""
    parts = urlsplit(url)
    segments = parts.path.split("/")
    if len(segments) < 4 or segments[1] != "f":
        return url
    return f"{parts.scheme}://{parts.netloc}/f/{segments[2]}/{segments[3]}/"


# GitLab's members table: find the row of "@account" and read its max-role cell.
_GITLAB_ROLE_JS = """(account) => {
    const names = [...document.querySelectorAll("td[data-label='Account'] span.gl-avatar-labeled-sublabel")];
    const index = names.findIndex((el) => el.outerText === '@' + account);
    if (index < 0) return "";
    const role = document.querySelectorAll("td.col-max-role span")[index];
    return role ? role.outerText : "";
}"""


async def gitlab_get_project_member_role(context: _HelperContext, page: str | _PageArg, account: str | _PageArg) -> str:
    """The role (e.g. "Guest") of `account` on the GitLab project-members page now open, or ""."""
    if not isinstance(page, _PageArg) or not isinstance(account, str):
        raise UnsupportedEvaluation("gitlab_get_project_memeber_role takes (__page__, 'account')")
    try:
        role = await context.page.evaluate(_GITLAB_ROLE_JS, account)
    except PlaywrightError:
        return ""
    return str(role or "")


async def _magento_get(context: _HelperContext, path: str, params: dict[str, str] | None = None) -> Any:
    """GET the shop's REST API as its admin (WebArena's helpers read orders and reviews this way)."""
    if context.site_urls is None:
        raise UnsupportedEvaluation("the Magento API helpers need site_urls= (the shopping site's URL)")
    base = context.site_urls.url("shopping")
    admin = credentials_for("shopping_site_admin")
    try:
        async with httpx.AsyncClient(timeout=30.0) as client:
            response = await client.post(
                f"{base}/rest/default/V1/integration/admin/token",
                json={"username": admin.username, "password": admin.password},
            )
            response.raise_for_status()
            token = response.json()
            headers = {"Authorization": f"Bearer {token}"}
            response = await client.get(f"{base}{path}", params=params, headers=headers)
            response.raise_for_status()
            return response.json()
    except (httpx.HTTPError, ValueError) as error:
        raise EvaluationError(f"the shop's REST API ({base}{path}) failed: {error!r}") from error


async def shopping_get_latest_order_url(context: _HelperContext) -> str:
    """The storefront URL of the most recently created order."""
    if context.site_urls is None:
        raise UnsupportedEvaluation("shopping_get_latest_order_url needs site_urls= (the shopping site's URL)")
    params = {
        "searchCriteria[sortOrders][0][field]": "created_at",
        "searchCriteria[sortOrders][0][direction]": "DESC",
        "searchCriteria[pageSize]": "1",
    }
    orders = await _magento_get(context, "/rest/V1/orders", params)
    items = orders.get("items") or []
    if not items:
        return "about:blank"  # no order at all: an empty page, which no required content matches
    # As WebArena: the order's increment id is used as the order id of the storefront's order page.
    order_id = int(items[0]["increment_id"])
    return f"{context.site_urls.url('shopping')}/sales/order/view/order_id/{order_id}/"


async def _latest_review(context: _HelperContext, sku: str | _PageArg) -> dict[str, Any] | None:
    if not isinstance(sku, str):
        raise UnsupportedEvaluation("the shopping review helpers take a SKU string")
    reviews = await _magento_get(context, f"/rest/V1/products/{quote(sku, safe='')}/reviews")
    return reviews[-1] if reviews else None


async def shopping_get_sku_latest_review_author(context: _HelperContext, sku: str | _PageArg) -> str:
    """The nickname on the latest review of product `sku` ("" without reviews)."""
    review = await _latest_review(context, sku)
    return str(review["nickname"]) if review else ""


async def shopping_get_sku_latest_review_rating(context: _HelperContext, sku: str | _PageArg) -> str:
    """The rating percent (e.g. "100") of the latest review of product `sku` ("" without reviews)."""
    review = await _latest_review(context, sku)
    if not review or not review.get("ratings"):
        return ""
    return str(review["ratings"][0]["percent"])


# Config name -> implementation (WebArena spells the GitLab one "memeber").
_HELPERS: dict[str, Callable[..., Awaitable[str]]] = {
    "reddit_get_post_url": reddit_get_post_url,
    "gitlab_get_project_memeber_role": gitlab_get_project_member_role,
    "shopping_get_latest_order_url": shopping_get_latest_order_url,
    "shopping_get_sku_latest_review_author": shopping_get_sku_latest_review_author,
    "shopping_get_sku_latest_review_rating": shopping_get_sku_latest_review_rating,
}


# -- the LLM judge -----------------------------------------------------------------------------------

_FUZZY_PROMPT = """You grade answers to web tasks. The answer may be worded differently from the \
reference; judge whether it means the same thing. The string "N/A" means "not achievable".

Task: {intent}
Reference answer: {reference}
Given answer: {answer}

Does the given answer mean the same as the reference answer? Reply yes or no.
Reply:"""

_UNACHIEVABLE_PROMPT = """A web task cannot be completed, for the actual reason below. Someone who \
tried it reported why they could not complete it. Judge whether the reported reason agrees with the \
actual reason, even if only implicitly.

Task: {intent}
Actual reason: {reason}
Reported reason: {answer}

Does the reported reason agree with the actual reason? Reply yes or no.
Reply:"""

_VERDICT_RE = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def parse_verdict(text: str) -> bool:
    """The first "yes"/"no" in a judge's reply; `JudgeError` when there is none."""
    match = _VERDICT_RE.search(text)
    if match is None:
        raise JudgeError(f"the judge gave no yes/no verdict: {text.strip()[:120]!r}")
    return match.group(1).lower() == "yes"


class InferenceFuzzyJudge:
    """A `FuzzyJudge` asking an OpenAI-compatible ``/v1/completions`` server (greedy, a few tokens).

    `base_url` is the server root (``http://inference:8000``; a trailing ``/v1`` is accepted);
    `model` = None lets the platform's inference server use the model it serves.
    """

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        max_tokens: int = 8,
    ) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_tokens = max_tokens

    async def judge(self, *, intent: str, reference: str, answer: str) -> bool:
        return await self._ask(_FUZZY_PROMPT.format(intent=intent, reference=reference, answer=answer))

    async def judge_unachievable(self, *, intent: str, reason: str, answer: str) -> bool:
        return await self._ask(_UNACHIEVABLE_PROMPT.format(intent=intent, reason=reason, answer=answer))

    async def _ask(self, prompt: str) -> bool:
        payload: dict[str, Any] = {"prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0.0}
        if self.model is not None:
            payload["model"] = self.model
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s) as client:
                response = await client.post(f"{self.base_url}/v1/completions", json=payload, headers=headers)
                response.raise_for_status()
                text = response.json()["choices"][0]["text"]
        except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as error:
            raise JudgeError(f"asking the judge at {self.base_url} failed: {error!r}") from error
        return parse_verdict(str(text))
