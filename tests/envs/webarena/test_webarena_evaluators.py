"""WebArena evaluators against saved pages in real Chromium, a stub shop API and a stub LLM judge."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio
from playwright.async_api import Browser, Page
from webarena_pages import (
    PAGES,
    SAMPLE_CONFIGS,
    LoopbackSite,
    Reply,
    Request,
    chromium,
    completions_server,
    json_reply,
    redirect,
    wa_config,
)

from agentgym.envs.webarena.configs import SiteUrls, WebArenaTask, parse_task_config
from agentgym.envs.webarena.evaluators import (
    EvalResult,
    EvaluationError,
    FuzzyJudge,
    InferenceFuzzyJudge,
    JudgeError,
    UnsupportedEvaluation,
    clean_answer,
    evaluate,
    exact_match,
    must_include,
    parse_verdict,
    postmill_post_url,
    url_match,
)

# One Chromium for the module: every test (even the few without a page) runs on the module's loop.
pytestmark = pytest.mark.asyncio(loop_scope="module")

ADMIN_TOKEN = "t0k3n-admin"
MIND = "What\u2019s on your mind?"  # Magento's contact-form label, with a typographic apostrophe


class ShopApi:
    """The storefront's REST API as WebArena's helpers use it: admin token, orders, reviews."""

    def __init__(self) -> None:
        self.latest_order = "000000170"

    def routes(self) -> dict[tuple[str, str], Any]:
        return {
            ("POST", "/rest/default/V1/integration/admin/token"): self.token,
            ("GET", "/rest/V1/orders"): self.orders,
            ("GET", "/rest/V1/products/B00J8RZL7I/reviews"): self.reviews,
        }

    def token(self, request: Request) -> Reply:
        if request.json() != {"username": "admin", "password": "admin1234"}:
            return json_reply({"message": "The account sign-in was incorrect."}, status=401)
        return json_reply(ADMIN_TOKEN)

    def _authorised(self, request: Request) -> bool:
        return request.headers.get("Authorization") == f"Bearer {ADMIN_TOKEN}"

    def orders(self, request: Request) -> Reply:
        if not self._authorised(request):
            return json_reply({"message": "unauthorised"}, status=401)
        assert request.query["searchCriteria[sortOrders][0][field]"] == ["created_at"]
        assert request.query["searchCriteria[sortOrders][0][direction]"] == ["DESC"]
        return json_reply({"items": [{"increment_id": self.latest_order, "status": "pending"}], "total_count": 1})

    def reviews(self, request: Request) -> Reply:
        if not self._authorised(request):
            return json_reply({"message": "unauthorised"}, status=401)
        return json_reply(
            [
                {"nickname": "Jay", "ratings": [{"rating_name": "Rating", "percent": 60}]},
                {"nickname": "Emma Lopez", "ratings": [{"rating_name": "Rating", "percent": 100}]},
            ]
        )


@pytest.fixture(scope="module")
def shop_api() -> ShopApi:
    return ShopApi()


@pytest.fixture(scope="module")
def urls(shop_api: ShopApi) -> Iterator[SiteUrls]:
    """The four sites on loopback: saved pages plus the shop API and Postmill's post redirect."""
    post = "/f/BuyItForLife/12345/must-have-products-for-life"
    with (
        LoopbackSite(PAGES / "shopping", shop_api.routes()) as shopping,
        LoopbackSite(PAGES / "shopping_admin") as admin,
        LoopbackSite(PAGES / "gitlab") as gitlab,
        LoopbackSite(PAGES / "reddit", {("GET", "/f/BuyItForLife/12345/"): lambda _: redirect(post)}) as reddit,
    ):
        yield SiteUrls(
            shopping=shopping.url,
            shopping_admin=admin.url,
            gitlab=gitlab.url,
            reddit=reddit.url,
            map="http://127.0.0.1:9",  # not served: only string_match tasks use it
        )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def browser() -> AsyncIterator[Browser]:
    async with chromium() as browser:
        yield browser


@pytest_asyncio.fixture(loop_scope="module")
async def page(browser: Browser) -> AsyncIterator[Page]:
    context = await browser.new_context()
    try:
        yield await context.new_page()
    finally:
        await context.close()


def sample_task(task_id: int, urls: SiteUrls, **eval_changes: Any) -> WebArenaTask:
    config = copy.deepcopy(next(c for c in SAMPLE_CONFIGS if c["task_id"] == task_id))
    config["eval"].update(eval_changes)
    return parse_task_config(config, urls)


