// tinyllm's live view: reads the server-sent events of GET /engine/events (live.py) and draws
// the engine as it serves: its slots, its paged pool, its recent steps and its counters.
// Plain JavaScript: EventSource, the DOM and two canvases; nothing fetched from elsewhere.
// Events: hello (what is served), frame (the engine's state, at most every 100 ms), beat (the
// engine's health, when no frame came for a second). Every text a request could carry is
// written with textContent, never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const root = $("engine");
const STRIP = 160; // sampled steps the strip keeps
const SILENT_MS = 3500; // no event for this long: the stream is gone, open it again
const HIT_MS = 1500; // a prefix hit's blocks stay ringed this long
const COLOURS = {}; // the palette of page.css, read once

const state = {
  source: null, hello: null, frame: null, heard: 0, strip: [],
  seen: new Map(), hits: [], drawn: false, stepTimes: [],
};

// ---- the stream ------------------------------------------------------------------------
function connect() {
  if (state.source) state.source.close();
  const source = new EventSource("/engine/events");
  state.source = source;
  source.addEventListener("open", () => { heard(); setStatus("live", "live"); });
  source.addEventListener("error", () => {
    setStatus("gone", "engine gone: reconnecting");
    if (source.readyState === EventSource.CLOSED) setTimeout(connect, 2000);
  });
  source.addEventListener("hello", (e) => { heard(); onHello(JSON.parse(e.data)); });
  source.addEventListener("frame", (e) => { heard(); onFrame(JSON.parse(e.data)); });
  source.addEventListener("beat", (e) => { heard(); onBeat(JSON.parse(e.data)); });
}

function heard() { state.heard = performance.now(); }

function watchdog() {
  // a stream that went quiet (a server gone without closing it) is opened again
  if (root.dataset.status === "live" && performance.now() - state.heard > SILENT_MS) {
    setStatus("gone", "engine gone: reconnecting");
    connect();
  }
}

function setStatus(status, words) {
  root.dataset.status = status;
  $("status").textContent = words;
}

// ---- hello: what is served ---------------------------------------------------------------
function onHello(hello) {
  // a stream opened (again): what was drawn before may be another engine's
  Object.assign(state, { hello, frame: null, strip: [], hits: [], stepTimes: [] });
  state.seen.clear();
  const s = hello.serving, kv = s.kv_cache;
  $("model").textContent = hello.model;
  let cache = `KV ${kv.kind}: ${kv.slots} slots of up to ${kv.max_len} positions`;
  if (kv.kind === "paged") {
    cache += `, ${kv.blocks} blocks of ${kv.block_size}` + (kv.prefix_cache ? ", prefix cache" : "");
  }
  const budget = s.max_step_tokens === null ? "whole prompts" : `${s.max_step_tokens} tokens a step`;
  $("serving").textContent = `weights ${s.weights} · decoder ${s.decoder} · speculation ` +
    `${s.speculation} · ${cache} · ${budget}`;
  $("every").textContent = Math.round(hello.every_s * 1000);
  $("privacy").textContent = hello.texts
    ? "This server shows prompts and answers (serve --show-prompts)."
    : "No prompt or answer text is sent to this page (serve --show-prompts would show them).";
  root.dataset.slots = kv.slots;
  root.dataset.blocks = kv.kind === "paged" ? kv.blocks : 0;
  makeSlotRows(kv.slots);
  const paged = kv.kind === "paged";
  $("pool-title").textContent = paged ? "Paged pool" : "KV cache: slots";
  $("pool-legend").hidden = $("pool").hidden = !paged;
  $("pool-note").textContent = paged ? "" :
    "This server's KV cache is slots (step 04): each slot reserves its positions up front, so " +
    "there is no pool of blocks to draw. Serve with --kv paged to see one.";
}

// ---- frame: the engine's state -----------------------------------------------------------
function onFrame(f) {
  const last = state.frame;
  if (last && f.steps < last.steps) { state.strip = []; state.seen.clear(); } // a new engine
  if (f.step) state.strip.push({ ...f.step, steps: f.steps, since: last ? f.steps - last.steps : 0 });
  if (state.strip.length > STRIP) state.strip.splice(0, state.strip.length - STRIP);
  state.frame = f;
  const now = performance.now();
  state.stepTimes = state.stepTimes.filter(([t]) => now - t < 3000).concat([[now, f.steps]]);
  noteHits(f, !last);
  root.dataset.step = f.steps;
  $("step").textContent = f.steps;
  drawSlots(f);
  drawWaiting(f);
  countBlocks(f);
  drawCounters(f.counters, f);
  if (!state.drawn) { state.drawn = true; requestAnimationFrame(drawCanvases); }
}

