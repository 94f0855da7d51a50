"""Images through ``ember serve``: OpenAI ``image_url`` parts (data: URIs always; files only under
--allowed-local-media-path; URLs only for --allowed-media-domains), answered as transformers answers with the same
processor; bad images are a 400 naming the part, and the server keeps serving."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import openai
import pytest
from server_utils import TEST_ENGINE_ARGS, post, running_server
from vision_models import hf_llava_greedy, picture, save_llava

PROMPT = "<|im_start|>user\n<image>\nWhat is in the picture?<|im_end|>\n<|im_start|>assistant\n"


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _data_uri(image) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(image)).decode()


def _ask(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is in the picture?"}]}]


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("media")


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, tokenizer_dir) -> str:
    return save_llava(str(tmp_path_factory.mktemp("llava-serve")), tokenizer_dir)


@pytest.fixture(scope="module")
def server(llava_dir, media_dir):
    with running_server(llava_dir, *TEST_ENGINE_ARGS, "--max-model-len", "512", "--allowed-local-media-path",
                        str(media_dir), "--limit-mm-per-prompt", '{"image": 2}') as srv:
        yield srv


def _chat(api, model: str, messages: list[dict]) -> str:
    out = api.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True, "skip_special_tokens": False})
    return out.choices[0].message.content


def _post(server, body: dict):
    return asyncio.run(post(server.url, "/v1/chat/completions", body))


def test_image_url_answers_as_transformers_does(server, api, model, llava_dir, media_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llava_dir)
    want = tok.decode(hf_llava_greedy(llava_dir, PROMPT, [picture(21)], 8)[1])
    assert _chat(api, model, _ask(_data_uri(picture(21)))) == want
    (media_dir / "cat.png").write_bytes(_png(picture(21)))  # the same pixels from an allowed file
    assert _chat(api, model, _ask((media_dir / "cat.png").as_uri())) == want
    counted = asyncio.run(post(server.url, "/tokenize", {"messages": _ask(_data_uri(picture(21)))}))
    assert json.loads(counted.body)["count"] == len(hf_llava_greedy(llava_dir, PROMPT, [picture(21)], 1)[0])


@pytest.mark.parametrize("url, match", [
    ("data:image/png;base64,iVBORw0KGgoAAAAN", "not a readable image"),
    ("data:image/png;base64,@@@", "base64"),
    ("file:///etc/hostname", "outside"),
    ("http://example.com/cat.png", "allowed"),
])
def test_bad_images_are_a_400_naming_the_part(server, url, match):
    answer = _post(server, {"messages": _ask(url), "max_tokens": 4})
    assert answer.status == 400, answer.body
    error = json.loads(answer.body)["error"]
    assert "messages[0].content[0]" in error["message"] and match in error["message"]
    ok = _post(server, {"messages": _ask(_data_uri(picture(22))), "max_tokens": 2})
    assert ok.status == 200  # the engine kept serving


def test_more_images_than_the_limit_are_refused(server):
    parts = [{"type": "image_url", "image_url": {"url": _data_uri(picture(i))}} for i in range(3)]
    answer = _post(server, {"messages": [{"role": "user", "content": parts}], "max_tokens": 2})
    assert answer.status == 400 and "more than 2 images" in json.loads(answer.body)["error"]["message"]


def test_a_text_only_server_refuses_image_parts_by_name(tokenizer_dir):
    from conftest import make_tiny_model

    import tempfile

    with tempfile.TemporaryDirectory() as d, running_server(make_tiny_model("llama", d, tokenizer_dir),
                                                             *TEST_ENGINE_ARGS, "--max-model-len", "512") as srv:
        api = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\].content\[0\] is an image part"):
            api.chat.completions.create(model=api.models.list().data[0].id, messages=_ask(_data_uri(picture(1))),
                                        max_tokens=2)


def test_the_chat_page_sends_an_attached_image_and_shows_the_reply(server, tmp_path):
    """The page as a user drives it, in Chromium, against the vision-language model: attach, ask, read the reply."""
    import shutil

    playwright = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium binary on PATH (Debian package: chromium)")
    path = tmp_path / "cat.png"
    path.write_bytes(_png(picture(23)))
    question = "What is in the picture?"
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            page.set_default_timeout(60_000)
            page.goto(server.url)
            playwright.expect(page.locator("#model-name")).not_to_have_text("connecting…")
            page.set_input_files("#image-input", str(path))
            playwright.expect(page.locator("#attachment img")).to_be_visible()
            with page.expect_request("**/v1/chat/completions") as sent:
                page.fill("#prompt", question)
                page.press("#prompt", "Enter")
            body = sent.value.post_data_json
            playwright.expect(page.locator(".msg.streaming")).to_have_count(0, timeout=180_000)
            last = page.locator("#messages > .msg.assistant:last-child")
            playwright.expect(last.locator(".error")).to_have_count(0)
            shown = last.locator(".text").inner_text()
        finally:
            browser.close()
    parts = body["messages"][-1]["content"]
    assert [p["type"] for p in parts] == ["text", "image_url"]
    assert base64.b64decode(parts[1]["image_url"]["url"].split(",", 1)[1]) == path.read_bytes()
    assert shown.strip()  # the model's reply (sampled: the page sends no seed), not an error


def test_the_responses_api_takes_input_image(api, model):
    """An input_image part in a Responses message answers as the same image_url part in chat completions."""
    url = _data_uri(picture(24))
    answer = api.responses.create(model=model, max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": url},
                                     {"type": "input_text", "text": "What is in the picture?"}]}])
    chat = api.chat.completions.create(model=model, messages=_ask(url), max_tokens=8, temperature=0)
    assert answer.output_text == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="not a readable image"):
        api.responses.create(model=model, max_output_tokens=4, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}])
