"""The web playground on a real server: the page and its static files, the /v1/stats/stream
server-sent events (format, cadence, several watchers), and the page itself in headless
Chromium driven by Selenium: a streamed chat reply (markup in it shown as text), the scheduler
pane moving under 32 concurrent requests, the stop button aborting on the server, a console
with no errors, and a server with an API key (the page open, its API calls taking the key)."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(600)

EVENT_KEYS = {"version", "time", "waiting", "running", "swapped", "kv_usage",
              "prefix_cache_hit_rate", "batch_size", "tokens_per_step", "output_tokens_per_s",
              "preemptions", "num_requests", "requests", "watchers"}
ABORTED = "conveyor:request_success_total{finished_reason=abort}"
# SmolLM2's greedy reply to this starts with a fenced <script> element.
MARKUP_PROMPT = "Write an HTML page with a <script> tag that says hello."


def _read_events(base_url: str, count: int, interval: float) -> list[tuple[float, dict]]:
    """(arrival time, event) of the first ``count`` events, checking the wire format."""
    events = []
    with httpx.stream("GET", f"{base_url}/v1/stats/stream", params={"interval": interval},
                      timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        buffer = ""
        for text in resp.iter_text():
            buffer += text
            while "\n\n" in buffer and len(events) < count:
                block, buffer = buffer.split("\n\n", 1)
                assert block.startswith("data: ") and "\n" not in block, block
                events.append((time.monotonic(), json.loads(block[len("data: "):])))
            if len(events) == count:
                return events
    raise AssertionError(f"the stream ended after {len(events)} events")


def _load(base_url: str, n: int, max_tokens: int) -> list[str]:
    """``n`` concurrent completions; their finish reasons."""
    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                                    timeout=300)
        async with client:
            model = (await client.models.list()).data[0].id

            async def one(i: int) -> str:
                r = await client.completions.create(
                    model=model, prompt=f"Request {i}: tell me about the sea.",
                    max_tokens=max_tokens, temperature=0.0, extra_body={"ignore_eos": True})
                return r.choices[0].finish_reason

            return await asyncio.gather(*(one(i) for i in range(n)))

    return asyncio.run(run())


# ---------------------------------------------------------------- HTTP only


def test_page_and_static_files_are_served(server) -> None:
    page = httpx.get(server.base_url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/static/playground.js"' in page.text
    for name, kind in (("playground.js", "javascript"), ("playground.css", "text/css")):
        resp = httpx.get(f"{server.base_url}/static/{name}", timeout=10)
        assert resp.status_code == 200 and kind in resp.headers["content-type"]
    script = httpx.get(server.base_url + "/static/playground.js", timeout=10).text
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script
    assert "http://" not in page.text + script and "https://" not in page.text + script  # no CDN
    assert httpx.get(server.base_url + "/static/nope.js", timeout=10).status_code == 404


def test_stats_stream_format_and_cadence(server) -> None:
    events = _read_events(server.base_url, 6, interval=0.2)
    for _, event in events:
        assert EVENT_KEYS <= event.keys()
        assert 0.0 <= event["kv_usage"] <= 1.0 and event["total_blocks"] == 256
    versions = [e["version"] for _, e in events]
    assert versions == sorted(versions)
    gaps = [b - a for (a, _), (b, _) in zip(events[1:], events[2:], strict=False)]
    # At most one event per interval; an idle engine still sends one at least every second.
    assert all(0.15 <= g <= 1.5 for g in gaps), gaps


def test_stats_stream_rejects_a_bad_interval(server) -> None:
    for bad in ("abc", "0", "100", "nan"):
        resp = httpx.get(server.base_url + "/v1/stats/stream", params={"interval": bad},
                         timeout=10)
        assert resp.status_code == 400, bad
        assert resp.json()["error"]["param"] == "interval"


def test_closed_streams_stop_watching(server) -> None:
    long: list = []
    watcher = threading.Thread(target=lambda: long.extend(_read_events(server.base_url, 10, 0.2)))
    watcher.start()
    time.sleep(0.5)
    short = [threading.Thread(target=_read_events, args=(server.base_url, 3, 0.2))
             for _ in range(2)]
    for w in short:
        w.start()
    for w in short + [watcher]:
        w.join(60)
    counts = [e["watchers"] for _, e in long]
    assert counts[0] == 1 and max(counts) == 3 and counts[-1] == 1, counts


def test_several_watchers_see_the_engine_work(server) -> None:
    results: dict[int, list] = {}

    def watch(i: int) -> None:
        results[i] = _read_events(server.base_url, 14, interval=0.25)

    watchers = [threading.Thread(target=watch, args=(i,)) for i in range(3)]
    for w in watchers:
        w.start()
    time.sleep(0.5)
    finishes = _load(server.base_url, 8, max_tokens=24)
    for w in watchers:
        w.join(60)
    assert finishes == ["length"] * 8
    assert sorted(results) == [0, 1, 2]
    for events in results.values():
        seen = [e for _, e in events]
        assert max(e["running"] for e in seen) >= 2
        assert max(e["output_tokens_per_s"] for e in seen) > 0
        assert max(e["batch_size"] for e in seen) > 1
        assert max(e["num_requests"] for e in seen) >= 2
        totals = [e["generation_tokens_total"] for e in seen]
        assert totals == sorted(totals) and totals[-1] > totals[0]
        rows = [r for e in seen for r in e["requests"]]
        assert rows and {r["state"] for r in rows} <= {"running", "prefilling", "waiting",
                                                        "swapped"}
        assert all(r["id"].startswith("cmpl-") for r in rows)


# ---------------------------------------------------------------- the page in Chromium


def _chromium() -> tuple[str, str]:
    browser = next((p for p in map(shutil.which, ("chromium", "chromium-browser",
                                                    "google-chrome")) if p), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("no Chromium here: `apt-get install chromium chromium-driver` (make test "
                    "installs them where apt is available)")
    return browser, driver


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    browser_path, driver_path = _chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser_path
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                 "--window-size=1440,960",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(what: str, condition, timeout: float, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _text(driver, element_id: str) -> str:
    return driver.find_element("id", element_id).text


def _set(driver, element_id: str, value: str) -> None:
    field = driver.find_element("id", element_id)
    field.clear()
    if value:
        field.send_keys(value)


def _pane(driver) -> dict:
    """What the scheduler pane shows right now, read from the DOM."""
    return driver.execute_script("""
        const num = (id) => parseFloat(document.getElementById(id).textContent) || 0;
        return {running: num('stat-running'), waiting: num('stat-waiting'),
                batch: num('stat-batch_size'), tokens_per_s: num('stat-output_tokens_per_s'),
                kv: num('stat-kv_usage'), requests: num('num-requests'),
                rows: document.querySelectorAll('#requests tbody tr').length};""")


def _send(driver, text: str) -> tuple:
    """Send a chat message; the new (user, assistant) message elements."""
    before = len(driver.find_elements("css selector", "#messages .message"))
    _set(driver, "prompt", text)
    driver.find_element("id", "send").click()
    boxes = _wait("the reply box", lambda: (
        lambda b: b if len(b) >= before + 2 else None)(
            driver.find_elements("css selector", "#messages .message")), 10)
    return boxes[before], boxes[before + 1]


def test_playground_in_chromium(server, browser, tmp_path: Path) -> None:
    driver = browser
    driver.get(server.base_url + "/")
    _wait("the model name", lambda: "max_model_len" in _text(driver, "model-name"), 30)
    _wait("the stats stream", lambda: _text(driver, "stream-status").startswith("live"), 30)

    # A streamed reply; markup in the prompt and in the reply is shown as text, never parsed.
    _set(driver, "system-prompt", "")
    _set(driver, "temperature", "0")
    _set(driver, "max-tokens", "40")
    user, reply = _send(driver, MARKUP_PROMPT)
    assert user.find_element("css selector", ".content").text == MARKUP_PROMPT
    _wait("streamed text", lambda: reply.find_element("css selector", ".content").text, 120)
    meta = _wait("the reply to finish", lambda: reply.find_elements("css selector", ".meta"), 120)
    assert "finish: length" in meta[0].text or "finish: stop" in meta[0].text, meta[0].text
    content = reply.find_element("css selector", ".content")
    assert "<script>" in content.text
    assert driver.execute_script("return arguments[0].children.length", content) == 0
    assert driver.execute_script(
        "return document.querySelectorAll('#messages script, #messages img').length") == 0

    # 32 concurrent requests: the scheduler pane's counters move, then settle back.
    seen: list[dict] = []
    load = threading.Thread(target=lambda: seen.append({"finishes": _load(
        server.base_url, 32, max_tokens=32)}))
    load.start()
    shot, best = tmp_path / "playground.png", -1
    while load.is_alive():
        pane = _pane(driver)
        seen.append(pane)
        if pane["rows"] + pane["running"] > best and pane["tokens_per_s"] > 0:
            best = pane["rows"] + pane["running"]
            driver.save_screenshot(str(shot))
        time.sleep(0.15)
    load.join()
    finishes = next(s["finishes"] for s in seen if "finishes" in s)
    assert finishes == ["length"] * 32
    panes = [s for s in seen if "running" in s]
    assert max(p["running"] for p in panes) >= 8, panes
    assert max(p["rows"] for p in panes) >= 8
    assert max(p["requests"] for p in panes) >= 8
    assert max(p["batch"] for p in panes) > 1
    assert max(p["tokens_per_s"] for p in panes) > 0
    assert max(p["kv"] for p in panes) > 0
    assert shot.stat().st_size > 10_000
    _wait("the pane to settle", lambda: (lambda p: p["running"] == 0 and p["rows"] == 0)(
        _pane(driver)), 10)

    # The stop button aborts the request on the server.
    aborted = server.metrics().get(ABORTED, 0)
    _set(driver, "max-tokens", "400")
    _set(driver, "temperature", "0.8")
    _, reply = _send(driver, "Tell me a very long story about a lighthouse keeper.")
    _wait("streamed text", lambda: len(reply.find_element("css selector", ".content").text) > 20,
          120)
    driver.find_element("id", "stop-button").click()
    meta = _wait("the stopped reply", lambda: reply.find_elements("css selector", ".meta"), 10)
    assert meta[0].text == "stopped"
    _wait("the server to abort it", lambda: server.metrics().get(ABORTED, 0) > aborted, 10,
          poll=0.2)
    assert not driver.find_element("id", "send").get_attribute("disabled")
    driver.save_screenshot(str(tmp_path / "playground-after.png"))

    errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
    assert errors == []


def test_playground_behind_an_api_key(start_server, browser) -> None:
    key = "playground-test-key"
    keyed = start_server(["--api-key", key])
    for path in ("/", "/static/playground.js", "/static/playground.css"):
        assert httpx.get(keyed.base_url + path, timeout=10).status_code == 200, path
    stream = keyed.base_url + "/v1/stats/stream"
    assert httpx.get(stream, timeout=10).status_code == 401
    events = []
    with httpx.stream("GET", stream, headers={"Authorization": f"Bearer {key}"},
                      timeout=30) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
                break
    assert EVENT_KEYS <= events[0].keys()

    driver = browser
    driver.get(keyed.base_url + "/")
    _wait("the key prompt", lambda: "API key" in _text(driver, "model-name"), 30)
    _wait("the stream's key prompt", lambda: "API key" in _text(driver, "stream-status"), 30)
    _set(driver, "api-key", key)
    driver.find_element("id", "prompt").click()  # leaving the box fires its change event
    _wait("the model name", lambda: "max_model_len" in _text(driver, "model-name"), 30)
    _wait("the stats stream", lambda: _text(driver, "stream-status").startswith("live"), 30)
    _set(driver, "max-tokens", "8")
    _, reply = _send(driver, "Hello!")
    meta = _wait("the reply to finish", lambda: reply.find_elements("css selector", ".meta"), 120)
    assert meta[0].text.startswith("finish:"), meta[0].text
    # The only console errors are the two refused calls made before the key was given.
    errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert len(errors) <= 2 and all("401" in m for m in errors), errors
