"use strict";
// The chat page: streams answers from this server's /v1/chat/completions (fetch and a
// ReadableStream, as no library is loaded) and keeps the conversation, the settings and the
// API key in this browser's localStorage. Model output is only ever set as textContent, so
// nothing it writes can become markup or script.
(() => {
  const STORE = { messages: "strata.chat.messages", settings: "strata.chat.settings", key: "strata.chat.apiKey" };
  const SETTINGS = ["system", "temperature", "top-p", "max-tokens", "stop", "tools"];
  const $ = (id) => document.getElementById(id);

  let messages = readStored(STORE.messages, []);
  if (!Array.isArray(messages)) messages = [];
  let controller = null; // the running request's AbortController, null when idle
  let epoch = 0; // counts Clear presses: an answer that ends after one is not kept

  function readStored(name, fallback) {
    try {
      const value = JSON.parse(localStorage.getItem(name));
      return value === null ? fallback : value;
    } catch {
      return fallback;
    }
  }

  function store(name, value) {
    localStorage.setItem(name, JSON.stringify(value));
  }

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // ---- the conversation on screen ----

  function addBubble(message) {
    const root = el("div", `msg ${message.role}`);
    root.append(el("div", "role", message.role));
    const reasoning = el("details", "reasoning");
    reasoning.open = true;
    reasoning.append(el("summary", "", "Reasoning"));
    const reasoningText = el("div", "reasoning-text");
    reasoning.append(reasoningText);
    const content = el("div", "content");
    const calls = el("div", "tool-calls");
    const meta = el("div", "meta");
    root.append(reasoning, content, calls, meta);
    $("conversation").append(root);
    const view = { root, reasoning, reasoningText, content, calls, meta };
    paint(view, message);
    return view;
  }

  function paint(view, message) {
    view.reasoning.hidden = !message.reasoning;
    view.reasoningText.textContent = message.reasoning || "";
    view.content.textContent = message.content || "";
    view.calls.replaceChildren(...(message.tool_calls || []).map(toolCallBlock));
    view.meta.textContent = message.meta || "";
  }

  function toolCallBlock(call) {
    const block = el("div", "tool-call");
    block.append(el("div", "tool-name", `tool call: ${call.function.name}`));
    let args = call.function.arguments;
    try {
      args = JSON.stringify(JSON.parse(args), null, 2);
    } catch {
      // still streaming, or not JSON: shown as it came
    }
    block.append(el("pre", "tool-args", args));
    return block;
  }

  function renderAll() {
    $("conversation").replaceChildren();
    messages.forEach(addBubble);
    scrollDown(true);
  }

  function scrollDown(always) {
    const box = $("conversation");
    if (always || box.scrollHeight - box.scrollTop - box.clientHeight < 80) box.scrollTop = box.scrollHeight;
  }

  function notice(text) {
    $("notice").textContent = text || "";
    $("notice").hidden = !text;
  }

  function setBusy(busy) {
    document.body.dataset.state = busy ? "streaming" : "idle";
    $("send").disabled = busy;
    $("stop-button").disabled = !busy;
  }

  // ---- settings and the request ----

  function headers() {
    const key = $("api-key").value.trim();
    const h = { "Content-Type": "application/json" };
    if (key) h.Authorization = `Bearer ${key}`;
    return h;
  }

  function numberSetting(id, name, body, integer) {
    const text = $(id).value.trim();
    if (!text) return;
    const value = Number(text);
    if (!Number.isFinite(value) || (integer && !Number.isInteger(value))) {
      throw new Error(`${name}: not ${integer ? "a whole number" : "a number"}: ${text}`);
    }
    body[name] = value;
  }

  function history() {
    const out = [];
    const system = $("system").value;
    if (system.trim()) out.push({ role: "system", content: system });
    for (const m of messages) {
      const item = { role: m.role, content: m.content };
      if (m.tool_calls && m.tool_calls.length) item.tool_calls = m.tool_calls;
      out.push(item);
    }
    return out;
  }

  // The body for the conversation so far; a setting that cannot be sent throws, naming it.
  function requestBody() {
    const body = { messages: history(), stream: true };
    numberSetting("temperature", "temperature", body, false);
    numberSetting("top-p", "top_p", body, false);
    numberSetting("max-tokens", "max_tokens", body, true);
    const stop = $("stop").value.split("\n").filter((s) => s !== "");
    if (stop.length) body.stop = stop;
    const tools = $("tools").value.trim();
    if (tools) {
      let parsed;
      try {
        parsed = JSON.parse(tools);
      } catch (err) {
        throw new Error(`tools: not JSON: ${err.message}`);
      }
      if (!Array.isArray(parsed)) throw new Error("tools: not a JSON array");
      if (parsed.length) body.tools = parsed;
    }
    return body;
  }

  // The API's error message from a response that is not a 2xx.
  async function errorText(response) {
    const text = await response.text();
    try {
      const err = JSON.parse(text).error;
      return `${response.status}: ${typeof err === "string" ? err : err.message}`;
    } catch {
      return `${response.status}: ${text.slice(0, 300) || response.statusText}`;
    }
  }

  // The data of each server-sent event, as the text after "data:".
  async function* sseData(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const lines = buffer.slice(0, cut).split("\n").map((l) => l.replace(/\r$/, ""));
        buffer = buffer.slice(cut + 2);
        const data = lines.filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
        if (data.length) yield data.join("\n");
      }
    }
  }

  // One chunk's deltas into the answer: content, reasoning_content and tool_calls by index.
  function applyChunk(answer, chunk) {
    if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
    for (const choice of chunk.choices || []) {
      const delta = choice.delta || {};
      if (delta.reasoning_content) answer.reasoning += delta.reasoning_content;
      if (delta.content) answer.content += delta.content;
      for (const part of delta.tool_calls || []) {
        const i = part.index || 0;
        answer.tool_calls[i] = answer.tool_calls[i] || { id: "", type: "function", function: { name: "", arguments: "" } };
        const call = answer.tool_calls[i];
        if (part.id) call.id = part.id;
        if (part.function && part.function.name) call.function.name += part.function.name;
        if (part.function && part.function.arguments) call.function.arguments += part.function.arguments;
      }
      if (choice.finish_reason) answer.finish = choice.finish_reason;
    }
    if (chunk.timings) answer.timings = chunk.timings;
  }

  function metaLine(answer, ending) {
    const parts = [ending || answer.finish || ""];
    const t = answer.timings;
    if (t && t.predicted_n) {
      parts.push(`${t.predicted_n} tokens`);
      if (t.predicted_per_second) parts.push(`${t.predicted_per_second.toFixed(1)} tokens/s`);
    }
    return parts.filter(Boolean).join(" \u00b7 ");
  }

  async function send(text) {
    const user = { role: "user", content: text };
    messages.push(user);
    let body;
    try {
      body = requestBody();
    } catch (err) {
      messages.pop();
      notice(err.message);
      return;
    }
    notice("");
    $("message").value = "";
    store(STORE.messages, messages);
    const userView = addBubble(user);
    const answer = { role: "assistant", content: "", reasoning: "", tool_calls: [] };
    const view = addBubble(answer);
    view.root.classList.add("streaming");
    scrollDown(true);
    controller = new AbortController();
    const started = epoch;
    setBusy(true);
    let ending = "";
    try {
      const response = await fetch("v1/chat/completions", {
        method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
      });
      if (!response.ok) throw Object.assign(new Error(await errorText(response)), { refused: true });
      for await (const data of sseData(response)) {
        if (data === "[DONE]") break;
        applyChunk(answer, JSON.parse(data));
        paint(view, answer);
        scrollDown(false);
      }
    } catch (err) {
      if (started !== epoch) {
        return; // cleared while it ran
      } else if (err.name === "AbortError") {
        ending = "stopped";
      } else if (err.refused) { // nothing was generated: the message goes back to the box to send again
        messages.pop();
        store(STORE.messages, messages);
        $("message").value = text;
        userView.root.remove();
        view.root.remove();
        addBubble({ role: "error", content: err.message });
        return;
      } else {
        ending = `error: ${err.message}`;
      }
    } finally {
      controller = null;
      setBusy(false);
      view.root.classList.remove("streaming");
    }
    if (started !== epoch) return;
    answer.meta = metaLine(answer, ending);
    delete answer.timings;
    messages.push(answer);
    store(STORE.messages, messages);
    paint(view, answer);
    scrollDown(false);
  }

  // ---- the server's name, or why it cannot be reached ----

  async function checkServer() {
    const status = $("status");
    try {
      const response = await fetch("v1/models", { headers: headers() });
      if (!response.ok) {
        const why = response.status === 401 ? "wrong or missing API key (see Settings)" : await errorText(response);
        status.textContent = why;
        status.classList.add("bad");
        return;
      }
      const models = (await response.json()).data || [];
      status.textContent = models.length ? `model: ${models[0].id}` : "no model";
      status.classList.remove("bad");
    } catch (err) {
      status.textContent = `server unreachable: ${err.message}`;
      status.classList.add("bad");
    }
  }

  // ---- wiring ----

  function start() {
    $("api-key").value = readStored(STORE.key, "");
    $("api-key").addEventListener("input", () => store(STORE.key, $("api-key").value));
    $("api-key").addEventListener("change", checkServer);
    const saved = readStored(STORE.settings, {});
    for (const id of SETTINGS) {
      if (typeof saved[id] === "string") $(id).value = saved[id];
      $(id).addEventListener("input", () => {
        const now = {};
        for (const name of SETTINGS) now[name] = $(name).value;
        store(STORE.settings, now);
      });
    }
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      const text = $("message").value;
      if (controller === null && text.trim()) send(text);
    });
    $("message").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("stop-button").addEventListener("click", () => controller && controller.abort());
    $("clear").addEventListener("click", () => {
      if (controller) controller.abort();
      epoch += 1;
      messages = [];
      store(STORE.messages, messages);
      notice("");
      renderAll();
    });
    renderAll();
    checkServer();
    $("message").focus();
  }

  start();
})();
