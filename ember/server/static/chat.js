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
};

const KEY_STORAGE = "ember-api-key";
let apiKey = localStorage.getItem(KEY_STORAGE) || "";
let model = null;       // id of the served model, from /v1/models
let history = [];       // finished turns [{role, content}]; the system prompt is added per request
let controller = null;  // AbortController of the reply streaming now; null when idle

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

// Scrolls to the end only if the reader is already there, so that scrolling up during a reply is not undone.
function keepAtEnd(change) {
  const box = els.messages;
  const atEnd = box.scrollHeight - box.scrollTop - box.clientHeight < 60;
  change();
  if (atEnd) box.scrollTop = box.scrollHeight;
}

function addMessage(role, text = "") {
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;  // model and user text are never parsed as HTML
  el.append(body);
  if (role === "assistant") {
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

async function streamReply(msgEl) {
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
        keepAtEnd(() => { textEl.textContent = content; });
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
  if (!text || controller) return;
  els.prompt.value = "";
  fitPrompt();
  showSettings(false);
  history.push({ role: "user", content: text });
  addMessage("user", text);
  streamReply(addMessage("assistant"));
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
