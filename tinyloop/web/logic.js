// The playground's pure logic: no DOM, no network. app.js drives the page with it; the browser
// tests import it directly (tests/web/test_playground.py) to check it case by case.

// ---- addition: the demo model was trained on "\nA+B=C\n" lines ----------------------------------

const SUM = /^\s*(\d{1,18})\s*\+\s*(\d{1,18})\s*=\s*$/;

// A prompt that is one sum ("123+456=", with or without spaces or a leading newline) as the
// model expects it: a leading newline, no spaces, stop at the newline after the answer.
// Returns null for any other prompt.
export function parseSum(prompt) {
  const m = SUM.exec(prompt);
  if (!m) return null;
  const [a, b] = [m[1], m[2]];
  const expected = (BigInt(a) + BigInt(b)).toString();
  return { a, b, expected, prompt: `\n${a}+${b}=`, stop: ["\n"], maxTokens: expected.length + 2 };
}

// The model's answer to a sum (the digits it wrote first) against the true sum.
export function checkSum(sum, completion) {
  const got = (/^\s*(\d*)/.exec(completion) || ["", ""])[1];
  return { expected: sum.expected, got, right: got === sum.expected };
}

// ---- settings: what the server accepts (tinyloop/http/schemas.py), checked before sending ------

export const DEFAULTS = Object.freeze({
  max_tokens: 96, temperature: 0, top_p: 1, top_k: 0, min_p: 0, repetition_penalty: 1,
  presence_penalty: 0, frequency_penalty: 0, seed: "", stop: "", ignore_eos: false, loops: "",
  cache_window: "", warm_start: "off", exit_kind: "", exit_threshold: "", exit_min_loops: "",
  exit_check_every: 1, exit_exited_kv: "copy_latest", speculation: false, draft_loops: 1,
  draft_ahead: 4, branches: 1, priority: 0, compare_loops: "1,2,4,8",
});

// Exit rules that stop a token's loops early (STOP_KINDS in tinyloop/vocabulary.py).
const STOP_KINDS = new Set(["gate", "kl", "minp_kl", "entropy_diff", "latent_diff", "cosine", "argmax_stability"]);

const num = (v) => (v === "" || v === null || v === undefined ? null : Number(v));
const isInt = (v) => Number.isInteger(v);

// Per field: [check(value, settings, model) -> message or null]. Empty optional fields pass.
const RULES = {
  max_tokens: (v, s, m) => !isInt(v) || v < 1 ? "max tokens must be a whole number >= 1"
    : m && v > m.context_length ? `max tokens must be at most the context, ${m.context_length}` : null,
  temperature: (v) => !(v >= 0 && v <= 2) ? "temperature must be between 0 and 2" : null,
  top_p: (v) => !(v > 0 && v <= 1) ? "top-p must be in (0, 1]" : null,
  top_k: (v) => !isInt(v) || v < 0 ? "top-k must be a whole number >= 0 (0: off)" : null,
  min_p: (v) => !(v >= 0 && v <= 1) ? "min-p must be between 0 and 1" : null,
  repetition_penalty: (v) => !(v >= 0.01 && v <= 10) ? "repetition penalty must be between 0.01 and 10" : null,
  presence_penalty: (v) => !(v >= -2 && v <= 2) ? "presence penalty must be between -2 and 2" : null,
  frequency_penalty: (v) => !(v >= -2 && v <= 2) ? "frequency penalty must be between -2 and 2" : null,
  seed: (v) => v !== null && (!isInt(v) || Math.abs(v) > Number.MAX_SAFE_INTEGER) ? "seed must be a whole number" : null,
  loops: (v, s, m) => v !== null && (!isInt(v) || v < 1 || (m && v > m.max_loops))
    ? `loops must be a whole number from 1 to ${m ? m.max_loops : "the model's maximum"}` : null,
  cache_window: (v) => v !== null && (!isInt(v) || v < 1) ? "cache window must be a whole number >= 1" : null,
  exit_threshold: (v, s) => v !== null && s.exit_kind && !(v > 0) ? "exit threshold must be > 0" : null,
  exit_min_loops: (v, s) => v !== null && s.exit_kind && (!isInt(v) || v < 1) ? "exit min loops must be >= 1" : null,
  exit_check_every: (v, s) => s.exit_kind && (!isInt(v) || v < 1) ? "check every must be >= 1" : null,
  draft_loops: (v, s) => s.speculation && (!isInt(v) || v < 1) ? "draft loops must be >= 1" : null,
  draft_ahead: (v, s) => s.speculation && (!isInt(v) || v < 1 || v > 64) ? "draft ahead must be from 1 to 64" : null,
  branches: (v, s) => s.speculation && (!isInt(v) || v < 1 || v > 16) ? "branches must be from 1 to 16" : null,
  priority: (v) => !isInt(v) || v < -1000 || v > 1000 ? "priority must be from -1000 to 1000" : null,
};

export function stopList(text) {
  return String(text || "").split("\n").map((s) => s.replace(/\\n/g, "\n").replace(/\\t/g, "\t")).filter((s) => s);
}