def html_task(urls: SiteUrls, site: str, targets: list[dict[str, Any]], **eval_extra: Any) -> WebArenaTask:
    eval_types = [*eval_extra.pop("eval_types", []), "program_html"]
    config = wa_config(900, [site], f"__{site.upper()}__", "Do the thing", {"eval_types": eval_types, **eval_extra})
    config["eval"]["program_html"] = targets
    return parse_task_config(config, urls)


class StaticJudge:
    """A judge with fixed verdicts that records what it was asked."""

    def __init__(self, verdict: bool) -> None:
        self.verdict = verdict
        self.calls: list[dict[str, str]] = []

    async def judge(self, *, intent: str, reference: str, answer: str) -> bool:
        self.calls.append({"intent": intent, "reference": reference, "answer": answer})
        return self.verdict

    async def judge_unachievable(self, *, intent: str, reason: str, answer: str) -> bool:
        self.calls.append({"intent": intent, "reason": reason, "answer": answer})
        return self.verdict


# -- string comparisons -------------------------------------------------------------------------------


async def test_normalisation_and_string_helpers() -> None:
    assert clean_answer('  "Quest Lumaflex™ Band" ') == "quest lumaflex™ band"
    assert clean_answer("'n/a'") == "n/a"
    assert exact_match("Quest Lumaflex™ Band", "'quest lumaflex™ band'")
    assert not exact_match("Quest Lumaflex™ Band", "Quest Lumaflex Band")
    # A lone one-character reference must be a whole token when tokenizing.
    assert must_include("2", "There are 2 reviews.", tokenize=True)
    assert not must_include("0", "10 orders", tokenize=True)
    assert not must_include("6", "6,000 units", tokenize=True)
    assert must_include("0", "10 orders")  # plain substring without tokenizing


async def test_string_match_exact_and_must_include(page: Page, urls: SiteUrls) -> None:
    exact = sample_task(0, urls)
    assert (await evaluate(exact, answer='"Quest Lumaflex™ Band"', page=page)).score == 1.0
    assert (await evaluate(exact, answer="Quest Lumaflex Band", page=page)).score == 0.0
    assert (await evaluate(exact, answer=None, page=page)).score == 0.0  # never stopped

    count = sample_task(13, urls)
    assert (await evaluate(count, answer="The store received 2 such reviews.", page=page)).score == 1.0
    result = await evaluate(count, answer="12", page=page)
    assert result.score == 0.0
    assert any("must_include '2': FAIL" in line for line in result.details)


async def test_string_match_or_alternatives(page: Page, urls: SiteUrls) -> None:
    rating = sample_task(165, urls)  # must_include ["65 |OR| 3"]
    assert (await evaluate(rating, answer="about 3 stars", page=page)).score == 1.0
    assert (await evaluate(rating, answer="65%", page=page)).score == 1.0
    assert (await evaluate(rating, answer="4 stars", page=page)).score == 0.0


async def test_unachievable_task(page: Page, urls: SiteUrls) -> None:
    na = sample_task(22, urls)  # fuzzy_match "N/A" with a string note
    assert (await evaluate(na, answer="N/A", page=page)).score == 1.0  # no judge needed
    assert (await evaluate(na, answer="", page=page)).score == 0.0
    with pytest.raises(UnsupportedEvaluation, match="judge"):
        await evaluate(na, answer="No reviewer mentions underwater photos", page=page)
    judge = StaticJudge(True)
    result = await evaluate(na, answer="No reviewer mentions underwater photos", page=page, judge=judge)
    assert result.score == 1.0
    assert judge.calls == [
        {
            "intent": na.intent,
            "reason": "There is no review about under water photo",
            "answer": "No reviewer mentions underwater photos",
        }
    ]
    assert (await evaluate(na, answer="Emma Lopez", page=page, judge=StaticJudge(False))).score == 0.0


async def test_fuzzy_match_needs_a_judge_and_uses_its_verdict(page: Page, urls: SiteUrls) -> None:
    airport = sample_task(7, urls)
    with pytest.raises(UnsupportedEvaluation, match="task 7 needs an LLM judge"):
        await evaluate(airport, answer="Pittsburgh Intl, Findlay Township", page=page)
    yes, no = StaticJudge(True), StaticJudge(False)
    assert (await evaluate(airport, answer="Pittsburgh Intl", page=page, judge=yes)).score == 1.0
    assert yes.calls[0]["reference"] == "Pittsburgh International Airport"
    assert (await evaluate(airport, answer="Pittsburgh Intl", page=page, judge=no)).score == 0.0


