"""The dashboard in a real headless browser (Debian's chromium through chromedriver and Selenium),
against a real ``lakeshore server`` + ``nymph`` (LocalStack): sign in, watch a submitted
invocation appear and finish, follow a live stream and a function's live output, cancel a running
invocation.

Also (issue 35) the overview's charts (queue depth and throughput over the last hour, drawn by
the vendored uPlot), an invocation's arguments and result, the live output following its tail, and
a ``map`` shown as one sweep with its progress.

Screenshots go to ``$LAKESHORE_ARTIFACTS`` (CI keeps them) or ``tests/artifacts``; the README's
and docs' pictures are saved in ``docs/img`` (``dashboard-*.png``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dreamlake.lakeshore.devstack import LocalStack
from tests.conftest import require

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
DOCS_IMG = ROOT / "docs" / "img"
CHROME_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=1280,860",
)

pytestmark = pytest.mark.slow


def artifacts() -> Path:
    path = Path(os.environ.get("LAKESHORE_ARTIFACTS") or ROOT / "tests" / "artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    require(
        chromium is not None and driver_path is not None,
        "a browser: apt-get install chromium chromium-driver",
    )
    pytest.importorskip("selenium", reason="selenium (the test extra)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(chromium)
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chrome-profile'}")
    driver = webdriver.Chrome(service=Service(str(driver_path)), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def stack() -> Iterator[LocalStack]:
    with LocalStack(queues=["demo"], concurrency=2, pythonpath=[EXAMPLES], quiet=True) as s:
        yield s


def _wait(driver: Any, what: str, check: Callable[[Any], Any], timeout: float = 30.0) -> Any:
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, ignored_exceptions=(StaleElementReferenceException,)).until(
            check
        )
    except TimeoutException:
        shot = artifacts() / f"timeout-{what.replace(' ', '-')}.png"
        driver.save_screenshot(str(shot))
        raise AssertionError(
            f"gave up waiting for {what} (page saved as {shot}):\n{driver.page_source[:3000]}"
        ) from None


def _css(driver: Any, selector: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return list(driver.find_elements(By.CSS_SELECTOR, selector))


def test_dashboard_in_a_real_browser(
    stack: LocalStack, browser: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from selenium.webdriver.common.by import By

    monkeypatch.syspath_prepend(str(EXAMPLES))
    import workload  # examples/workload.py, which nymph imports by reference too

    plane = stack.plane()
    shots = artifacts()
    url = stack.url

    browser.get(url + "/ui")
    assert browser.current_url.endswith("/ui/login")
    browser.find_element(By.ID, "token").send_keys("lsk_not-a-token")
    browser.find_element(By.ID, "sign-in").click()
    _wait(browser, "a refused login", lambda d: _css(d, "#login-error"))
    assert "unknown token" in browser.find_element(By.ID, "login-error").text
    browser.find_element(By.ID, "token").send_keys(stack.tokens["admin"])
    browser.find_element(By.ID, "sign-in").click()
    _wait(browser, "the overview", lambda d: _css(d, "#workers tr[data-worker] .badge.ok"))
    assert "lakeshore_session" not in browser.execute_script("return document.cookie")  # HttpOnly

    # A submitted invocation appears in the open list and finishes, without a reload.
    browser.get(url + "/ui/invocations")
    _wait(browser, "the invocation list", lambda d: _css(d, "#invocation-list"))
    inv = workload.add.submit(2, 3, _dispatch=plane)
    _wait(browser, "the new invocation", lambda d: _css(d, f'tr[data-id="{inv}"]'))
    _wait(browser, "it to succeed", lambda d: _css(d, f'tr[data-id="{inv}"][data-state="succeeded"]'))
    browser.save_screenshot(str(shots / "invocations.png"))

    # Its page shows its arguments and its result, decoded (plain values), and how it travelled.
    browser.get(f"{url}/ui/invocations/{inv}")
    _wait(browser, "its arguments and result", lambda d: _css(d, "#arguments") and _css(d, "#result"))
    assert browser.find_element(By.ID, "arguments").text.startswith("args\n[2, 3]")
    assert browser.find_element(By.ID, "result").text == "5"
    assert "by reference" in browser.find_element(By.ID, "live").text

    # A map is one sweep: one row with its progress, filled as its calls finish; its own list
    # shows its calls.
    calls = workload.add.map(range(40), range(40), _dispatch=plane)
    browser.get(url + "/ui/invocations")
    _wait(
        browser,
        "the sweep to finish",
        lambda d: _css(d, '#sweeps tr[data-finished="40"][data-total="40"]'),
        timeout=90,
    )
    (sweep,) = [r.get_attribute("data-sweep") for r in _css(browser, "#sweeps tr[data-sweep]")]
    groups = _css(browser, f'#invocation-list tr.group[data-group="{sweep}"]')
    assert len(groups) == 1 and "40 succeeded" in groups[0].text  # one line, not 40
    assert not any(_css(browser, f'#invocation-list tr[data-id="{c}"]') for c in calls)
    browser.save_screenshot(str(DOCS_IMG / "dashboard-sweep.png"))
    browser.get(f"{url}/ui/invocations?sweep={sweep}")
    _wait(browser, "the sweep's own list", lambda d: len(_css(d, "#invocation-list tr[data-id]")) == 40)

    # A live stream: frames arrive while the generator runs, then END and the final state.
    inv = workload.countdown.submit(8, 0.5, _dispatch=plane)
    browser.get(f"{url}/ui/invocations/{inv}")
    _wait(
        browser,
        "live frames",
        lambda d: _css(d, '#live[data-state="running"]') and len(_css(d, 'tr[data-kind="value"]')) >= 2,
    )
    seen_running = len(_css(browser, 'tr[data-kind="value"]'))
    assert seen_running < 8
    browser.save_screenshot(str(shots / "invocation-live.png"))
    _wait(
        browser,
        "the end of the stream",
        lambda d: _css(d, '#live[data-state="succeeded"] tr[data-kind="end"]'),
    )
    assert len(_css(browser, 'tr[data-kind="value"]')) == 8
    assert "'left': 1" in browser.find_element(By.CSS_SELECTOR, 'tr[data-seq="7"]').text
    assert not _css(browser, "#cancel")

    # Live output: what the function prints appears while it runs, stderr marked apart.
    inv = workload.chatter.submit(12, 0.4, _dispatch=plane)
    browser.get(f"{url}/ui/invocations/{inv}")
    _wait(
        browser,
        "live output",
        lambda d: (
            _css(d, '#live[data-state="running"]') and "step 3 of 12" in d.find_element(By.ID, "output").text
        ),
    )
    assert "step 12 of 12" not in browser.find_element(By.ID, "output").text  # it still runs
    assert "step 3: a warning on stderr" in browser.find_element(By.CSS_SELECTOR, "#output .stderr").text
    browser.save_screenshot(str(shots / "invocation-output.png"))
    _wait(browser, "the whole output", lambda d: _css(d, '#live[data-state="succeeded"]'))
    text = browser.find_element(By.ID, "output").text
    assert [line for line in text.splitlines() if line.startswith("step") and "of" in line] == [
        f"step {i} of 12" for i in range(1, 13)
    ]

    # The live output follows its tail: more lines than the pane holds, and the newest in view.
    inv = workload.chatter.submit(90, 0.05, _dispatch=plane)
    browser.get(f"{url}/ui/invocations/{inv}")
    tail = (
        "var o = document.getElementById('output');"
        "return o ? [o.scrollHeight > o.clientHeight, o.scrollHeight - o.scrollTop - o.clientHeight] : null;"
    )
    _wait(
        browser,
        "a long live output",
        lambda d: (
            _css(d, '#live[data-state="running"]')
            and (d.execute_script(tail) or [False])[0]
            and "step 40 of 90" in d.find_element(By.ID, "output").text
        ),
        timeout=60,
    )
    overflowing, below = browser.execute_script(tail)
    assert overflowing and below <= 24, below  # at its tail while it grows
    browser.save_screenshot(str(DOCS_IMG / "dashboard-invocation.png"))
    _wait(browser, "the end of the long output", lambda d: _css(d, '#live[data-state="succeeded"]'))
    overflowing, below = browser.execute_script(tail)
    assert "step 90 of 90" in browser.find_element(By.ID, "output").text and below <= 24

    # Cancel a running invocation from its page.
    inv = workload.countdown.submit(1000, 0.5, _dispatch=plane)
    browser.get(f"{url}/ui/invocations/{inv}")
    _wait(browser, "it to run", lambda d: _css(d, '#live[data-state="running"] tr[data-kind="value"]'))
    browser.find_element(By.CSS_SELECTOR, "#cancel button").click()
    _wait(browser, "the cancel to land", lambda d: _css(d, '#live[data-state="killed"]'))
    assert "Cancelled" in browser.find_element(By.ID, "error-summary").text
    browser.save_screenshot(str(shots / "invocation-cancelled.png"))

    browser.get(url + "/ui")
    _wait(browser, "the demo queue", lambda d: _css(d, '#queues tr[data-queue="demo"]'))
    row = browser.find_element(By.CSS_SELECTOR, '#queues tr[data-queue="demo"]').text.split()
    assert row[:3] == ["demo", "0", "0"]
    # killed (the cancel above) has a column of its own: succeeded, failed, killed, timed out
    assert row[-5:-1] == ["44", "0", "1", "0"], row

    # The charts: drawn by uPlot from the page's data, depth and throughput over the last hour;
    # the throughput chart's data counts every call this test finished.
    _wait(browser, "the charts", lambda d: len(_css(d, ".chart .uplot canvas")) == 2)
    spec = json.loads(browser.find_element(By.ID, "chart-throughput").get_attribute("data-chart"))
    finished = sum(sum(s["values"]) for s in spec["series"])
    assert finished == 45, spec  # 44 succeeded (add, the map's 40, countdown, 2 chatters) + 1 killed
    depth = json.loads(browser.find_element(By.ID, "chart-depth").get_attribute("data-chart"))
    assert [s["label"] for s in depth["series"]] == ["demo"]  # the map's calls waited in it
    assert max(depth["series"][0]["values"]) >= 2
    assert browser.find_element(By.CSS_SELECTOR, "#chart-depth .u-legend").text.count("demo") == 1
    browser.save_screenshot(str(shots / "overview.png"))
    browser.save_screenshot(str(DOCS_IMG / "dashboard-overview.png"))
