// The playground page: settings, runs and loop comparisons streamed from /api/v0, the live
// server panel fed by /metrics, history. Pure logic lives in logic.js.
import * as L from "/ui/logic.js";

const $ = (id) => document.getElementById(id);
const form = $("settingsForm");
const SETTINGS_KEY = "tinyloop.settings.v1";
const HISTORY_KEY = "tinyloop.history.v1";
const HISTORY_MAX = 20;
const POLL_MS = 1000;

const state = {
  model: null,                 // /ui/model.json
  settings: load(SETTINGS_KEY, {}),
  history: load(HISTORY_KEY, []),
  active: new Set(),           // AbortControllers of running requests
  metrics: { prev: null, prevAt: 0, series: [] },
};
state.settings = { ...L.DEFAULTS, ...state.settings };

function load(key, fallback) {
  try { return JSON.parse(localStorage.getItem(key)) ?? fallback; } catch { return fallback; }
}
function save(key, value) {
  try { localStorage.setItem(key, JSON.stringify(value)); } catch { /* private mode: keep it in memory */ }
}

// ---- connection, model, banner ----------------------------------------------------------------

function setConnection(kind, text) {
  const pill = $("conn");
  pill.dataset.state = kind;
  pill.className = `pill ${kind}`;
  pill.textContent = text;
}

function showBanner(title, html) {
  $("bannerTitle").textContent = title;
  $("bannerText").innerHTML = html;
  $("banner").hidden = false;
}
function hideBanner() { $("banner").hidden = true; }
$("bannerClose").onclick = hideBanner;

async function loadModel() {
  const resp = await fetch("/ui/model.json");
  if (!resp.ok) throw new Error(`model.json: ${resp.status}`);
  const m = await resp.json();
  state.model = m;
  $("model").textContent = `model: ${m.id} · ${m.family}${m.parameters ? ` · ${(m.parameters / 1e6).toFixed(1)}M params` : ""}` +
    ` · loops ${m.default_loops} (max ${m.max_loops})`;
  $("capabilities").textContent = m.demo
    ? "The bundled demo model (4.6M parameters, trained on CPU) continues Python source and a+b= addition " +
      "lines, and is not a chat model. Sums are sent as the model learnt them: on their own line, stopping at " +
      "the newline after the answer, which is then checked. Few loops get sums wrong; the default (4) mostly right."
    : `Serving ${m.id}: a ${m.family} looped model with a ${m.context_length}-token context.`;
  const range = $("loopsQuick");
  range.max = String(m.max_loops);
  form.elements.loops.max = String(m.max_loops);
  const kinds = form.elements.exit_kind;
  kinds.length = 1;
  for (const k of m.exit_kinds) kinds.add(new Option(k, k));
  kinds.value = state.settings.exit_kind;
  $("exitDefault").textContent = `The model's own rule: ${m.exit.kind}` +
    (m.exit.kind !== "none" ? ` (threshold ${m.exit.threshold})` : "") +
    (m.exit_kinds.some((k) => k.startsWith("gate")) ? "" : ". The gate rules need a model with an exit gate.");
  const chat = $("modeChat");
  chat.disabled = !m.chat.usable;
  $("chatReason").textContent = m.chat.usable ? "" : m.chat.reason;
  chat.setAttribute("aria-describedby", "chatReason");
  if (!m.chat.usable && chat.checked) { $("modeCompletion").checked = true; }
  $("templateText").textContent = m.chat.template || "";
  renderExamples(m);
  syncLoops();
  updateMode();
  updateHint();
}

const DEMO_EXAMPLES = [
  { label: "def fibonacci(n):", prompt: "def fibonacci(n):", action: "run" },
  { label: "class Stack:", prompt: "class Stack:\n", action: "run" },
  { label: "import os", prompt: "import os\n\n\ndef ", action: "run" },
  { label: "4175208+3869901= (compare loops)", prompt: "4175208+3869901=", action: "compare" },
  { label: "57+68= (compare loops)", prompt: "57+68=", action: "compare" },
];
const GENERIC_EXAMPLES = [
  { label: "def fibonacci(n):", prompt: "def fibonacci(n):", action: "run" },
  { label: "The capital of France is", prompt: "The capital of France is", action: "run" },
  { label: "123+456= (compare loops)", prompt: "123+456=", action: "compare" },
];

