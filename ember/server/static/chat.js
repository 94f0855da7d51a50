"use strict";
// Chat page of ember's OpenAI-compatible server. Replies stream from POST /v1/chat/completions as server-sent
// events; EventSource cannot POST, so the body is read with fetch. The conversation lives only in this page and is
// sent whole with every request, as the server keeps no state between requests.

const $ = (id) => document.getElementById(id);
const els = {
  prompt: $("prompt"), send: $("send"), composer: $("composer"), messages: $("messages"), newChat: $("new-chat"),
  system: $("system"), temperature: $("temperature"), temperatureValue: $("temperature-value"),
  maxTokens: $("max-tokens"), settings: $("settings"), settingsToggle: $("settings-toggle"),
  auth: $("auth"), apiKey: $("api-key"), authError: $("auth-error"), modelName: $("model-name"),
  attach: $("attach"), imageInput: $("image-input"), attachment: $("attachment"), attachmentThumb: $("attachment-thumb"),
  attachmentRemove: $("attachment-remove"), attachError: $("attach-error"),
};

const KEY_STORAGE = "ember-api-key";
let apiKey = localStorage.getItem(KEY_STORAGE) || "";
let model = null;       // id of the served model, from /v1/models
let history = [];       // finished turns [{role, content}]; the system prompt is added per request
let controller = null;  // AbortController of the reply streaming now; null when idle
let attachment = null;  // data: URL of the image to send with the next message
const IMAGE_TYPES = ["image/png", "image/jpeg", "image/webp", "image/gif"];  // the ones OpenAI's API takes
const MAX_IMAGE_BYTES = 10 * 1024 * 1024;

function headers(extra = {}) {
  return apiKey ? { ...extra, Authorization: `Bearer ${apiKey}` } : extra;
}

// One readable line from an OpenAI-style error object {message, type, param, code}.
function describeError(error) {
  const details = [error.type, error.code, error.param && `param: ${error.param}`].filter(Boolean).join(", ");
  return `${error.message || "Unknown error"}${details ? ` (${details})` : ""}`;
}

// The error object of a non-200 answer; a stand-in when the body is not OpenAI's error JSON (e.g. a proxy's page).
async function errorOf(response) {
  try {
    const body = await response.json();
    if (body && body.error) return body.error;
  } catch { /* not JSON */ }
  return { message: `HTTP ${response.status} ${response.statusText}`.trim() };
}

function showAuth(message) {
  els.auth.hidden = false;
  els.apiKey.value = apiKey;
  els.authError.textContent = message;
  els.apiKey.focus();
}

// Learns the model name; a 401 here is how the page finds out that the server wants an API key.
async function loadModel() {
  let response;
  try {
    response = await fetch("/v1/models", { headers: headers() });
  } catch {
    els.modelName.textContent = "server unreachable";
    return;
  }
  if (response.status === 401) {
    els.modelName.textContent = "API key needed";
    // no error text before the user has tried a key: the field itself says what is needed
    showAuth(apiKey ? describeError(await errorOf(response)) : "This server needs an API key.");
    return;
  }
  if (!response.ok) {
    els.modelName.textContent = describeError(await errorOf(response));
    return;
  }
  const body = await response.json();
  model = body.data?.[0]?.id ?? null;
  els.modelName.textContent = model ?? "no model";
  els.auth.hidden = true;
}

// Replies are Markdown from an untrusted model: markdown-it with raw HTML off turns it into HTML, DOMPurify keeps only
// the tags Markdown makes and http(s)/mailto links, and the result is inserted as DOM nodes. Without the vendored
// scripts (e.g. a broken install) replies stay plain text.
const SAFE_LINK = /^(?:https?:|mailto:)/i;
const markdown = window.markdownit && window.DOMPurify ? window.markdownit({ html: false, linkify: true, breaks: true })
  : null;