async def test_judge_is_not_needed_once_a_deterministic_check_failed(page: Page, urls: SiteUrls) -> None:
    config = wa_config(
        34,
        ["map"],
        "__MAP__",
        "Which hotel near the airport is closest, and how long is the drive?",
        {
            "eval_types": ["string_match"],
            "reference_answers": {"must_include": ["Hyatt Regency"], "fuzzy_match": ["Time: 3h 30min"]},
        },
    )
    task = parse_task_config(config, SiteUrls(map="http://127.0.0.1:9"))
    result = await evaluate(task, answer="The Marriott, 3.5 hours", page=page)  # no judge, no raise
    assert result.score == 0.0
    assert "1 LLM-judged check(s) skipped" in result.details[-1]


# -- the inference judge over HTTP --------------------------------------------------------------------


async def test_inference_judge_both_verdicts_over_http(page: Page, urls: SiteUrls) -> None:
    def verdict(prompt: str) -> str:
        # A grader that accepts answers naming the airport.
        line = next(x for x in prompt.splitlines() if x.startswith(("Given answer:", "Reported reason:")))
        return " Yes, they match." if "pittsburgh international" in line.lower() else " No."

    with completions_server(verdict) as server:
        judge: FuzzyJudge = InferenceFuzzyJudge(server.url + "/v1", model="policy")
        airport = sample_task(7, urls)
        good = await evaluate(airport, answer="Pittsburgh International, 20 km away", page=page, judge=judge)
        bad = await evaluate(airport, answer="Allegheny County Airport", page=page, judge=judge)
        assert (good.score, bad.score) == (1.0, 0.0)
        body = server.routed[0].json()
        assert body["model"] == "policy" and body["temperature"] == 0.0
        assert "Reference answer: Pittsburgh International Airport" in body["prompt"]
        assert await InferenceFuzzyJudge(server.url).judge_unachievable(
            intent="x", reason="no such review", answer="Pittsburgh International"
        )


async def test_inference_judge_errors() -> None:
    with completions_server(lambda _prompt: "I cannot tell.") as server, pytest.raises(JudgeError, match="verdict"):
        await InferenceFuzzyJudge(server.url).judge(intent="q", reference="a", answer="b")
    with LoopbackSite() as down:
        url = down.url
    with pytest.raises(JudgeError, match="failed"):
        await InferenceFuzzyJudge(url, timeout_s=5).judge(intent="q", reference="a", answer="b")
    assert parse_verdict("\nno, the answer differs") is False
    assert parse_verdict("YES") is True


# -- URL matching ---------------------------------------------------------------------------------------


async def test_url_match_rules() -> None:
    gold = "http://h:8023/a11yproject/a11yproject.com/-/issues/?sort=created_asc&state=opened"
    assert url_match(gold, "http://h:8023/a11yproject/a11yproject.com/-/issues?state=opened&sort=created_asc&page=1")
    assert not url_match(gold, "http://h:8023/a11yproject/a11yproject.com/-/issues?state=opened&sort=created_desc")
    assert not url_match(gold, "http://h:8023/a11yproject/a11yproject.com/-/issues")  # parameters missing
    either = "http://h:9999/f/deeplearning |OR| http://h:9999/f/MachineLearning"
    assert url_match(either, "http://h:9999/f/MachineLearning/")
    assert not url_match(either, "http://h:9999/f/technology")
    assert url_match("http://h/search?q=a b", "http://h/search?q=a+b")  # query values compared decoded
    with pytest.raises(UnsupportedEvaluation, match="url_note"):
        url_match(gold, gold, rule="EXACT")


async def test_url_match_on_the_final_page(page: Page, urls: SiteUrls) -> None:
    task = sample_task(45, urls)
    await page.goto(f"{urls.url('gitlab')}/a11yproject/a11yproject.com/-/issues/?state=opened&sort=created_asc")
    assert (await evaluate(task, answer=None, page=page)).score == 1.0
    await page.goto(f"{urls.url('gitlab')}/a11yproject/a11yproject.com/-/issues/?state=closed&sort=created_asc")
    result = await evaluate(task, answer=None, page=page)
    assert result.score == 0.0 and "url_match" in result.details[0]


