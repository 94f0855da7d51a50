"""The chat page that ``ember serve`` serves at /, driven in headless Chromium against a real server: API key entry,
a streamed reply that grows, Stop (which must make the server abort the request), a complete second reply, and
screenshots at desktop and phone sizes."""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.request
from pathlib import Path

import pytest
from server_utils import TEST_ENGINE_ARGS, metric_sum, running_server

KEY = "page-test-key"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
# the reply being written is always the last element of the conversation
LAST_REPLY = "#messages > .msg.assistant:last-child"
REPLY_LENGTH = f"document.querySelector('{LAST_REPLY} .text').textContent.length"  # JavaScript


def get(url: str) -> str:
    """GET with the API key, which /v1/models needs."""
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.read().decode()


def ask(page, question: str) -> None:
    page.fill("#prompt", question)
    page.press("#prompt", "Enter")


def reply_length(page) -> int:
    return page.evaluate(REPLY_LENGTH)


def test_chat_page_streams_stops_and_fits_desktop_and_phone(tmp_path):
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium binary on PATH (Debian package: chromium)")
    folder = Path(os.environ.get("EMBER_SCREENSHOTS") or tmp_path / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    print(f"screenshots: {folder}")

    with running_server(*TEST_ENGINE_ARGS, "--api-key", KEY) as srv, sync_playwright() as p:
        model = json.loads(get(f"{srv.url}/v1/models"))["data"][0]["id"]
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        context = browser.new_context(viewport=DESKTOP)
        context.set_default_timeout(30_000)
        page_errors: list[str] = []
        context.on("weberror", lambda e: page_errors.append(str(e.error)))
        page = context.new_page()
        page.goto(srv.url)

        # the server wants a key: the page asks for it (its /v1/models got 401), then shows the model's name
        page.fill("#api-key", KEY)
        page.press("#api-key", "Enter")
        expect(page.locator("#api-key")).to_be_hidden()
        expect(page.locator("#model-name")).to_have_text(model)

        # a long reply, so that it is still streaming when we look twice and press Stop
        page.fill("#temperature", "0.7")
        page.fill("#max-tokens", "512")
        ask(page, "Write a long story about a dragon who learns to bake bread.")
        page.wait_for_function(f"{REPLY_LENGTH} > 0")
        first = reply_length(page)
        page.wait_for_function(f"{REPLY_LENGTH} > {first + 40}")  # it grows while streaming
        send = page.locator("#send")
        expect(send).to_have_text("Stop")
        send.click()
        expect(send).to_have_text("Send")
        expect(page.locator(f"{LAST_REPLY} .stats")).to_contain_text("stopped")
        assert reply_length(page) > first  # the partial reply stays

        # dropping the connection must abort the request in the engine, not let it run to max_tokens
        deadline = time.monotonic() + 20
        while metric_sum(get(f"{srv.url}/metrics"), "ember_request_success_total", finish_reason="abort") < 1:
            assert time.monotonic() < deadline, "the server did not count an aborted request:\n" + srv.log()[-3000:]
            time.sleep(0.5)

        page.fill("#max-tokens", "32")
        ask(page, "What is the capital of France?")
        expect(send).to_have_text("Send", timeout=120_000)
        stats = page.locator(f"{LAST_REPLY} .stats")
        expect(stats).to_contain_text("tok/s")
        expect(stats).not_to_contain_text("stopped")
        assert reply_length(page) > 0
        assert page.locator(".msg.assistant").count() == 2
        page.screenshot(path=folder / "desktop.png")

        # a fresh page at phone size: the key is remembered (localStorage), so it goes straight to chatting
        phone = context.new_page()
        phone.set_viewport_size(PHONE)
        phone.goto(srv.url)
        expect(phone.locator("#model-name")).to_have_text(model)
        expect(phone.locator("#api-key")).to_be_hidden()
        phone.click("#settings-toggle")  # on a phone the settings are folded away
        phone.fill("#max-tokens", "32")
        phone.click("#settings-toggle")
        ask(phone, "Name three colours.")
        expect(phone.locator("#send")).to_have_text("Send", timeout=120_000)
        expect(phone.locator(f"{LAST_REPLY} .stats")).to_contain_text("tok/s")
        phone.screenshot(path=folder / "phone.png")
        browser.close()

    assert not page_errors, page_errors
    for name in ("desktop.png", "phone.png"):
        assert (folder / name).stat().st_size > 0, name