const PURIFY = {
  ALLOWED_TAGS: ["a", "blockquote", "br", "code", "em", "h1", "h2", "h3", "h4", "h5", "h6", "hr", "li", "ol", "p",
    "pre", "s", "strong", "table", "tbody", "td", "th", "thead", "tr", "ul"],
  ALLOWED_ATTR: ["href", "title", "class", "start", "style"],
  ALLOWED_URI_REGEXP: SAFE_LINK,
  RETURN_DOM_FRAGMENT: true,
};
if (markdown) {
  markdown.disable("image");  // an image URL in a reply would be fetched: a way to send the conversation elsewhere
  markdown.validateLink = (url) => SAFE_LINK.test(url.trim());  // others stay text (markdown-it's own rule allows more)
  DOMPurify.addHook("uponSanitizeAttribute", (node, data) => {
    // the only style markdown-it writes is a table column's alignment
    if (data.attrName === "style") data.keepAttr = /^text-align:(left|right|center)$/.test(data.attrValue);
  });
  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A") {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer");
    }
  });
}

// Puts a code block in a frame with its language and a Copy button (clicks are handled once, on #messages).
function frameCode(code) {
  const pre = code.parentElement;
  const frame = document.createElement("div");
  frame.className = "code-block";
  const bar = document.createElement("div");
  bar.className = "code-bar";
  const lang = document.createElement("span");
  lang.textContent = /\blanguage-(\S+)/.exec(code.className)?.[1] ?? "";
  const copy = document.createElement("button");
  copy.type = "button";
  copy.className = "copy";
  copy.textContent = "Copy";
  bar.append(lang, copy);
  pre.replaceWith(frame);
  frame.append(bar, pre);
}

function renderMarkdown(el, text) {
  if (!markdown) {
    el.textContent = text;
    return;
  }
  const fragment = DOMPurify.sanitize(markdown.render(text), PURIFY);
  fragment.querySelectorAll("pre > code").forEach(frameCode);
  for (const table of fragment.querySelectorAll("table")) {
    const scroll = document.createElement("div");
    scroll.className = "table-scroll";
    table.replaceWith(scroll);
    scroll.append(table);
  }
  el.replaceChildren(fragment);
}

// navigator.clipboard exists only in secure contexts (https, localhost); a server reached over plain http on the LAN
// falls back to the old copy command.
async function copyText(text) {
  if (navigator.clipboard) return navigator.clipboard.writeText(text);
  const area = document.createElement("textarea");
  area.value = text;
  area.style.position = "fixed";
  area.style.opacity = "0";
  document.body.append(area);
  area.select();
  const ok = document.execCommand("copy");
  area.remove();
  if (!ok) throw new Error("copy refused");
}

// Scrolls to the end only if the reader is already there, so that scrolling up during a reply is not undone.
function keepAtEnd(change) {
  const box = els.messages;
  const atEnd = box.scrollHeight - box.scrollTop - box.clientHeight < 60;
  change();
  if (atEnd) box.scrollTop = box.scrollHeight;
}

function addMessage(role, text = "", image = null) {
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  if (image) {
    const img = document.createElement("img");
    img.className = "thumb";
    img.alt = "Attached image";
    img.src = image;  // the user's own file, read by this page
    el.append(img);
  }
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;  // user text is never parsed, not even as Markdown
  el.append(body);
  if (role === "assistant") {
    body.classList.add("md");
    const stats = document.createElement("div");
    stats.className = "stats";
    el.append(stats);
  }
  keepAtEnd(() => els.messages.append(el));
  return el;
}

function showError(msgEl, error) {
  const el = document.createElement("div");
  el.className = "error";
  el.textContent = describeError(error);
  keepAtEnd(() => msgEl.querySelector(".stats").before(el));
}

// Yields the data of each server-sent event in a fetch body. The network may split the bytes anywhere, so only
// complete lines are parsed and a blank line ends an event.
async function* sseData(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let data = [];
  for (;;) {
    const { value, done } = await reader.read();
    buffer += decoder.decode(value, { stream: !done });
    const lines = buffer.split("\n");
    buffer = done ? "" : lines.pop();  // an unfinished last line waits for more bytes
    for (const raw of lines) {
      const line = raw.endsWith("\r") ? raw.slice(0, -1) : raw;
      if (line === "") {
        if (data.length) yield data.join("\n");
        data = [];
      } else if (line.startsWith("data:")) {
        data.push(line.slice(line.startsWith("data: ") ? 6 : 5));
      }
    }
    if (done) {
      if (data.length) yield data.join("\n");
      return;
    }
  }
}