function renderExamples(m) {
  const box = document.querySelector(".examples");
  for (const b of box.querySelectorAll("button")) b.remove();
  for (const ex of m.demo ? DEMO_EXAMPLES : GENERIC_EXAMPLES) {
    const b = document.createElement("button");
    b.type = "button";
    b.className = "example";
    b.textContent = ex.label;
    b.title = ex.action === "compare" ? "Runs it at each loop count side by side" : "Runs it";
    b.onclick = () => {
      $("prompt").value = ex.prompt;
      $("modeCompletion").checked = true;
      updateMode();
      updateHint();
      launch(ex.action);
    };
    box.append(b);
  }
}

// ---- settings form ------------------------------------------------------------------------------

function fillForm() {
  for (const el of form.elements) {
    if (!el.name || !(el.name in state.settings)) continue;
    if (el.type === "checkbox") el.checked = Boolean(state.settings[el.name]);
    else el.value = state.settings[el.name];
  }
  syncLoops();
  summarize();
}

function summarize() {
  const s = state.settings;
  const parts = [`temperature ${s.temperature}`, `max ${s.max_tokens} tokens`,
                 `loops ${s.loops || "default"}`];
  if (s.seed !== "") parts.push(`seed ${s.seed}`);
  if (s.exit_kind) parts.push(`exit ${s.exit_kind}`);
  if (s.speculation) parts.push("speculation");
  $("settingsSummary").textContent = `(${parts.join(" · ")})`;
  $("compareList").textContent = `(${L.compareList(s.compare_loops).join(", ")})`;
}

function syncLoops() {
  const m = state.model;
  const v = state.settings.loops || (m ? m.default_loops : 4);
  $("loopsQuick").value = String(v);
  $("loopsQuickOut").textContent = state.settings.loops ? String(v) : `${v} (default)`;
}

form.addEventListener("input", (e) => {
  const el = e.target;
  if (!el.name) return;
  state.settings[el.name] = el.type === "checkbox" ? el.checked : el.value;
  save(SETTINGS_KEY, state.settings);
  if (el.name === "loops") syncLoops();
  summarize();
  markErrors(L.validate(state.settings, state.model), false);
});
$("loopsQuick").addEventListener("input", () => {
  state.settings.loops = $("loopsQuick").value;
  form.elements.loops.value = state.settings.loops;
  save(SETTINGS_KEY, state.settings);
  syncLoops();
  summarize();
});
$("reset").onclick = () => {
  state.settings = { ...L.DEFAULTS };
  save(SETTINGS_KEY, state.settings);
  fillForm();
  markErrors([], false);
};

function fieldElement(field) {
  if (field === "prompt" || field === "messages") return $("prompt");
  const alias = { exit: "exit_kind", speculation: "speculation", mode: "speculation", draft_ahead: "draft_ahead",
                  max_completion_tokens: "max_tokens" };
  return form.elements[alias[field] || field] || null;
}

// Mark each field with its problem (aria-invalid, a message under it); ``announce``: also say
// so in the banner, open the settings and focus the first one.
function markErrors(errors, announce) {
  for (const el of document.querySelectorAll("[aria-invalid=true]")) {
    el.removeAttribute("aria-invalid");
    el.removeAttribute("aria-errormessage");
  }
  for (const el of document.querySelectorAll(".field-error")) el.remove();
  for (const { field, message } of errors) {
    const el = fieldElement(field);
    if (!el) continue;
    el.setAttribute("aria-invalid", "true");
    const note = document.createElement("span");
    note.className = "field-error";
    note.id = `err-${field}`;
    note.textContent = message;
    el.setAttribute("aria-errormessage", note.id);
    el.insertAdjacentElement("afterend", note);
  }
  if (!announce || !errors.length) return;
  showBanner(`Not sent: ${errors.length === 1 ? "one thing" : `${errors.length} things`} to fix`,
             errors.map((e) => `${L.escapeHtml(e.message)} (<code>${L.escapeHtml(e.field)}</code>)`).join("; "));
  const first = fieldElement(errors[0].field);
  if (first && form.contains(first)) $("settings").open = true;
  if (first) first.focus();
}

