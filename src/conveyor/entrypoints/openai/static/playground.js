// Conveyor playground: a chat pane streaming through the server's own OpenAI API and a live
// scheduler pane fed by /v1/stats/stream. Text from the model or the server is only ever set
// with textContent, never parsed as HTML.
"use strict";

const STATS_INTERVAL_S = 0.25;
const HISTORY = 160; // points per chart: 40 s at 4 events/s
const RETRY_MS = 2000;

const integer = (v) => String(Math.round(v));
const oneDecimal = (v) => v.toFixed(1);
const percent = (v) => (100 * v).toFixed(1) + "%";

// One tile per metric: its label, how its value reads, and a chart of its recent history.
const METRICS = [
  { key: "waiting", label: "waiting", format: integer },
  { key: "running", label: "running", format: integer },
  { key: "swapped", label: "swapped", format: integer },
  { key: "kv_usage", label: "KV-cache usage", format: percent, scale: 1 },
  { key: "prefix_cache_hit_rate", label: "prefix-cache hit rate", format: percent, scale: 1 },
  { key: "batch_size", label: "batch size (seqs / step)", format: oneDecimal },
  { key: "tokens_per_step", label: "tokens / step", format: oneDecimal },
  { key: "output_tokens_per_s", label: "output tokens / s", format: oneDecimal },
  { key: "preemptions", label: "preemptions (total)", format: integer },
];

const $ = (id) => document.getElementById(id);
const el = (tag, className, text) => {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
};

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (e) {
    // not JSON: fall through to the status line
  }
  return "HTTP " + response.status;
}

// Server-sent events from a fetch() body (fetch, not EventSource: it can send the API key).
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      if (data) yield data;
    }
  }
}

// ------------------------------------------------------------------ model name
let modelName = null;

// What got a 401 waits for the API key box to change, then tries again.
const keyWaiters = [];
const nextKey = () => new Promise((resolve) => keyWaiters.push(resolve));

async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: headers() });
    if (response.status === 401) {
      $("model-name").textContent = "this server needs an API key: enter it on the right";
      await nextKey();
      return loadModel();
    }
    if (!response.ok) throw new Error(await errorMessage(response));
    const body = await response.json();
    modelName = body.data[0].id;
    $("model-name").textContent = modelName + " · max_model_len " + body.data[0].max_model_len;
  } catch (e) {
    $("model-name").textContent = "server not ready: " + e.message;
    setTimeout(loadModel, RETRY_MS);
  }
}

// ------------------------------------------------------------------ chat
const conversation = []; // {role, content} of the finished turns
let inFlight = null; // the AbortController of the reply being streamed

function addMessage(role, text) {
  const box = el("div", "message " + role);
  box.append(el("span", "content", text));
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

function setMeta(box, text, isError) {
  let meta = box.querySelector(".meta");
  if (!meta) {
    meta = el("span", "meta");
    box.append(meta);
  }
  meta.textContent = text;
  meta.classList.toggle("error", Boolean(isError));
}

function chatRequest() {
  const messages = [];
  const system = $("system-prompt").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push(...conversation);
  const request = {
    model: modelName, messages, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), max_tokens: parseInt($("max-tokens").value, 10),
  };
  const stop = $("stop").value.split("\n").filter((s) => s.length > 0);
  if (stop.length) request.stop = stop;
  return request;
}

async function send(text) {
  if (inFlight || !text.trim()) return;
  if (!modelName) {
    $("chat-status").textContent = "the model is still loading";
    return;
  }
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const box = addMessage("assistant streaming", "");
  const content = box.querySelector(".content");
  inFlight = new AbortController();
  $("send").disabled = true;
  $("stop-button").disabled = false;
  $("chat-status").textContent = "streaming…";
  const started = performance.now();
  let reply = "";
  let finish = null;
  let tokens = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(chatRequest()),
      signal: inFlight.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const data of sseEvents(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      if (choice.delta && choice.delta.content) {
        reply += choice.delta.content;
        content.textContent = reply;
        box.scrollIntoView({ block: "end" });
      }
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    const seconds = (performance.now() - started) / 1000;
    const parts = ["finish: " + (finish || "?")];
    if (tokens !== null) parts.push(tokens + " tokens", (tokens / seconds).toFixed(1) + " tok/s");
    setMeta(box, parts.join(" · "));
  } catch (e) {
    if (e.name === "AbortError") setMeta(box, "stopped");
    else setMeta(box, "error: " + e.message, true);
  } finally {
    box.classList.remove("streaming");
    if (reply) conversation.push({ role: "assistant", content: reply });
    else conversation.pop(); // no reply: the next message should not follow a dangling turn
    inFlight = null;
    $("send").disabled = false;
    $("stop-button").disabled = true;
    $("chat-status").textContent = "";
  }
}

function setUpChat() {
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("stop-button").addEventListener("click", () => inFlight && inFlight.abort());
  $("clear").addEventListener("click", () => {
    if (inFlight) inFlight.abort();
    conversation.length = 0;
    $("messages").replaceChildren();
  });
}