const FINISH_NOTES = { length: "max tokens reached", abort: "aborted by the server" };

// "42 tokens · 37.5 tok/s": the rate spans first to last token, i.e. tokens - 1 intervals, which is the decode
// speed without the time to the first token. Empty while nothing arrived, so a failed request shows just its error.
function formatStats(tokens, first, last, note) {
  const parts = tokens ? [`${tokens} token${tokens === 1 ? "" : "s"}`] : [];
  if (tokens > 1 && last > first) parts.push(`${((tokens - 1) / ((last - first) / 1000)).toFixed(1)} tok/s`);
  if (note) parts.push(note);
  return parts.join(" · ");
}

// Streams the reply to the last user turn into msgEl; user is {el, turn}: that turn and its message element.
async function streamReply(msgEl, user) {
  const textEl = msgEl.querySelector(".text");
  const statsEl = msgEl.querySelector(".stats");
  const system = els.system.value.trim();
  const request = {
    model,
    messages: system ? [{ role: "system", content: system }, ...history] : [...history],
    stream: true,
    stream_options: { include_usage: true },
    temperature: Number(els.temperature.value),
    max_tokens: Math.max(1, parseInt(els.maxTokens.value, 10) || 256),
  };
  controller = new AbortController();
  setStreaming(true);
  msgEl.classList.add("streaming");
  let content = "";
  let tokens = 0;  // content chunks, until the usage chunk gives the true count
  let first = 0;
  let last = 0;
  let note = "";
  // deltas come faster than the screen redraws: the reply's Markdown is rendered at most once per frame
  let frame = 0;
  const render = () => {
    frame = 0;
    keepAtEnd(() => renderMarkdown(textEl, content));
  };
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify(request),
      signal: controller.signal,
    });
    if (!response.ok) {
      const error = await errorOf(response);
      if (response.status === 401) showAuth(describeError(error));
      showError(msgEl, error);
      // the refused turn (e.g. an image the server cannot read) leaves the conversation, so that the next turns are
      // not refused for it too; the transcript keeps it, dimmed
      history = history.filter((turn) => turn !== user.turn);
      user.el.classList.add("refused");
      user.el.title = "Not part of the conversation: the server refused it";
      return;
    }
    let ended = false;  // [DONE] or an error event; without either the connection dropped mid-reply
    for await (const data of sseData(response.body)) {
      ended = data === "[DONE]";
      if (ended) break;
      const chunk = JSON.parse(data);
      if (chunk.error) {
        showError(msgEl, chunk.error);
        ended = true;
        break;
      }
      const choice = chunk.choices?.[0];
      if (choice?.delta?.content) {
        last = performance.now();
        if (!first) first = last;
        tokens += 1;
        content += choice.delta.content;
        if (!frame) frame = requestAnimationFrame(render);
      }
      if (choice?.finish_reason) note = FINISH_NOTES[choice.finish_reason] || "";
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      statsEl.textContent = formatStats(tokens, first, last, note);
    }
    if (!ended) showError(msgEl, { message: "The connection closed before the reply was complete." });
  } catch (err) {
    if (err.name === "AbortError") note = "stopped";
    else showError(msgEl, { message: `Request failed: ${err.message}` });
  } finally {
    controller = null;
    cancelAnimationFrame(frame);
    render();  // the last deltas may still be waiting for a frame
    setStreaming(false);
    msgEl.classList.remove("streaming");
    msgEl.classList.toggle("stopped", note === "stopped");
    statsEl.textContent = formatStats(tokens, first, last, note);
    // a partial reply stays part of the conversation; a message removed by "New chat" does not
    if (content && msgEl.isConnected) history.push({ role: "assistant", content });
  }
}

function setStreaming(on) {
  els.send.textContent = on ? "Stop" : "Send";
  els.send.classList.toggle("stop", on);
}