// ---- mode and prompt hint -------------------------------------------------------------------------

function chatMode() { return $("modeChat").checked && !$("modeChat").disabled; }

function updateMode() {
  const chat = chatMode();
  $("chatBox").hidden = !chat;
  $("promptLabel").firstChild.textContent = chat ? "Message " : "Prompt ";
}
for (const r of document.querySelectorAll("input[name=mode]")) r.addEventListener("change", () => { updateMode(); updateHint(); });

function updateHint() {
  const sum = L.parseSum($("prompt").value);
  const m = state.model;
  $("promptHint").textContent = chatMode() || !sum ? "" : m && m.demo
    ? `A sum: sent as "\\n${sum.a}+${sum.b}=" (on its own line, as the model learnt it), stopping at the ` +
      `newline after the answer; the answer is checked against ${sum.expected}.`
    : `A sum: the answer is checked against ${sum.expected}.`;
}
$("prompt").addEventListener("input", () => {
  updateHint();
  if ($("prompt").getAttribute("aria-invalid")) markErrors(L.validate(state.settings, state.model), false);
});

// ---- runs ---------------------------------------------------------------------------------------

function running() { return state.active.size > 0; }

function setRunning(on) {
  $("run").disabled = on;
  $("compare").disabled = on;
  $("stop").disabled = !on;
  $("results").setAttribute("aria-busy", on ? "true" : "false");
}

class Column {
  constructor(box, title, shown, code, sum) {
    this.el = $("columnTemplate").content.firstElementChild.cloneNode(true);
    this.el.querySelector(".title").textContent = title;
    this.title = title;
    this.shown = shown;
    this.code = code;
    this.sum = sum;
    this.text = "";
    this.chunks = 0;
    this.tokens = null;
    this.started = performance.now();
    this.firstAt = null;
    this.stats = null;
    this.status = "running";
    this.note = "";
    this.el.querySelector("[data-role=copy]").onclick = (e) => copy(this.text, e.target);
    box.append(this.el);
    this.render();
  }

  add(text) {
    if (this.firstAt === null) this.firstAt = performance.now();
    this.text += text;
    this.chunks += 1;
  }

  finish(status, note) {
    this.status = status;
    this.note = note || "";
    this.render();
  }

  snapshot() {
    return { title: this.title, shown: this.shown, code: this.code, sum: this.sum, text: this.text,
             chunks: this.chunks, tokens: this.tokens, stats: this.stats, status: this.status, note: this.note,
             ttft: this.firstAt === null ? null : this.firstAt - this.started,
             elapsed: performance.now() - this.started };
  }

  render() { renderColumn(this.el, this.snapshot()); }
}

// Fill a result column from a snapshot (live, or re-opened from the history).
function renderColumn(el, c) {
  el.dataset.state = c.status;
  el.querySelector("[data-role=text]").innerHTML = L.renderText(c.shown, c.text, c.code);
  const n = c.tokens ?? c.chunks;
  const st = c.stats;
  el.querySelector("[data-role=state]").textContent =
    c.status === "running" ? `running · ${n} tokens`
      : c.status === "stopped" ? `stopped after ${n} tokens`
        : c.status === "error" ? `error${c.note ? `: ${c.note}` : ""}`
          : `finished · ${n} tokens${st ? ` · ${L.stopReason(st.stop_reason)}` : ""}`;
  const mark = el.querySelector("[data-role=mark]");
  if (c.sum && c.status !== "running") {
    const check = L.checkSum(c.sum, c.text);
    mark.className = `mark ${check.right ? "right" : "wrong"}`;
    mark.textContent = check.right ? "✓ right" : `✗ wrong (${check.expected})`;
    mark.setAttribute("aria-label", check.right ? "right answer" : `wrong answer, expected ${check.expected}`);
  } else {
    mark.className = "mark";
    mark.textContent = "";
  }
  const parts = [];
  if (st) {
    parts.push(`${st.tokens_per_second.toFixed(1)} tok/s`, `first token ${(st.time_to_first_token * 1000).toFixed(0)} ms`);
    if (st.mean_loops !== undefined && st.mean_loops !== null) parts.push(`mean loops ${Number(st.mean_loops).toFixed(2)}`);
    if (st.total_draft_tokens_count !== undefined) {
      parts.push(`drafted ${st.total_draft_tokens_count}, accepted ${st.accepted_draft_tokens_count}, ` +
                 `rejected ${st.rejected_draft_tokens_count}`);
    }
  } else if (c.ttft !== null) {
    const secs = Math.max(1e-3, (c.elapsed - c.ttft) / 1000);
    parts.push(`${c.chunks > 1 ? ((c.chunks - 1) / secs).toFixed(1) : "–"} tok/s`, `first token ${c.ttft.toFixed(0)} ms`);
  }
  el.querySelector("[data-role=stats]").textContent = parts.join(" · ");
}