# -- program_html on saved pages ------------------------------------------------------------------------


async def test_program_html_last_page_with_typed_text(page: Page, urls: SiteUrls) -> None:
    # WebArena's locator as written (the attribute selector lacks its "]": browsers accept that).
    target = {
        "url": "last",
        "locator": f"document.querySelector('[title=\"{MIND}\"').value",
        "required_contents": {"must_include": ["refund", "it broke after three days of use", "000000180"]},
    }
    task = html_task(urls, "shopping", [target])
    await page.goto(f"{urls.url('shopping')}/contact/")
    await page.get_by_label(MIND).fill("I'd like a Refund for order 000000180: it broke after three days of use.")
    assert (await evaluate(task, answer=None, page=page)).score == 1.0
    await page.get_by_label(MIND).fill("Hello, I have a question about order 000000180.")
    result = await evaluate(task, answer=None, page=page)
    assert result.score == 0.0
    assert sum("FAIL" in line for line in result.details) == 2


async def test_program_html_opens_the_target_url(page: Page, urls: SiteUrls) -> None:
    edit = f"{urls.url('shopping_admin')}/catalog/product/edit/id/418/"
    price = {"url": edit, "locator": "document.querySelector('[name=\"product[price]\"').value"}
    stock = {
        "url": edit,
        "locator": "document.querySelector('[name=\"product[quantity_and_stock_status][is_in_stock]\"').value",
        "required_contents": {"exact_match": "0"},
    }
    passing = html_task(urls, "shopping_admin", [price | {"required_contents": {"exact_match": "38.25"}}, stock])
    result = await evaluate(passing, answer=None, page=page, settle_s=1.0)
    assert result.score == 1.0, result.details
    assert page.url == edit
    failing = html_task(urls, "shopping_admin", [price | {"required_contents": {"exact_match": "38.00"}}])
    assert (await evaluate(failing, answer=None, page=page, settle_s=1.0)).score == 0.0


async def test_program_html_prep_actions(page: Page, urls: SiteUrls) -> None:
    target = {
        "url": f"{urls.url('shopping_admin')}/sales_rule/promo_quote/edit/id/5/",
        "locator": "document.querySelector('[name=\"simple_action\"').value",
        "prep_actions": [
            "document.querySelector('[data-index=\"actions\"]').querySelector('.admin__collapsible-title').click()"
        ],
        "required_contents": {"exact_match": "by_percent"},
    }
    assert (
        await evaluate(html_task(urls, "shopping_admin", [target]), answer=None, page=page, settle_s=1.0)
    ).score == 1.0
    # Without opening the section, the field does not exist: nothing selected, no match.
    unopened = {k: v for k, v in target.items() if k != "prep_actions"}
    result = await evaluate(html_task(urls, "shopping_admin", [unopened]), answer=None, page=page, settle_s=1.0)
    assert result.score == 0.0 and "got ''" in result.details[0]


async def test_program_html_gitlab_member_role_and_page_content(page: Page, urls: SiteUrls) -> None:
    members = f"{urls.url('gitlab')}/byteblaze/timeit/-/project_members"
    role = "func:gitlab_get_project_memeber_role(__page__, '{}')"
    guest = {"url": members, "locator": role.format("yjlou"), "required_contents": {"must_include": ["Guest"]}}
    # The table is rendered by script after load: evaluation waits for the page to settle.
    content = {"url": "last", "locator": "", "required_contents": {"must_include": ["@yjlou", "Jia-Lin Lou"]}}
    assert (await evaluate(html_task(urls, "gitlab", [guest, content]), answer=None, page=page)).score == 1.0
    developer = guest | {"locator": role.format("abisubramanya27")}
    nobody = guest | {"locator": role.format("nobody")}
    result = await evaluate(html_task(urls, "gitlab", [developer, nobody]), answer=None, page=page)
    assert result.score == 0.0
    assert all("FAIL" in line for line in result.details)