function onBeat(beat) {
  if (beat.engine === "failed") setStatus("failed", `engine failed: ${beat.why}`);
  else if (beat.engine === "restarting") setStatus("gone", `engine restarting: ${beat.why}`);
  else if (beat.engine === "busy") setStatus("busy", `engine busy: ${beat.why}`);
  else if (root.dataset.status !== "live") setStatus("live", "live");
  if (beat.counters && state.frame) drawCounters(beat.counters, state.frame);
}

function drawCanvases() {
  state.drawn = false;
  if (!state.frame) return;
  drawPool(state.frame);
  drawStrip();
}

// ---- the slots ---------------------------------------------------------------------------
function makeSlotRows(n) {
  const box = $("slots");
  box.textContent = "";
  for (let s = 0; s < n; s++) {
    const row = document.createElement("div");
    row.className = "slot free";
    row.dataset.slot = s;
    row.innerHTML = '<span class="n"></span><span class="key"></span><span class="badge"></span>' +
      '<span class="bar"></span><span class="what"></span>';
    row.querySelector(".n").textContent = s;
    box.appendChild(row);
    const text = document.createElement("div");
    text.className = "text";
    text.hidden = true;
    box.appendChild(text);
  }
}

function drawSlots(f) {
  const rows = $("slots").querySelectorAll(".slot");
  if (rows.length !== f.slots.length) makeSlotRows(f.slots.length);
  const busy = f.slots.filter((s) => s);
  const span = Math.max(16, ...busy.map((s) => s.prompt + s.max_new));
  $("slots").querySelectorAll(".slot").forEach((row, i) => drawSlot(row, f.slots[i], span, f));
  root.dataset.slotsBusy = busy.length;
  $("slots-count").textContent = `${busy.length} of ${f.slots.length} busy`;
}

function drawSlot(row, s, span, f) {
  const [key, badge, bar, what] = ["key", "badge", "bar", "what"].map((c) => row.querySelector("." + c));
  const text = row.nextElementSibling;
  row.className = s ? "slot" : "slot free";
  if (!s) {
    key.textContent = ""; badge.className = "badge free"; badge.textContent = "free";
    bar.textContent = ""; what.textContent = ""; text.hidden = true;
    return;
  }
  key.textContent = `#${s.key}`;
  badge.className = `badge ${s.phase}`;
  badge.textContent = s.phase;
  const done = Math.min(s.computed, s.prompt), cached = Math.min(s.cached, done);
  const outColour = s.phase === "prefill" ? "decode" : s.phase;
  const parts = [["cached", cached], ["prefill", done - cached], ["todo", s.prompt - done],
    [outColour, s.out], ["left", Math.max(0, s.max_new - s.out)]];
  bar.textContent = "";
  for (const [cls, n] of parts) {
    if (n <= 0) continue;
    const seg = document.createElement("i");
    seg.className = cls;
    seg.style.width = `${(100 * n) / span}%`;
    bar.appendChild(seg);
  }
  const did = s.did > 1 ? ` +${s.did}` : "";
  what.textContent = `prompt ${s.prompt}` + (s.cached ? `, ${s.cached} cached` : "") +
    ` · out ${s.out}/${s.max_new}` + (s.grammar ? " · grammar" : "");
  if (did) {
    const b = document.createElement("span");
    b.className = "did";
    b.textContent = did;
    what.prepend(b, " ");
  }
  const texts = f.texts && f.texts[s.key];
  text.hidden = !texts;
  if (texts) text.textContent = `“${texts[0]}” → “${texts[1]}”`;
}

function drawWaiting(f) {
  const box = $("waiting");
  box.textContent = "";
  for (const w of f.waiting) {
    const chip = document.createElement("span");
    chip.className = w.out ? "chip preempted" : "chip";
    chip.textContent = `#${w.key} · ${w.prompt}` + (w.out ? ` +${w.out} (preempted)` : "");
    box.appendChild(chip);
  }
  const more = f.n_waiting - f.waiting.length;
  if (more > 0) {
    const chip = document.createElement("span");
    chip.className = "chip";
    chip.textContent = `+${more} more`;
    box.appendChild(chip);
  }
  const held = f.held ? `, ${f.held} choices held for their first` : "";
  $("waiting-count").textContent = `${f.n_waiting} waiting${held}`;
}