function send() {
  const text = els.prompt.value.trim();
  const image = attachment;
  if ((!text && !image) || controller) return;
  els.prompt.value = "";
  fitPrompt();
  setAttachment(null);
  showSettings(false);
  // with an image the content is a list of OpenAI's content parts
  const parts = [...(text ? [{ type: "text", text }] : []), { type: "image_url", image_url: { url: image } }];
  const turn = { role: "user", content: image ? parts : text };
  history.push(turn);
  const el = addMessage("user", text, image);
  streamReply(addMessage("assistant"), { el, turn });
}

function setAttachment(url) {
  attachment = url;
  els.attachment.hidden = !url;
  if (url) els.attachmentThumb.src = url;
  else els.attachmentThumb.removeAttribute("src");
  els.attachError.textContent = "";
}

function readDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

// Reads a picked, pasted or dropped file as the image for the next message, or says why it cannot be one.
async function attachFile(file) {
  let problem = "";
  if (!IMAGE_TYPES.includes(file.type)) problem = `${file.name || "This file"} is not a PNG, JPEG, WebP or GIF image.`;
  else if (file.size > MAX_IMAGE_BYTES) {
    problem = `${file.name || "The image"} is ${(file.size / 2 ** 20).toFixed(1)} MB; images up to 10 MB can be sent.`;
  } else {
    try {
      setAttachment(await readDataUrl(file));
      return;
    } catch (err) {
      problem = `Could not read ${file.name}: ${err.message}`;
    }
  }
  els.attachError.textContent = problem;
}

// The prompt box grows with its text up to the CSS max-height, then scrolls.
function fitPrompt() {
  els.prompt.style.height = "auto";
  els.prompt.style.height = `${els.prompt.scrollHeight}px`;
}

els.composer.addEventListener("submit", (e) => {
  e.preventDefault();
  if (controller) controller.abort();  // the button reads "Stop" while a reply streams
  else send();
});

els.prompt.addEventListener("keydown", (e) => {
  // Enter sends, Shift+Enter is a newline; Enter that confirms an IME composition is left alone
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    send();
  }
});
els.prompt.addEventListener("input", fitPrompt);

els.attach.addEventListener("click", () => els.imageInput.click());
els.imageInput.addEventListener("change", () => {
  if (els.imageInput.files[0]) attachFile(els.imageInput.files[0]);
  els.imageInput.value = "";  // picking the same file again is a change too
});
els.attachmentRemove.addEventListener("click", () => setAttachment(null));
els.prompt.addEventListener("paste", (e) => {
  const file = e.clipboardData?.files[0];
  if (!file) return;  // text pastes as usual
  e.preventDefault();
  attachFile(file);
});
// a file dropped anywhere on the page is attached; the browser would otherwise open it in place of the page
document.addEventListener("dragover", (e) => {
  if (e.dataTransfer?.types.includes("Files")) e.preventDefault();
});
document.addEventListener("drop", (e) => {
  const file = e.dataTransfer?.files[0];
  if (!file) return;
  e.preventDefault();
  attachFile(file);
});

els.messages.addEventListener("click", async (e) => {
  const button = e.target.closest("button.copy");
  if (!button) return;
  try {
    await copyText(button.closest(".code-block").querySelector("code").textContent);
    button.textContent = "Copied";
  } catch {
    button.textContent = "Copy failed";
  }
  setTimeout(() => { button.textContent = "Copy"; }, 1500);
});

els.newChat.addEventListener("click", () => {
  if (controller) controller.abort();
  history = [];
  els.messages.replaceChildren();
  els.prompt.focus();
});

els.temperature.addEventListener("input", () => {
  els.temperatureValue.textContent = Number(els.temperature.value).toFixed(1);
});

// On narrow screens the settings drop down over the conversation; sending folds them away to show the reply.
function showSettings(open) {
  els.settings.classList.toggle("open", open);
  els.settingsToggle.setAttribute("aria-expanded", String(open));
}
els.settingsToggle.addEventListener("click", () => showSettings(!els.settings.classList.contains("open")));

els.auth.addEventListener("submit", (e) => {
  e.preventDefault();
  apiKey = els.apiKey.value.trim();
  localStorage.setItem(KEY_STORAGE, apiKey);
  els.authError.textContent = "Checking…";
  loadModel();
});

loadModel();