async def test_program_html_gitlab_project_with_or(page: Page, urls: SiteUrls) -> None:
    project = f"{urls.url('gitlab')}/byteblaze/11711_gitlab"
    targets = [
        {
            "url": project,
            "locator": "document.querySelector('.visibility-icon').getAttribute('title')",
            "required_contents": {"must_include": ["Private"]},
        },
        {
            "url": project,
            "locator": "document.querySelector('.home-panel-description-markdown').outerText",
            "required_contents": {
                "must_include": [
                    "A Jekyll site that uses Netlify for CI/CD |OR| Example Jekyll site using GitLab Pages: "
                    "https://pages.gitlab.io/jekyll"
                ]
            },
        },
    ]
    assert (await evaluate(html_task(urls, "gitlab", targets), answer=None, page=page, settle_s=1.0)).score == 1.0
    targets[0]["required_contents"] = {"must_include": ["Public"]}
    assert (await evaluate(html_task(urls, "gitlab", targets), answer=None, page=page, settle_s=1.0)).score == 0.0


async def test_program_html_reddit_post_from_last_url(page: Page, urls: SiteUrls) -> None:
    task = sample_task(638, urls)  # url_match on the forum + the post's text via reddit_get_post_url
    reddit = urls.url("reddit")
    await page.goto(f"{reddit}/f/BuyItForLife/12345/must-have-products-for-life")
    result = await evaluate(task, answer=None, page=page, settle_s=1.0)
    assert result.score == 1.0, result.details
    # Ending on the forum itself: the URL matches, but there is no post to read.
    await page.goto(f"{reddit}/f/BuyItForLife")
    result = await evaluate(task, answer=None, page=page, settle_s=1.0)
    assert result.score == 0.0
    assert result.details[0].endswith("pass") and "FAIL" in result.details[1]
    assert postmill_post_url(f"{reddit}/f/BuyItForLife/12345/slug/comment/9") == f"{reddit}/f/BuyItForLife/12345/"


async def test_program_html_shop_api_helpers(page: Page, urls: SiteUrls, shop_api: ShopApi) -> None:
    order = sample_task(436, urls)  # func:shopping_get_latest_order_url() + the ordered items' SKUs
    shop_api.latest_order = "000000170"
    result = await evaluate(order, answer=None, page=page, site_urls=urls, settle_s=1.0)
    assert result.score == 1.0, result.details
    assert page.url == f"{urls.url('shopping')}/sales/order/view/order_id/170/"
    shop_api.latest_order = "000000171"  # the newest order is another one
    assert (await evaluate(order, answer=None, page=page, site_urls=urls, settle_s=1.0)).score == 0.0
    with pytest.raises(UnsupportedEvaluation, match="site_urls"):
        await evaluate(order, answer=None, page=page)

    review = [
        {
            "url": "last",
            "locator": "func:shopping_get_sku_latest_review_rating('B00J8RZL7I')",
            "required_contents": {"must_include": ["100"]},
        },
        {
            "url": "last",
            "locator": "func:shopping_get_sku_latest_review_author('B00J8RZL7I')",
            "required_contents": {"must_include": ["Emma Lopez"]},
        },
    ]
    result = await evaluate(html_task(urls, "shopping_admin", review), answer=None, page=page, site_urls=urls)
    assert result.score == 1.0, result.details


async def test_unknown_helpers_and_types_are_unsupported(page: Page, urls: SiteUrls) -> None:
    target = {"url": "last", "locator": "func:wiki_page_views('Pittsburgh')", "required_contents": {"exact_match": "1"}}
    with pytest.raises(UnsupportedEvaluation, match="wiki_page_views"):
        await evaluate(html_task(urls, "gitlab", [target]), answer=None, page=page)
    target["locator"] = "func:__import__('os').system('true')"
    with pytest.raises(UnsupportedEvaluation, match="not name"):
        await evaluate(html_task(urls, "gitlab", [target]), answer=None, page=page)
    target["locator"] = "$('.price').text()"
    with pytest.raises(UnsupportedEvaluation, match="unknown locator"):
        await evaluate(html_task(urls, "gitlab", [target]), answer=None, page=page)
    down = {"url": "http://127.0.0.1:9/", "locator": "", "required_contents": {"must_include": ["x"]}}
    with pytest.raises(EvaluationError, match="could not open http://127"):
        await evaluate(html_task(urls, "gitlab", [down]), answer=None, page=page)
    task = sample_task(0, urls)
    weird = WebArenaTask(**{**task.__dict__, "eval": {"eval_types": ["screenshot_match"]}})
    with pytest.raises(UnsupportedEvaluation, match="screenshot_match"):
        await evaluate(weird, answer="x", page=page)
    assert isinstance(await evaluate(task, answer="x", page=page), EvalResult)