// ---- the paged pool ----------------------------------------------------------------------
function noteHits(f, first) {
  // a request seen for the first time with cached tokens: the prefix cache served it (those
  // in the slots when the page opens are not news)
  const now = performance.now(), bs = state.hello ? state.hello.serving.kv_cache.block_size : 16;
  for (const s of f.slots) {
    if (!s || state.seen.has(s.key)) continue;
    state.seen.set(s.key, now);
    if (!first && s.cached > 0 && s.table) {
      state.hits.push({ key: s.key, tokens: s.cached, blocks: s.table.slice(0, Math.ceil(s.cached / bs)), t: now });
    }
  }
  if (state.seen.size > 4096) state.seen.delete(state.seen.keys().next().value);
  state.hits = state.hits.filter((h) => now - h.t < 10000).slice(-6);
  $("hits").textContent = state.hits.length
    ? "prefix hits: " + state.hits.slice().reverse().map((h) => `#${h.key}: ${h.tokens} tokens`).join(", ")
    : "";
}

function countBlocks(f) {
  if (!f.blocks) return;
  let held = 0, shared = 0, cached = 0;
  for (const v of f.blocks) {
    if (v > 0) held++;
    if (v > 1) shared++;
    if (v < 0) cached++;
  }
  Object.assign(root.dataset, { blocksHeld: held, blocksShared: shared, blocksCached: cached });
  const kv = state.hello ? state.hello.serving.kv_cache : { block_size: "?" };
  $("pool-count").textContent = `${f.blocks.length} blocks of ${kv.block_size}: ${held} held` +
    ` (${shared} shared), ${cached} cached, ${f.blocks.length - held - cached} free`;
}

function drawPool(f) {
  const canvas = $("pool");
  if (!f.blocks) { canvas.hidden = true; return; }
  canvas.hidden = false;
  const n = f.blocks.length, W = canvas.clientWidth;
  let pitch = 24;
  while (pitch > 5 && Math.ceil(n / Math.floor(W / pitch)) * pitch > 300) pitch--;
  const cols = Math.max(1, Math.floor(W / pitch)), H = Math.ceil(n / cols) * pitch;
  const ctx = sized(canvas, W, H);
  const owner = new Map();
  f.slots.forEach((s) => s && s.table && s.table.forEach((b) => owner.has(b) || owner.set(b, s.phase)));
  const now = performance.now();
  const hit = new Set(state.hits.filter((h) => now - h.t < HIT_MS).flatMap((h) => h.blocks));
  const cell = pitch - 2;
  ctx.font = `600 ${Math.max(8, cell - 7)}px system-ui, sans-serif`;
  ctx.textAlign = "center";
  ctx.textBaseline = "middle";
  for (let b = 0; b < n; b++) {
    const v = f.blocks[b], x = (b % cols) * pitch + 1, y = Math.floor(b / cols) * pitch + 1;
    ctx.fillStyle = v === 0 ? colour("free") : v < 0 ? colour("evictable")
      : v > 1 ? colour("shared") : colour(owner.get(b) || "prefill");
    ctx.fillRect(x, y, cell, cell);
    if (v > 1 && cell >= 12) {
      ctx.fillStyle = "#fff";
      ctx.fillText(String(v), x + cell / 2, y + cell / 2 + 1);
    }
    if (hit.has(b)) {
      ctx.strokeStyle = colour("hit");
      ctx.lineWidth = 2;
      ctx.strokeRect(x + 1, y + 1, cell - 2, cell - 2);
    }
  }
}