export function compareList(text) {
  return String(text || "").split(/[\s,]+/).filter((s) => s).map(Number);
}

// Every problem in ``s`` as [{field, message}] (empty: ready to send). ``m``: /ui/model.json.
export function validate(s, m, prompt) {
  const errors = [];
  if (prompt !== undefined && !String(prompt).trim()) errors.push({ field: "prompt", message: "the prompt is empty" });
  for (const [field, rule] of Object.entries(RULES)) {
    const message = rule(num(s[field]), s, m);
    if (message) errors.push({ field, message });
  }
  const stops = stopList(s.stop);
  if (stops.length > 16 || stops.some((x) => x.length > 256)) {
    errors.push({ field: "stop", message: "at most 16 stop strings, one per line, of at most 256 characters" });
  }
  const loops = num(s.loops) ?? (m ? m.default_loops : null);
  if (s.speculation && loops !== null && num(s.draft_loops) > loops) {
    errors.push({ field: "draft_loops", message: `draft loops must be at most the loops (${loops})` });
  }
  if (s.speculation) {  // what the server refuses to combine with speculation (tinyloop/limits.py)
    if (s.warm_start !== "off") errors.push({ field: "warm_start", message: "warm start cannot be combined with speculation" });
    if (STOP_KINDS.has(s.exit_kind)) {
      errors.push({ field: "exit_kind", message: `speculation cannot run with an exit rule that stops early (${s.exit_kind})` });
    }
    if (num(s.cache_window) !== null && loops !== null && num(s.cache_window) < loops) {
      errors.push({ field: "cache_window", message: "speculation needs the full cache (cache window >= loops)" });
    }
  }
  if (s.exit_kind && num(s.exit_min_loops) !== null && loops !== null && num(s.exit_min_loops) > loops) {
    errors.push({ field: "exit_min_loops", message: `exit min loops must be at most the loops (${loops})` });
  }
  const cmp = compareList(s.compare_loops);
  if (!cmp.length || cmp.length > 8 || cmp.some((v) => !isInt(v) || v < 1 || (m && v > m.max_loops))) {
    errors.push({ field: "compare_loops", message: `compare: 1 to 8 loop counts from 1 to ${m ? m.max_loops : "max"}, e.g. 1,2,4,8` });
  }
  return errors;
}

// The request body for /api/v0/completions (or chat/completions with ``messages``): the sampling
// fields always, the optional knobs only when set. ``over``: {prompt | messages, loops, sum}.
export function buildBody(s, over) {
  const body = over.messages ? { messages: over.messages } : { prompt: over.prompt };
  body.max_tokens = over.sum ? Math.min(num(s.max_tokens), over.sum.maxTokens) : num(s.max_tokens);
  for (const k of ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "priority"]) body[k] = num(s[k]);
  if (num(s.seed) !== null) body.seed = num(s.seed);
  const stops = over.sum ? [...new Set([...stopList(s.stop), ...over.sum.stop])] : stopList(s.stop);
  if (stops.length) body.stop = stops;
  if (s.ignore_eos) body.ignore_eos = true;
  const loops = over.loops ?? num(s.loops);
  if (loops !== null) body.loops = loops;
  if (num(s.cache_window) !== null) body.cache_window = num(s.cache_window);
  if (s.warm_start === "raw") body.warm_start = true;
  else if (s.warm_start === "normed") body.warm_start = "normed";
  if (s.exit_kind) {
    body.exit = { kind: s.exit_kind, check_every: num(s.exit_check_every), exited_kv: s.exit_exited_kv };
    if (num(s.exit_threshold) !== null) body.exit.threshold = num(s.exit_threshold);
    if (num(s.exit_min_loops) !== null) body.exit.min_loops = num(s.exit_min_loops);
  }
  if (s.speculation) {
    body.speculation = { draft_loops: num(s.draft_loops), draft_ahead: num(s.draft_ahead), branches: num(s.branches) };
  }
  body.stream = true;
  body.stream_options = { include_usage: true };
  return body;
}

// ---- streaming ------------------------------------------------------------------------------

// Split an SSE buffer into complete ``data:`` payloads and the unfinished rest.
export function sseEvents(buffer) {
  const events = [];
  let rest = buffer.replace(/\r\n/g, "\n");
  let i;
  while ((i = rest.indexOf("\n\n")) >= 0) {
    const block = rest.slice(0, i);
    rest = rest.slice(i + 2);
    const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).replace(/^ /, ""));
    if (data.length) events.push(data.join("\n"));
  }
  return { events, rest };
}

const STOP_REASONS = {
  eosFound: "end of text", stopStringFound: "stop string", maxPredictedTokensReached: "max tokens",
  contextLengthReached: "context full", userStopped: "stopped",
};

export function stopReason(reason) {
  return STOP_REASONS[reason] || reason || "";
}

// ---- /metrics: Prometheus text to numbers, and the live panel's figures ------------------------

// {"name" or "name{labels}": value} of every sample (comments and blank lines skipped).
export function parseMetrics(text) {
  const out = {};
  for (const line of String(text).split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = /^([a-zA-Z_:][\w:]*(?:\{[^}]*\})?)\s+(\S+)/.exec(line);
    if (!m) continue;
    const v = m[2] === "+Inf" ? Infinity : m[2] === "-Inf" ? -Infinity : Number(m[2]);
    out[m[1]] = v;
  }
  return out;
}

