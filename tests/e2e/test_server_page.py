"""The chat page that ``ember serve`` serves at /, driven in headless Chromium against a real server: API key entry,
a streamed reply that grows, Stop (which must make the server abort the request), a complete second reply, and
screenshots at desktop and phone sizes. Then replies the page is handed (a canned event stream in place of the
model's): Markdown rendered, hostile HTML and links never run; and an attached image sent as an image_url part."""

from __future__ import annotations

import base64
import io
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


def sse(reply: str, piece: int = 7) -> str:
    """An OpenAI chat completion event stream that writes ``reply`` in deltas of ``piece`` characters (cutting through
    tags and fences, as a model's tokens would)."""
    def chunk(delta: dict, finish: str | None = None) -> str:
        body = {"id": "chatcmpl-page", "object": "chat.completion.chunk", "created": 0, "model": "canned",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return f"data: {json.dumps(body)}\n\n"
    deltas = [chunk({"role": "assistant", "content": ""})]
    deltas += [chunk({"content": reply[i:i + piece]}) for i in range(0, len(reply), piece)]
    return "".join(deltas) + chunk({}, "stop") + "data: [DONE]\n\n"


@pytest.fixture(scope="module")
def server():
    with running_server(*TEST_ENGINE_ARGS, "--api-key", KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium binary on PATH (Debian package: chromium)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def canned(server, browser):
    """A page at desktop size with the key already stored, whose chat requests get ``answer(request_body)``'s
    (status, body) instead of the model's reply; yields (page, the request bodies sent, a setter for answer)."""
    from playwright.sync_api import expect

    context = browser.new_context(viewport=DESKTOP)
    context.set_default_timeout(15_000)
    # the script runs in every document, about:blank too, where localStorage is out of bounds
    context.add_init_script(f"if (location.origin === {json.dumps(server.url)}) "
                            f"localStorage.setItem('ember-api-key', {json.dumps(KEY)})")
    errors: list[str] = []
    context.on("weberror", lambda e: errors.append(str(e.error)))
    page = context.new_page()
    bodies: list[dict] = []
    answer = {"fn": lambda body: (200, sse("ok"))}

    def handle(route):
        bodies.append(route.request.post_data_json)
        status, text = answer["fn"](bodies[-1])
        kind = "text/event-stream" if status == 200 else "application/json"
        route.fulfill(status=status, headers={"Content-Type": kind}, body=text)

    page.route("**/v1/chat/completions", handle)
    page.goto(server.url)
    expect(page.locator("#model-name")).not_to_have_text("connecting…")
    yield page, bodies, lambda fn: answer.update(fn=fn)
    context.close()
    assert not errors, errors


def wait_reply(page) -> None:
    """Until the reply asked for last has streamed to its end (and had its last render)."""
    from playwright.sync_api import expect

    expect(page.locator(".msg.streaming")).to_have_count(0)


def test_chat_page_streams_stops_and_fits_desktop_and_phone(tmp_path, server, browser):
    from playwright.sync_api import expect

    folder = Path(os.environ.get("EMBER_SCREENSHOTS") or tmp_path / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    print(f"screenshots: {folder}")

    model = json.loads(get(f"{server.url}/v1/models"))["data"][0]["id"]
    context = browser.new_context(viewport=DESKTOP)
    context.set_default_timeout(30_000)
    page_errors: list[str] = []
    context.on("weberror", lambda e: page_errors.append(str(e.error)))
    page = context.new_page()
    page.goto(server.url)

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
    while metric_sum(get(f"{server.url}/metrics"), "ember_request_success_total", finish_reason="abort") < 1:
        assert time.monotonic() < deadline, "the server did not count an aborted request:\n" + server.log()[-3000:]
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
    phone.goto(server.url)
    expect(phone.locator("#model-name")).to_have_text(model)
    expect(phone.locator("#api-key")).to_be_hidden()
    phone.click("#settings-toggle")  # on a phone the settings are folded away
    phone.fill("#max-tokens", "32")
    phone.click("#settings-toggle")
    ask(phone, "Name three colours.")
    expect(phone.locator("#send")).to_have_text("Send", timeout=120_000)
    expect(phone.locator(f"{LAST_REPLY} .stats")).to_contain_text("tok/s")
    phone.screenshot(path=folder / "phone.png")
    context.close()

    assert not page_errors, page_errors
    for name in ("desktop.png", "phone.png"):
        assert (folder / name).stat().st_size > 0, name


# Payloads a hostile (or prompt-injected) model could write; each would set window.__pwned or open a dialog if it ran.
HOSTILE = "\n\n".join([
    '<img src=x onerror="window.__pwned=1;alert(1)">',
    "<script>window.__pwned=2;alert(2)</script>",
    '<iframe src="javascript:parent.__pwned=3"></iframe>',
    "[click me](javascript:window.__pwned=4)",
    "[data link](data:text/html;base64,PHNjcmlwdD5hbGVydCg1KTwvc2NyaXB0Pg==)",
    '<a href="javascript:alert(6)">raw link</a>',
    '<div onclick="alert(7)">raw HTML block</div>',
    '<svg onload="window.__pwned=8"><script>alert(8)</script></svg>',
    '![pic](x" onerror="window.__pwned=9)',
    "![pic](javascript:alert(10))",
    '<details open ontoggle="window.__pwned=11">',
    "[reference][r]\n\n[r]: javascript:window.__pwned=12",
    "<javascript:alert(13)>",
    "[entity](&#106;avascript:alert(14))",
    "[spaced]( JAVASCRIPT:alert(15) )",
    '<math><mtext><table><mglyph><style><img src=x onerror="window.__pwned=16">',
    "[vb](vbscript:msgbox(17)) [file](file:///etc/passwd)",
    "A good link: [example](https://example.com/a?b=1)",
])

INSPECT = """() => {
  const all = [...document.getElementById("messages").querySelectorAll("*")];
  const bad = "script, iframe, object, embed, svg, math, style, img, details, div[onclick]";
  return {
    tags: all.filter((e) => e.matches(bad)).map((e) => e.outerHTML),
    on: all.flatMap((e) => [...e.attributes].filter((a) => /^on/i.test(a.name)).map((a) => `${e.tagName} ${a.name}`)),
    urls: all.flatMap((e) => ["href", "src", "action", "formaction"].map((a) => e.getAttribute(a)).filter((v) => v)),
    pwned: typeof window.__pwned,
  };
}"""


def test_hostile_reply_never_runs(canned):
    page, _, set_answer = canned
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    set_answer(lambda body: (200, sse(HOSTILE)))
    ask(page, "Say something nasty.")
    wait_reply(page)
    page.wait_for_timeout(300)  # an image's error event or a frame's load would fire by now

    found = page.evaluate(INSPECT)
    assert not dialogs, dialogs
    assert found["pwned"] == "undefined"
    assert not found["tags"], found["tags"]
    assert not found["on"], found["on"]
    assert found["urls"] == ["https://example.com/a?b=1"], found["urls"]  # the one good link, the rest are text
    reply = page.locator(f"{LAST_REPLY} .text")
    link = reply.locator("a")
    assert link.get_attribute("target") == "_blank"
    assert link.get_attribute("rel") == "noopener noreferrer"
    # the raw HTML is shown as text, as written
    text = reply.inner_text()
    assert "<script>window.__pwned=2;alert(2)</script>" in text
    assert '<img src=x onerror="window.__pwned=1;alert(1)">' in text


MARKDOWN = """# Adding

Here is the code:

```python
def add(a, b):
    return a + b
```

- one
- *two*

| x | y |
|---|--:|
| 1 | 2 |

Call `add(1, 2)` for **3**."""


def test_reply_renders_markdown_with_copyable_code(canned):
    from playwright.sync_api import expect

    page, _, set_answer = canned
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    set_answer(lambda body: (200, sse(MARKDOWN, piece=3)))
    ask(page, "Show me some code.")
    wait_reply(page)

    reply = page.locator(f"{LAST_REPLY} .text")
    code = reply.locator("pre > code.language-python")
    expect(code).to_have_text("def add(a, b):\n    return a + b\n")
    copy = reply.locator(".code-block button.copy")
    expect(copy).to_have_text("Copy")
    copy.click()
    expect(copy).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == "def add(a, b):\n    return a + b\n"
    expect(reply.locator("h1")).to_have_text("Adding")
    expect(reply.locator("li")).to_have_text(["one", "two"])
    expect(reply.locator("li em")).to_have_text("two")
    expect(reply.locator("table td")).to_have_text(["1", "2"])
    expect(reply.locator("p code")).to_have_text("add(1, 2)")
    expect(reply.locator("strong")).to_have_text("3")
    text = reply.inner_text()
    assert "```" not in text and "**" not in text and "|---" not in text, text
    # user messages stay plain text
    ask(page, "**not bold** `not code`")
    wait_reply(page)
    expect(page.locator(".msg.user").last).to_have_text("**not bold** `not code`")


def png(width: int = 8, height: int = 6) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (217, 72, 15)).save(out, format="PNG")
    return out.getvalue()


def test_attached_image_is_sent_as_an_image_url_part(canned, tmp_path):
    from playwright.sync_api import expect

    page, bodies, set_answer = canned
    image = tmp_path / "dot.png"
    image.write_bytes(png())

    # refused before sending: not an image, and too large
    page.set_input_files("#image-input", {"name": "notes.txt", "mimeType": "text/plain", "buffer": b"hello"})
    expect(page.locator("#attach-error")).to_contain_text("notes.txt is not a PNG, JPEG, WebP or GIF image")
    expect(page.locator("#attachment")).to_be_hidden()
    big = {"name": "huge.png", "mimeType": "image/png", "buffer": b"\0" * (10 * 2**20 + 1)}
    page.set_input_files("#image-input", big)
    expect(page.locator("#attach-error")).to_contain_text("huge.png is 10.0 MB; images up to 10 MB")

    # a thumbnail shows before sending and its x takes it away
    page.set_input_files("#image-input", str(image))
    expect(page.locator("#attachment img")).to_be_visible()
    expect(page.locator("#attach-error")).to_be_hidden()
    page.click("#attachment-remove")
    expect(page.locator("#attachment")).to_be_hidden()
    page.set_input_files("#image-input", str(image))
    expect(page.locator("#attachment img")).to_be_visible()

    # the server refuses it (its image support may be missing): the page shows the server's message
    refusal = {"error": {"message": "image inputs are not supported by this model", "type": "invalid_request_error",
                         "param": "messages", "code": None}}
    set_answer(lambda body: (400, json.dumps(refusal)))
    ask(page, "What colour is this?")
    wait_reply(page)
    expect(page.locator("#attachment")).to_be_hidden()
    expect(page.locator(f"{LAST_REPLY} .error")).to_contain_text("image inputs are not supported by this model")
    thumb = page.locator(".msg.user .thumb")
    expect(thumb).to_be_visible()
    assert thumb.get_attribute("src").startswith("data:image/png;base64,")

    content = bodies[-1]["messages"][-1]["content"]
    assert content[0] == {"type": "text", "text": "What colour is this?"}
    assert content[1]["type"] == "image_url"
    url = content[1]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    assert base64.b64decode(url.split(",", 1)[1]) == image.read_bytes()

    # the refused turn is not sent again with the next one
    set_answer(lambda body: (200, sse("Fine.")))
    ask(page, "Never mind.")
    wait_reply(page)
    assert bodies[-1]["messages"] == [{"role": "user", "content": "Never mind."}]