// ---- the strip of recent steps -----------------------------------------------------------
function drawStrip() {
  const canvas = $("strip"), W = canvas.clientWidth, H = 150, pad = 18;
  const ctx = sized(canvas, W, H);
  const steps = state.strip, bw = W / STRIP;
  const tokens = (e) => e.chunk + e.decode + e.guesses;
  const top = Math.max(8, ...steps.map(tokens)), topMs = Math.max(1, ...steps.map((e) => e.ms));
  const y = (v) => H - pad - ((H - 2 * pad) * v) / top;
  ctx.strokeStyle = colour("free");
  ctx.beginPath(); ctx.moveTo(0, H - pad + 0.5); ctx.lineTo(W, H - pad + 0.5); ctx.stroke();
  steps.forEach((e, i) => {
    let base = 0;
    const x = (STRIP - steps.length + i) * bw;
    for (const [name, v] of [["prefill", e.chunk], ["decode", e.decode], ["speculate", e.kept],
      ["rolled", e.guesses - e.kept]]) {
      if (v <= 0) continue;
      ctx.fillStyle = colour(name);
      ctx.fillRect(x + 0.5, y(base + v), Math.max(1, bw - 1), y(base) - y(base + v));
      base += v;
    }
  });
  ctx.strokeStyle = "#374151";
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  steps.forEach((e, i) => {
    const x = (STRIP - steps.length + i + 0.5) * bw, yy = H - pad - ((H - 2 * pad) * e.ms) / topMs;
    i ? ctx.lineTo(x, yy) : ctx.moveTo(x, yy);
  });
  ctx.stroke();
  ctx.fillStyle = "#6b7280";
  ctx.font = "11px system-ui, sans-serif";
  ctx.textBaseline = "top";
  ctx.textAlign = "left";
  ctx.fillText(`${top} tokens`, 2, 2);
  ctx.textAlign = "right";
  ctx.fillText(`${topMs.toFixed(1)} ms`, W - 2, 2);
  const e = steps[steps.length - 1];
  $("strip-note").textContent = e ? `step ${e.steps}: ${e.rows} rows, ${e.chunk} prefill-chunk ` +
    `tokens, ${e.decode} decodes` + (e.guesses ? `, ${e.kept} of ${e.guesses} guesses kept` : "") +
    `, ${e.ms.toFixed(1)} ms; ${e.since} steps since the frame before` : "";
}

// ---- the counters ------------------------------------------------------------------------
function drawCounters(c, f) {
  if (!c) return;
  const fixed = (v, d = 1) => (v === null || v === undefined ? "-" : Number(v).toFixed(d));
  const pct = (v) => (v === null || v === undefined ? "-" : `${(100 * v).toFixed(0)}%`);
  const trio = (p) => (p ? p.map((v) => fixed(v, v < 10 ? 1 : 0)).join(" / ") : "-");
  $("c-tok-s").textContent = fixed(c.tok_s);
  $("c-req-s").textContent = fixed(c.req_s, 2);
  $("c-ttft").textContent = trio(c.ttft_ms);
  $("c-itl").textContent = trio(c.itl_ms);
  $("c-kv").textContent = pct(c.kv_used);
  $("c-accept").textContent = pct(c.acceptance);
  $("c-load").textContent = `${c.running} · ${c.waiting}`;
  $("c-steps").textContent = fixed(stepRate(), 0);
  $("c-served").textContent = c.served.toFixed(0);
  $("c-429").textContent = c.rejected.toFixed(0);
  $("c-preempt").textContent = f.preemptions;
  $("c-prefix").textContent = f.prompt_tokens ? pct(f.cached_prompt_tokens / f.prompt_tokens) : "-";
}

function stepRate() {
  // engine steps a second over the frames of the last 3 s (0 once the frames stop: idle)
  const times = state.stepTimes, now = performance.now();
  if (times.length < 2 || now - times[times.length - 1][0] > 1500) return 0;
  const [[t0, s0], [t1, s1]] = [times[0], times[times.length - 1]];
  return t1 > t0 ? (1000 * (s1 - s0)) / (t1 - t0) : 0;
}

// ---- drawing helpers ---------------------------------------------------------------------
function sized(canvas, W, H) {
  const dpr = window.devicePixelRatio || 1;
  canvas.style.height = `${H}px`;
  canvas.width = Math.round(W * dpr);
  canvas.height = Math.round(H * dpr);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, W, H);
  return ctx;
}

function colour(name) {
  if (!(name in COLOURS)) {
    COLOURS[name] = getComputedStyle(document.documentElement).getPropertyValue(`--${name}`).trim() || "#999";
  }
  return COLOURS[name];
}

window.addEventListener("resize", () => requestAnimationFrame(drawCanvases));
setInterval(watchdog, 1000);
connect();