// The live panel from two successive readings ``dt`` seconds apart (``prev`` may be null).
export function liveStats(prev, cur, dt) {
  const g = (name) => cur[name] ?? null;
  const delta = (name) => (prev && cur[name] !== undefined && prev[name] !== undefined ? cur[name] - prev[name] : null);
  const queried = g("tinyloop_prefix_cache_queried_tokens_total");
  const hits = g("tinyloop_prefix_cache_hit_tokens_total");
  const steps = delta("tinyloop_batch_size_count");
  const seqs = delta("tinyloop_batch_size_sum");
  const tokens = delta("tinyloop_tokens_generated_total");
  return {
    queue: g("tinyloop_queue_depth"),
    inFlight: g("tinyloop_requests_in_flight"),
    batch: steps ? seqs / steps : steps === 0 ? 0 : null,
    kvUsed: g("tinyloop_kv_blocks_used"),
    kvTotal: g("tinyloop_kv_blocks_total"),
    hitRate: queried ? (hits || 0) / queried : null,
    tokensPerSecond: tokens === null || !(dt > 0) ? null : Math.max(0, tokens) / dt,
    cancelled: g("tinyloop_requests_cancelled_total"),
  };
}

// SVG polyline points for ``values`` in a ``w`` x ``h`` box (empty for fewer than 2 values).
export function sparkline(values, w, h) {
  if (values.length < 2) return "";
  const max = Math.max(...values, 1e-9);
  const step = w / (values.length - 1);
  return values.map((v, i) => `${(i * step).toFixed(1)},${(h - 1 - (v / max) * (h - 2)).toFixed(1)}`).join(" ");
}

// ---- code highlighting: a small Python tokenizer ---------------------------------------------

const KEYWORDS = new Set(("False None True and as assert async await break class continue def del elif else " +
  "except finally for from global if import in is lambda nonlocal not or pass raise return try while with yield " +
  "match case").split(" "));
const BUILTINS = new Set(("print len range self int str list dict set tuple float bool object super isinstance " +
  "type open enumerate zip map filter sorted min max sum any all repr iter next abs cls").split(" "));
const TOKEN = new RegExp([
  /(#[^\n]*)/.source,                                                        // 1 comment
  /((?:[rbfuRBFU]{1,2})?(?:"""[\s\S]*?(?:"""|$)|'''[\s\S]*?(?:'''|$)|"(?:\\.|[^"\\\n])*"?|'(?:\\.|[^'\\\n])*'?))/.source, // 2 string
  /(\b\d[\d_]*(?:\.\d+)?(?:[eE][+-]?\d+)?j?\b)/.source,                      // 3 number
  /(@[\w.]+)/.source,                                                        // 4 decorator
  /([A-Za-z_]\w*)/.source,                                                   // 5 name
].join("|"), "g");

// [[class or "", text], ...] covering ``text`` exactly.
export function highlight(text) {
  const out = [];
  let last = 0;
  let prevName = "";
  for (const m of text.matchAll(TOKEN)) {
    if (m.index > last) out.push(["", text.slice(last, m.index)]);
    let cls = "";
    if (m[1] !== undefined) cls = "c";
    else if (m[2] !== undefined) cls = "s";
    else if (m[3] !== undefined) cls = "n";
    else if (m[4] !== undefined) cls = "d";
    else if (KEYWORDS.has(m[5])) cls = "k";
    else if (prevName === "def" || prevName === "class") cls = "f";
    else if (BUILTINS.has(m[5])) cls = "b";
    prevName = m[5] !== undefined ? m[5] : "";
    out.push([cls, m[0]]);
    last = m.index + m[0].length;
  }
  if (last < text.length) out.push(["", text.slice(last)]);
  return out;
}

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
export const escapeHtml = (s) => String(s).replace(/[&<>"']/g, (c) => ESCAPES[c]);

// HTML for ``prompt`` (dimmed) followed by ``completion``, highlighted as Python when ``code``.
export function renderText(prompt, completion, code) {
  const full = prompt + completion;
  const tokens = code ? highlight(full) : [["", full]];
  let pos = 0;
  let html = "";
  for (const [cls, text] of tokens) {
    const cut = Math.max(0, Math.min(text.length, prompt.length - pos));
    for (const [part, isPrompt] of [[text.slice(0, cut), true], [text.slice(cut), false]]) {
      if (!part) continue;
      const classes = [cls && `t-${cls}`, isPrompt && "prompt"].filter(Boolean).join(" ");
      html += classes ? `<span class="${classes}">${escapeHtml(part)}</span>` : escapeHtml(part);
    }
    pos += text.length;
  }
  return html;
}

// Whether a prompt looks like Python source (highlight it) rather than prose or a sum.
export function looksLikeCode(text) {
  return /(^|\n)\s*(def|class|import|from|for|while|if|return|@)\b|[:=]\s*$|\(\)|^\s*#/.test(text) && !SUM.test(text);
}
