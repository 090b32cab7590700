"""Chapter 07f's chat page as a reader meets it: `python -m minfer.serve --api-key KEY` in a real process (every
chapter loaded, as `minfer serve` loads them), the page at `/` open to anyone while the API behind it is not, named
on the start-up line, and opened in headless Chromium: it asks for the key once, streams an answer in many updates
with TTFT, tokens/s and bytes per token under it, carries the conversation into a second turn, and its Stop button
aborts a long answer on the server.

Chromium: `bash tools/install_chromium.sh`. Without it the browser test skips, with the reason, unless CI is set: in
CI it fails."""
import argparse, os, re, shutil, time

import httpx
import pytest

from serving import server_process, wait_for_idle

MODEL = "smollm2-135m-instruct"
KEY = "page-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    "The server process, with a key: yields (base URL, process)."
    with server_process("--max-num-seqs", "4", "--api-key", KEY) as running:
        yield running


@pytest.fixture(scope="module")
def url(server):
    return server[0]


@pytest.fixture(scope="module")
def http(url):
    "A client that holds the key."
    with httpx.Client(base_url=url, headers=AUTH, timeout=120) as c:
        yield c


def test_the_start_up_line_names_the_page(server):
    ready = next(line.strip() for line in server[1].log if "ready on" in line)
    expected = r"ready on http://127\.0\.0\.1:\d+ \(chat page at /, OpenAI API under /v1\)$"
    assert re.search(expected, ready), ready


def test_the_page_is_open_and_the_api_behind_it_is_not(url, http):
    with httpx.Client(base_url=url, timeout=60) as stranger:
        page = stranger.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "<title>minfer chat</title>" in page.text
        for path in ("/v1/models", "/metrics"):
            assert stranger.get(path).status_code == 401, path
        assert stranger.post("/v1/chat/completions", json={"messages": []}).status_code == 401
    assert http.get("/").text == page.text  # the same static text for a key holder


def test_the_key_flag_says_the_page_is_open():
    from minfer.serve import add_serve_args
    help_text = " ".join(add_serve_args(argparse.ArgumentParser()).format_help().split())
    assert "every request but / and /health" in help_text


@pytest.fixture(scope="module")
def browser():
    chromium = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    driver_path = shutil.which("chromedriver")
    if not (chromium and driver_path):
        msg = "headless Chromium and chromedriver are needed: bash tools/install_chromium.sh"
        if os.environ.get("CI"):
            pytest.fail(msg + " (CI is set, so the page must be tested)")
        pytest.skip(msg)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--window-size=1100,900"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=opts, service=Service(executable_path=driver_path))
    yield driver
    driver.quit()


def aborted_chats(http, at_least=0.0, seconds=10):
    "The server's count of chat requests whose client went away, once it is `at_least` (or after `seconds`)."
    deadline, count = time.time() + seconds, 0.0
    while True:
        lines = http.get("/metrics").text.splitlines()
        name = 'minfer_requests_total{endpoint="chat",outcome="aborted"}'
        count = next((float(line.split()[-1]) for line in lines if line.startswith(name)), 0.0)
        if count >= at_least or time.time() > deadline:
            return count
        time.sleep(0.05)


def test_the_page_asks_for_the_key_streams_and_shows_metrics(url, browser, http):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    browser.get(url + "/")
    wait = WebDriverWait(browser, 60)
    prompt = wait.until(lambda d: d.switch_to.alert)  # its first look at /v1/models got a 401
    prompt.send_keys(KEY)
    prompt.accept()
    wait.until(lambda d: "kv=paged" in d.find_element(By.ID, "engine").text)
    assert MODEL in browser.find_element(By.ID, "engine").text
    # count how often the answer's text changes: streamed tokens arrive in many updates, not one
    browser.execute_script("""
        window.updates = 0;
        new MutationObserver(() => window.updates++).observe(
            document.getElementById("log"), {subtree: true, characterData: true, childList: true});""")
    browser.find_element(By.ID, "max-tokens").clear()
    browser.find_element(By.ID, "max-tokens").send_keys("12")
    browser.find_element(By.ID, "input").send_keys("What is the capital of France?")
    browser.find_element(By.ID, "send").click()
    metrics = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".assistant .metrics[data-ttft-ms]"))
    answer = browser.find_element(By.CSS_SELECTOR, ".assistant .text").text
    assert "Paris" in answer
    assert browser.execute_script("return window.updates") > 5
    text = metrics.text
    assert "TTFT" in text and "tokens/s" in text and "MB/token" in text, text
    assert float(metrics.get_attribute("data-ttft-ms")) > 0
    assert float(metrics.get_attribute("data-tokens-per-s")) > 0
    assert float(metrics.get_attribute("data-bytes-per-token")) > 1e6  # a 135M-parameter model moves MBs per token
    # the console's one error is the 401 the page got before it had the key
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE" and "401" not in e["message"]]
    assert not errors, errors
    # a second turn carries the conversation
    browser.find_element(By.ID, "input").send_keys("And of Italy?")
    browser.find_element(By.ID, "send").click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".assistant .metrics[data-ttft-ms]")) == 2)
    assert len(browser.find_elements(By.CSS_SELECTOR, ".user")) == 2
    assert not browser.find_elements(By.CSS_SELECTOR, ".assistant.error")
    assert wait_for_idle(http)["blocks_in_use"] == 0
    # Stop, once a long answer has begun: the server aborts the request and frees its blocks
    before = aborted_chats(http)
    browser.find_element(By.ID, "max-tokens").clear()
    browser.find_element(By.ID, "max-tokens").send_keys("1000")
    browser.find_element(By.ID, "input").send_keys("Tell me a long story about a dragon.")
    browser.find_element(By.ID, "send").click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".assistant .text")) == 3
               and d.find_elements(By.CSS_SELECTOR, ".assistant .text")[2].text)
    browser.find_element(By.ID, "stop").click()
    third = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".assistant .metrics[data-ttft-ms]")[2:])[0]
    assert third.text.endswith("aborted"), third.text
    assert wait_for_idle(http)["blocks_in_use"] == 0
    assert aborted_chats(http, at_least=before + 1) == before + 1