async function copy(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    const area = document.createElement("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  button.textContent = "Copied";
  setTimeout(() => { button.textContent = "Copy"; }, 1200);
}

function serverError(err, status) {
  const e = (err && err.error) || {};
  const message = e.message || `HTTP ${status}`;
  const field = e.param ? ` — field <code>${L.escapeHtml(e.param)}</code>` : "";
  showBanner(status ? `The server refused the request (${status})` : "The server stopped the request",
             `${L.escapeHtml(message)}${field}`);
  if (e.param) {
    markErrors([{ field: e.param, message }], false);
    const el = fieldElement(e.param);
    if (el && form.contains(el)) $("settings").open = true;
  }
  return message;
}

async function stream(col, url, body) {
  const ctl = new AbortController();
  state.active.add(ctl);
  let timer = null;
  try {
    const resp = await fetch(url, { method: "POST", headers: { "Content-Type": "application/json" },
                                    body: JSON.stringify(body), signal: ctl.signal });
    if (!resp.ok) {
      const err = await resp.json().catch(() => null);
      col.finish("error", serverError(err, resp.status));
      return;
    }
    timer = setInterval(() => col.render(), 250);
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      const { events, rest } = L.sseEvents(buf + decoder.decode(value, { stream: true }));
      buf = rest;
      for (const data of events) {
        if (data === "[DONE]") continue;
        const ev = JSON.parse(data);
        if (ev.error) { col.finish("error", serverError(ev, 0)); return; }
        for (const c of ev.choices || []) {
          const text = c.delta ? c.delta.content : c.text;
          if (text) col.add(text);
        }
        if (ev.stats) col.stats = ev.stats;
        if (ev.usage) col.tokens = ev.usage.completion_tokens;
      }
      col.render();
    }
    col.finish(col.stats && col.stats.stop_reason === "userStopped" ? "stopped" : "finished");
  } catch (e) {
    if (e.name === "AbortError") { col.finish("stopped"); return; }
    setConnection("offline", "offline");
    showBanner("Cannot reach the server", `${L.escapeHtml(location.origin)} did not answer (${L.escapeHtml(e.message)}). ` +
               "Is <code>tinyloop serve</code> still running?");
    col.finish("error", "no connection");
  } finally {
    if (timer) clearInterval(timer);
    state.active.delete(ctl);
    ctl.abort();  // an error event ends the read early: let the connection go
  }
}

async function launch(kind) {
  if (running()) return;
  const s = state.settings;
  const m = state.model;
  const prompt = $("prompt").value;
  const errors = L.validate(s, m, prompt);
  markErrors(errors, true);
  if (errors.length) return;
  hideBanner();
  const chat = chatMode();
  const check = chat ? null : L.parseSum(prompt);
  const prep = check && m && m.demo ? check : null;
  const sent = prep ? prep.prompt : prompt;
  const messages = chat ? [...($("system").value ? [{ role: "system", content: $("system").value }] : []),
                           { role: "user", content: prompt }] : null;
  const url = chat ? "/api/v0/chat/completions" : "/api/v0/completions";
  const shown = chat ? `${prompt}\n\n` : sent;
  const code = !check && L.looksLikeCode(prompt);
  const list = kind === "compare" ? L.compareList(s.compare_loops) : [s.loops === "" ? null : Number(s.loops)];
  const box = $("results");
  box.replaceChildren();
  box.classList.toggle("single", list.length === 1);
  setRunning(true);
  const cols = list.map((loops) => {
    const title = loops === null ? `loops ${m ? m.default_loops : "default"} (default)` : `loops ${loops}`;
    const col = new Column(box, title, shown, code, check);
    const body = L.buildBody(s, { prompt: sent, messages, loops: loops ?? undefined, sum: prep });
    return { col, body };
  });
  try {
    await Promise.all(cols.map(({ col, body }) => stream(col, url, body)));
  } finally {
    setRunning(false);
  }
  remember({ kind, prompt, chat, at: new Date().toISOString(), columns: cols.map(({ col }) => col.snapshot()) });
}