// ------------------------------------------------------------------ scheduler pane
const history = Object.fromEntries(METRICS.map((m) => [m.key, []]));
let drawPending = false;

function setUpCharts() {
  for (const metric of METRICS) {
    const tile = el("div", "tile");
    tile.dataset.metric = metric.key;
    tile.append(el("div", "label", metric.label));
    const value = el("div", "value", "–");
    value.id = "stat-" + metric.key;
    tile.append(value, el("canvas"));
    $("charts").append(tile);
  }
  window.addEventListener("resize", scheduleDraw);
}

function drawChart(canvas, values, metric) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  const height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
  if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  const top = metric.scale || Math.max(1, ...values) * 1.1;
  const x = (i) => width - (values.length - 1 - i) * (width / (HISTORY - 1));
  const y = (v) => height - 1 - (v / top) * (height - 2);
  ctx.strokeStyle = "#dde1e8";
  ctx.beginPath();
  ctx.moveTo(0, height - 0.5);
  ctx.lineTo(width, height - 0.5);
  ctx.stroke();
  ctx.fillStyle = "#6b7385";
  ctx.font = "10px system-ui, sans-serif";
  ctx.textAlign = "left";
  ctx.textBaseline = "top";
  if (values.length < 2) return;
  ctx.fillText("peak " + metric.format(Math.max(...values)), 2, 0);
  ctx.beginPath();
  values.forEach((v, i) => (i ? ctx.lineTo(x(i), y(v)) : ctx.moveTo(x(i), y(v))));
  ctx.strokeStyle = "#2563eb";
  ctx.lineWidth = 1.5;
  ctx.stroke();
  ctx.lineTo(x(values.length - 1), height);
  ctx.lineTo(x(0), height);
  ctx.closePath();
  ctx.fillStyle = "rgba(37, 99, 235, 0.12)";
  ctx.fill();
}

function scheduleDraw() {
  if (drawPending) return;
  drawPending = true;
  requestAnimationFrame(() => {
    drawPending = false;
    for (const metric of METRICS) {
      const canvas = document.querySelector(`.tile[data-metric="${metric.key}"] canvas`);
      drawChart(canvas, history[metric.key], metric);
    }
  });
}

function formatSeconds(s) {
  return s < 10 ? s.toFixed(2) + " s" : s.toFixed(1) + " s";
}

function showRequests(stats) {
  const rows = stats.requests.map((r) => {
    const row = el("tr");
    row.append(el("td", "", r.id), el("td", "state-" + r.state, r.state),
      el("td", "", String(r.prompt_tokens)), el("td", "", String(r.output_tokens)),
      el("td", "", formatSeconds(r.queue_s)), el("td", "", formatSeconds(r.age_s)));
    return row;
  });
  $("requests").tBodies[0].replaceChildren(...rows);
  const hidden = stats.num_requests - stats.requests.length;
  $("num-requests").textContent = String(stats.num_requests) + (hidden > 0 ? ` (${hidden} not shown)` : "");
}

function showStats(stats) {
  for (const metric of METRICS) {
    const series = history[metric.key];
    // null: nothing to measure this time (no prompt looked up): hold the previous value.
    const raw = stats[metric.key];
    const value = raw === null ? (series.length ? series[series.length - 1] : 0) : Number(raw) || 0;
    series.push(value);
    if (series.length > HISTORY) series.shift();
    $("stat-" + metric.key).textContent = metric.format(value);
  }
  showRequests(stats);
  const viewers = stats.watchers === 1 ? " viewer" : " viewers";
  $("stream-status").textContent = "live · " + stats.watchers + viewers;
  scheduleDraw();
}

async function watchStats() {
  for (;;) {
    try {
      const response = await fetch("/v1/stats/stream?interval=" + STATS_INTERVAL_S, { headers: headers() });
      if (response.status === 401) {
        $("stream-status").textContent = "needs the API key";
        await nextKey();
        continue;
      }
      if (response.status === 404) {
        $("stream-status").textContent = "not available: " + (await errorMessage(response));
        return;
      }
      if (!response.ok) throw new Error(await errorMessage(response));
      $("stream-status").textContent = "live";
      for await (const data of sseEvents(response)) showStats(JSON.parse(data));
      $("stream-status").textContent = "stream ended; reconnecting…";
    } catch (e) {
      $("stream-status").textContent = "disconnected (" + e.message + "); retrying…";
    }
    await new Promise((resolve) => setTimeout(resolve, RETRY_MS));
  }
}

// ------------------------------------------------------------------ start
function setUpApiKey() {
  const input = $("api-key");
  input.value = localStorage.getItem("conveyor-api-key") || "";
  input.addEventListener("change", () => {
    localStorage.setItem("conveyor-api-key", input.value.trim());
    keyWaiters.splice(0).forEach((resolve) => resolve());
  });
}

setUpApiKey();
setUpChat();
setUpCharts();
loadModel();
watchStats();
