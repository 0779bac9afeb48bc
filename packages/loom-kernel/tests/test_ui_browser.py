"""`loom ui` in a real browser: headless Chromium (scripts/install-chromium) driven by
selenium loads the run list of a store with runs in every state, filters it, follows
a run's link, acts on it through its form, and opens the queues page; a screenshot of
each page is kept (LOOM_ARTIFACTS, by default .artifacts/ui at the repository's top).
Skipped, saying so, where the browser is missing."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from loom_kernel import Context, Engine, Queue, flow, open_store
from loom_kernel._hosting._ui import serve

_BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
_DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    _BROWSER is None or _DRIVER is None,
    reason="SKIPPED LOUDLY: headless Chromium is not installed (chromium, chromedriver); "
    "run scripts/install-chromium (as root) to test the web view in a real browser",
)
_ARTIFACTS = Path(
    os.environ.get("LOOM_ARTIFACTS", Path(__file__).resolve().parents[3] / ".artifacts")
)


@flow(name="web.parks")
def parks(ctx: Context, _input: Any) -> Any:
    ctx.step("prepare", lambda: {"ready": True})
    ctx.set_event("progress", "half")
    return ctx.receive("go")


@flow(name="web.done")
def done(ctx: Context, number: int) -> Any:
    return ctx.step("double", lambda: number * 2)


@flow(name="web.fails")
def fails(ctx: Context, _input: Any) -> Any:
    raise ValueError("declined")


QUEUE = Queue("web", concurrency=1)


@pytest.fixture
def site(tmp_path: Path) -> Iterator[str]:
    store = open_store(f"sqlite:///{tmp_path}/web.db")
    engine = Engine(store, [parks, done, fails], listeners=[], queues=[QUEUE])
    engine.start("web.parks", None, key="order-1")  # suspended
    engine.start("web.parks", None, key="order-1/c0", parent="order-1")
    engine.start("web.done", 21, key="done-1")  # completed
    engine.start("web.fails", None, key="failed-1")  # failed
    engine.start("web.parks", None, key="cancelled-1")
    engine.cancel("cancelled-1", "no longer wanted")  # cancelled
    engine.enqueue("web.done", 1, key="queued-1", queue="web")  # running: waits its queue
    server = serve(store, "127.0.0.1", 0, queues=[QUEUE], allow_actions=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        store.close()


@pytest.fixture
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.add_argument("--window-size=1280,900")
    assert _BROWSER is not None
    options.binary_location = _BROWSER
    driver = webdriver.Chrome(service=Service(_DRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _shot(browser: Any, name: str) -> None:
    _ARTIFACTS.joinpath("ui").mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(_ARTIFACTS / "ui" / f"{name}.png"))


def _showing(browser: Any, text: str, seconds: float = 15.0) -> str:
    """The page's text once it shows `text`: a click's navigation may still be under
    way when the click returns."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def body(driver: Any) -> str | None:
        shown = str(driver.find_element(By.TAG_NAME, "body").text)
        return shown if text in shown else None

    ignored = (NoSuchElementException, StaleElementReferenceException)
    return str(WebDriverWait(browser, seconds, ignored_exceptions=ignored).until(body))


def test_the_web_view_in_a_real_browser(site: str, browser: Any) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    browser.get(site)
    assert browser.title == "Runs · Loom"
    rows = browser.find_elements(By.CSS_SELECTOR, "table tr")[1:]
    statuses = {row.find_elements(By.TAG_NAME, "td")[2].text for row in rows}
    assert statuses == {"running", "suspended", "completed", "failed", "cancelled"}
    _shot(browser, "runs")

    Select(browser.find_element(By.NAME, "status")).select_by_visible_text("failed")
    browser.find_element(By.TAG_NAME, "button").click()
    WebDriverWait(browser, 15).until(lambda driver: "status=failed" in driver.current_url)
    rows = browser.find_elements(By.CSS_SELECTOR, "table tr")[1:]
    assert [row.find_element(By.TAG_NAME, "a").text for row in rows] == ["failed-1"]
    _shot(browser, "runs-failed")

    browser.get(site)
    browser.find_element(By.LINK_TEXT, "order-1").click()
    WebDriverWait(browser, 15).until(lambda driver: driver.title == "order-1 · Loom")
    assert browser.find_element(By.LINK_TEXT, "order-1/c0").is_displayed(), "the tree"
    assert "progress" in browser.find_element(By.TAG_NAME, "body").text
    _shot(browser, "run")

    send = browser.find_element(By.CSS_SELECTOR, "form[action$='/send']")
    message = send.find_element(By.NAME, "message")
    message.clear()
    message.send_keys('"ship it"')
    send.find_element(By.NAME, "topic").send_keys("go")
    send.find_element(By.TAG_NAME, "button").click()
    assert "ship it" in _showing(browser, "is in its inbox")
    _shot(browser, "run-after-send")

    cancel = browser.find_element(By.CSS_SELECTOR, "form[action$='/cancel']")
    cancel.find_element(By.NAME, "reason").send_keys("from the browser")
    cancel.find_element(By.TAG_NAME, "button").click()
    assert "from the browser" in _showing(browser, "Cancelled.")
    _shot(browser, "run-cancelled")

    browser.find_element(By.LINK_TEXT, "Queues").click()
    assert "queued-1" in _showing(browser, "concurrency 1")
    _shot(browser, "queues")