function stopAll() {
  for (const ctl of state.active) ctl.abort();
}

$("run").onclick = () => launch("run");
$("compare").onclick = () => launch("compare");
$("stop").onclick = stopAll;

document.addEventListener("keydown", (e) => {
  if ((e.ctrlKey || e.metaKey) && e.key === "Enter") {
    e.preventDefault();
    launch(e.shiftKey ? "compare" : "run");
  } else if (e.key === "Escape" && running()) {
    e.preventDefault();
    stopAll();
  }
});

// ---- history ------------------------------------------------------------------------------------

function remember(entry) {
  state.history = [entry, ...state.history].slice(0, HISTORY_MAX);
  save(HISTORY_KEY, state.history);
  renderHistory();
}

function renderHistory() {
  const list = $("history");
  list.replaceChildren();
  state.history.forEach((h, i) => {
    const li = document.createElement("li");
    const b = document.createElement("button");
    b.type = "button";
    const when = new Date(h.at).toLocaleTimeString();
    const what = h.kind === "compare" ? `compare ${h.columns.map((c) => c.title.replace("loops ", "")).join(",")}` : h.columns[0].title;
    const prompt = h.prompt.trim().replace(/\s+/g, " ");
    b.textContent = `${when} · ${what} · ${prompt.length > 40 ? `${prompt.slice(0, 40)}…` : prompt}`;
    b.onclick = () => reopen(i);
    li.append(b);
    list.append(li);
  });
}

function reopen(i) {
  const h = state.history[i];
  $("prompt").value = h.prompt;
  const box = $("results");
  box.replaceChildren();
  box.classList.toggle("single", h.columns.length === 1);
  for (const c of h.columns) {
    const el = $("columnTemplate").content.firstElementChild.cloneNode(true);
    el.querySelector(".title").textContent = c.title;
    el.querySelector("[data-role=copy]").onclick = (e) => copy(c.text, e.target);
    renderColumn(el, c);
    box.append(el);
  }
  updateHint();
}

$("clearHistory").onclick = () => { state.history = []; save(HISTORY_KEY, []); renderHistory(); };

// ---- live server state --------------------------------------------------------------------------

async function poll() {
  try {
    const resp = await fetch("/metrics", { cache: "no-store" });
    if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
    const cur = L.parseMetrics(await resp.text());
    const now = performance.now();
    const live = L.liveStats(state.metrics.prev, cur, (now - state.metrics.prevAt) / 1000);
    state.metrics.prev = cur;
    state.metrics.prevAt = now;
    const wasOnline = $("conn").dataset.state === "online";
    setConnection("online", "connected");
    if (!state.model || !wasOnline) await loadModel().catch(() => {});
    const show = (id, v) => { $(id).textContent = v === null || v === undefined ? "–" : String(v); };
    show("liveQueue", live.queue);
    show("liveInFlight", live.inFlight);
    show("liveBatch", live.batch === null ? null : live.batch.toFixed(1));
    show("liveKv", live.kvUsed === null ? null : `${live.kvUsed} / ${live.kvTotal}`);
    show("liveHits", live.hitRate === null ? null : `${(live.hitRate * 100).toFixed(0)}%`);
    show("liveCancelled", live.cancelled);
    if (live.tokensPerSecond !== null) {
      const series = state.metrics.series;
      series.push({ at: now, v: live.tokensPerSecond });
      while (series.length && now - series[0].at > 60000) series.shift();
      show("liveTps", live.tokensPerSecond.toFixed(1));
      $("spark").querySelector("polyline").setAttribute("points", L.sparkline(series.map((p) => p.v), 120, 24));
    }
  } catch (e) {
    setConnection("offline", "offline: server unreachable");
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

// ---- start --------------------------------------------------------------------------------------

fillForm();
renderHistory();
updateMode();
updateHint();
poll();
