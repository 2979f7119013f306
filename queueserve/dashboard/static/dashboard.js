// queueserve dashboard: polls /api/overview a second after each answer and draws it; no build
// step.
"use strict";

const POLL_MS = 1000;
const tokenInput = document.getElementById("token");
tokenInput.value = sessionStorage.getItem("qs-token") || "";
tokenInput.addEventListener("change", () => {
  sessionStorage.setItem("qs-token", tokenInput.value);
  refresh();
});

// Reads carry the token entered too: a dashboard started with --read-token answers 401
// without it (or --token), and the page then asks for it.
// The workers table; with a column of the batch keys whose state each holds when any holds
// one (a serving with load_key: docs/usage.md, "Many models behind one serving").
function workersTable(workers) {
  const holds = workers.some((w) => w.keys_held_count > 0);
  const held = (w) => w.keys_held.join(", ") +
    (w.keys_held_count > w.keys_held.length ? ` (+${w.keys_held_count - w.keys_held.length} more)` : "");
  return table(
    ["consumer", "host", "pid", "partition", "device", "heartbeat", "batches", "items", "failed",
      ...(holds ? ["keys held"] : [])],
    workers.map((w) => [w.id, w.host, w.pid, w.partition, w.device, ago(w.heartbeat_age_ms),
      w.batches, w.items, w.failures, ...(holds ? [held(w)] : [])]),
    [0, 0, 1, 1, 0, 1, 1, 1, 1, ...(holds ? [0] : [])]);
}

function reading() {
  return tokenInput.value ? { headers: { authorization: `Bearer ${tokenInput.value}` } } : {};
}

// The page of servings shown: the API answers at most `limit` from `offset`, of those whose
// name holds the filter, and says how many there are.
const page = { offset: 0, limit: 100, filter: "" };
const filterInput = document.getElementById("filter");
filterInput.addEventListener("input", () => {
  page.filter = filterInput.value;
  page.offset = 0;
  refresh();
});
document.getElementById("previous").addEventListener("click", () => {
  page.offset = Math.max(0, page.offset - page.limit);
  refresh();
});
document.getElementById("next").addEventListener("click", () => {
  page.offset += page.limit;
  refresh();
});

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : String(c));
  return node;
}

function ago(ms) {
  if (ms < 1000) return `${ms} ms`;
  if (ms < 120000) return `${(ms / 1000).toFixed(1)} s`;
  return `${Math.round(ms / 60000)} min`;
}

function table(headers, rows, numeric) {
  const head = el("tr", {}, ...headers.map((h, i) => el("th", numeric[i] ? { class: "num" } : {}, h)));
  const body = rows.map((r) => el("tr", {}, ...r.map((c, i) => el("td", numeric[i] ? { class: "num" } : {}, c))));
  return el("table", {}, head, ...body);
}

function chart(points, field, label) {
  const w = 300, h = 60;
  const values = points.map((p) => p[field]).filter((v) => v !== null);
  const top = Math.max(1, ...values);
  const step = points.length > 1 ? w / (points.length - 1) : w;
  const path = points
    .map((p, i) => (p[field] === null ? null : `${(i * step).toFixed(1)},${(h - (p[field] / top) * (h - 4)).toFixed(1)}`))
    .filter((p) => p !== null)
    .join(" ");
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("width", w);
  svg.setAttribute("height", h);
  svg.innerHTML = `<polyline fill="none" stroke="#2f6fdb" stroke-width="1.5" points="${path}"/>`;
  const span = points.length > 1 ? points[points.length - 1].at - points[0].at : 0;
  const last = span < 120 ? `${Math.round(span)} s` : `${Math.round(span / 60)} min`;
  return el("div", {}, el("h3", {}, `${label} (last ${last}, max ${top.toFixed(1)})`), svg);
}

async function change(path, body) {
  const response = await fetch(path, {
    method: "POST",
    headers: { "content-type": "application/json", authorization: `Bearer ${tokenInput.value}` },
    body: JSON.stringify(body),
  });
  const answer = await response.json();
  setStatus(response.ok ? `${path.split("/").pop()}: done` : answer.error.message, !response.ok);
  refresh();
  return response.ok;
}

function setStatus(text, error) {
  const status = document.getElementById("status");
  status.textContent = text;
  status.className = error ? "error" : "";
}

const deadLetters = {};  // serving -> last list read

async function readDeadLetters(name) {
  const response = await fetch(`api/dead-letters/${encodeURIComponent(name)}`, reading());
  if (response.ok) deadLetters[name] = (await response.json()).dead_letters;
}

// A status in words and colour (health.py holds the rules; docs/operations.md says them).
function badge(h) {
  const st = (h && h.status) || { status: "unknown", level: "idle", reasons: [] };
  return el("span", { class: `badge ${st.level}`, title: st.reasons.join("; ") }, st.status);
}

function ms(value) {
  if (value === null || value === undefined) return "–";
  return value < 1000 ? `${value.toFixed(value < 10 ? 2 : 0)} ms` : `${(value / 1000).toFixed(2)} s`;
}

function percent(value) {
  return value === null || value === undefined ? "–" : `${(value * 100).toFixed(value < 0.1 ? 1 : 0)}%`;
}

function oldestOf(s) {
  return s.priorities.reduce((n, p) => Math.max(n, p.age_ms), 0);
}

function aliveOf(s) {
  return s.workers.filter((w) => w.heartbeat_age_ms <= 10000).length;
}

// The summary's columns: title, class, value to sort by, text shown
const LEVEL_ORDER = { bad: 0, warn: 1, ok: 2, idle: 3 };
const COLUMNS = [
  ["serving", "name", (s) => s.name, (s) => el("a", { href: `#serving-${encodeURIComponent(s.name)}` }, s.name)],
  ["status", "status", (s) => LEVEL_ORDER[s.health.status?.level] ?? 4, (s) => badge(s.health)],
  ["items/s", "items-per-s", (s) => s.health.items_per_s ?? -1, (s) => s.health.items_per_s === null || s.health.items_per_s === undefined ? "–" : s.health.items_per_s.toFixed(1)],
  ["error rate", "error-rate", (s) => s.health.error_rate ?? -1, (s) => percent(s.health.error_rate)],
  ["queue p50", "queue-p50", (s) => s.health.queue_p50_ms ?? -1, (s) => ms(s.health.queue_p50_ms)],
  ["queue p99", "queue-p99", (s) => s.health.queue_p99_ms ?? -1, (s) => ms(s.health.queue_p99_ms)],
  ["end-to-end p99", "end-to-end-p99", (s) => s.health.end_to_end_p99_ms ?? -1, (s) => ms(s.health.end_to_end_p99_ms)],
  ["oldest waiting", "oldest", oldestOf, (s) => ago(oldestOf(s))],
  ["workers", "workers", aliveOf, aliveOf],
  ["dead letters", "dead", (s) => s.dead_letters, (s) => s.dead_letters],
];
const sorting = { column: 1, descending: false };  // worst status first

function summary(servings) {
  const [, , key] = COLUMNS[sorting.column];
  const rows = [...servings].sort((a, b) => {
    const x = key(a), y = key(b);
    const order = x < y ? -1 : x > y ? 1 : a.name < b.name ? -1 : a.name > b.name ? 1 : 0;
    return sorting.descending ? -order : order;
  });
  const head = el("tr", {}, ...COLUMNS.map(([title, cls], i) => el("th", {
    class: `${cls} sortable${i === sorting.column ? (sorting.descending ? " down" : " up") : ""}`,
    "data-column": i,
    onclick: () => {
      sorting.descending = sorting.column === i ? !sorting.descending : i >= 2;
      sorting.column = i;
      redraw();
    },
  }, title)));
  const body = rows.map((s) => el("tr", { "data-serving": s.name },
    ...COLUMNS.map(([, cls, , show]) => el("td", { class: cls }, show(s)))));
  return el("table", { id: "summary" }, head, ...body);
}

// Options as a table: those that differ from their defaults (or were set at run time)
// first, then the others, each by name.
function optionsTable(s, defaults) {
  const rows = Object.entries(s.options).map(([k, v]) => {
    const set = s.overrides[k] !== undefined;
    const differs = set || (k in defaults && defaults[k] !== v);
    return { k, v, set, differs, d: k in defaults ? defaults[k] : "" };
  }).sort((a, b) => (b.differs - a.differs) || (a.k < b.k ? -1 : 1));
  const head = el("tr", {}, el("th", {}, "option"), el("th", {}, "value"), el("th", {}, "default"), el("th", {}, ""));
  return el("table", { class: "options" }, head, ...rows.map((r) => el("tr", r.differs ? { class: "differs" } : {},
    el("td", {}, r.k), el("td", {}, r.v), el("td", {}, r.d),
    el("td", {}, r.set ? "set at run time" : r.differs ? "differs" : ""))));
}

function servingSection(s, defaults) {
  const h = s.health || {};
  const items = s.workers.reduce((n, w) => n + w.items, 0);
  const queued = s.priorities.reduce((n, p) => n + p.items, 0);
  const figure = (cls, value, label) => el("div", { class: `figure ${cls}` }, el("b", {}, value), el("span", {}, label));
  const config = el("input", { class: "config", placeholder: "batch_size=64 batch_timeout=5ms", size: 32 });
  const configure = el("button", { class: "config-set", onclick: () =>
    change("api/config", { serving: s.name, assignments: config.value.split(/\s+/).filter(Boolean) }) }, "config set");
  const letters = (deadLetters[s.name] || []).map((d) => [
    d.id, d.reason, d.deliveries, ago(Math.max(0, Date.now() - d.at_ms)),
    el("span", {},
      el("button", { class: "replay", "data-id": d.id, onclick: () => change("api/dead-letters/replay", { serving: s.name, id: d.id }) }, "replay"),
      " ",
      el("button", { class: "drop", "data-id": d.id, onclick: () => change("api/dead-letters/drop", { serving: s.name, id: d.id }) }, "drop")),
  ]);
  const counts = s.queue_counts || {};
  const queuesTitle = counts.keys_with_work === undefined ? "queues by key and priority" :
    `queues by key and priority: ${counts.streams_shown} streams shown, of the ` +
    `${counts.keys_with_work} keys with work the 10 with the most items (ranked among ` +
    `${counts.ranked_by_items}) and the streams waiting longest; ${counts.streams_waiting} ` +
    `streams waiting, ${counts.streams_pending} read, ${counts.known_keys} keys known`;
  const listed = s.listed_age_ms > 10000 && !s.workers.length ?
    el("p", { class: "stale" }, `no worker has declared or served it for ${ago(s.listed_age_ms)}`) : "";
  const reasons = h.status ? el("p", { class: `reasons ${h.status.level}` }, h.status.reasons.join("; ")) : "";
  return el("section", { class: "serving", "data-serving": s.name, id: `serving-${encodeURIComponent(s.name)}` },
    el("h2", {}, s.name, " ", badge(h)),
    s.error ? el("p", { class: "error" }, s.error) : "",
    listed,
    reasons,
    el("div", { class: "figures" },
      figure("throughput", h.items_per_s === null || h.items_per_s === undefined ? "–" : h.items_per_s.toFixed(1), "items/s (its own)"),
      figure("error-rate", percent(h.error_rate), `error rate (last ${h.window_s || 0} s)`),
      figure("queue-p99", ms(h.queue_p99_ms), "queue time p99"),
      figure("end-to-end-p99", ms(h.end_to_end_p99_ms), "end to end p99"),
      figure("items-run", items, "items run (alive workers)"),
      figure("queued", queued, "items queued"),
      figure("oldest", ago(oldestOf(s)), "oldest waiting"),
      figure("dead", s.dead_letters, "dead letters")),
    el("div", { class: "grid" },
      chart(s.history, "items_per_s", "items/s"),
      chart(s.history, "queue_p99_ms", "queue time p99, ms"),
      chart(s.history, "error_rate", "error rate"),
      chart(s.history, "batch_size", "batch size"),
      el("div", {}, el("h3", {}, "workers"), workersTable(s.workers)),
      el("div", {}, el("h3", {}, "queued by priority"), table(
        ["priority", "items", "oldest"],
        s.priorities.map((p) => [p.priority, p.items, ago(p.age_ms)]),
        [1, 1, 1])),
      el("div", {}, el("h3", { class: "queues-title" }, queuesTitle), table(
        ["key", "priority", "entries", "read, not done", "items of key", "oldest"],
        s.queues.map((q) => [q.key, q.priority, q.entries, q.pending, q.key_items, ago(q.age_ms)]),
        [0, 1, 1, 1, 1, 1])),
      el("div", {}, el("h3", {}, "options (differences from the defaults first)"), optionsTable(s, defaults),
        el("div", {}, config, " ", configure))),
    el("div", { class: "dead-letters" }, el("h3", {}, "dead letters"), table(
      ["id", "reason", "deliveries", "age", ""], letters, [0, 0, 1, 1, 0])));
}

let shown = null;  // the overview drawn last: a click on a column sorts it again at once

function redraw() {
  if (!shown) return;
  document.getElementById("summary-table").replaceChildren(shown.servings.length ? summary(shown.servings) : "");
  document.getElementById("servings").replaceChildren(...shown.servings.map((s) => servingSection(s, shown.defaults || {})));
}

let drawing = null;  // the refresh under way: one at a time, however slow the API is
let again = false;  // asked for while one ran (a change made meanwhile): drawn once it ends

// Redraw now, or right after the refresh under way, never beside it: two at once would
// answer out of order and put an older overview over a newer one.
function refresh() {
  if (drawing) {
    again = true;
    return drawing;
  }
  drawing = (async () => {
    try {
      do {
        again = false;
        await draw();
      } while (again);
    } finally {
      drawing = null;
    }
  })();
  return drawing;
}

// The next poll waits POLL_MS after the last one ended, so slow answers never pile up.
async function poll() {
  await refresh();
  setTimeout(poll, POLL_MS);
}

// What the page holds, said above the servings: none under this prefix (a wrong prefix or
// Redis looks just like that), none matching the filter, or which of how many are shown.
function showNotice(o) {
  const notice = document.getElementById("notice");
  const shown = o.servings.length;
  notice.className = o.total === 0 ? "empty" : "";
  if (o.total === 0) {
    notice.replaceChildren(
      `no serving has been declared under prefix ${o.prefix} on ${o.redis}. Start a worker ` +
        "with this Redis and prefix, ",
      el("code", {}, `queueserve worker myapp.servings:serving --redis-url ${o.redis} --prefix ${o.prefix}`),
      ", or open the dashboard with the --redis-url and --prefix your workers use.");
  } else if (o.matched === 0) {
    notice.replaceChildren(`no serving name under prefix ${o.prefix} holds "${o.filter}" ` +
      `(${o.total} servings in all)`);
  } else if (shown < o.matched || o.filter) {
    notice.replaceChildren(`servings ${o.offset + 1} to ${o.offset + shown} of ${o.matched}` +
      (o.filter ? ` whose name holds "${o.filter}" (${o.total} in all)` : "") +
      (shown < o.matched ? ": filter by name, or page with next and previous" : ""));
  } else {
    notice.replaceChildren(`${o.total} serving${o.total === 1 ? "" : "s"}`);
  }
  document.getElementById("previous").disabled = o.offset === 0;
  document.getElementById("next").disabled = o.offset + shown >= o.matched;
}

async function draw() {
  try {
    const query = `offset=${page.offset}&filter=${encodeURIComponent(page.filter)}`;
    const response = await fetch(`api/overview?${query}`, reading());
    if (response.status === 401 && !tokenInput.value) tokenInput.focus();
    if (!response.ok) throw new Error((await response.json()).error.message);
    const overview = await response.json();
    page.limit = overview.limit;
    if (!overview.servings.length && overview.matched && page.offset) {
      page.offset = 0;  // servings went away under a later page: back to the first
      again = true;
      return;
    }
    showNotice(overview);
    await Promise.all(overview.servings.filter((s) => s.dead_letters > 0 || deadLetters[s.name]?.length)
      .map((s) => readDeadLetters(s.name)));
    document.getElementById("prefix").textContent = `prefix ${overview.prefix}`;
    shown = overview;
    const focused = document.activeElement;
    if (focused && focused.classList.contains("config") && focused.value) return;  // being typed
    redraw();
    if (!document.getElementById("status").classList.contains("error")) {
      setStatus(`updated ${new Date().toLocaleTimeString()}`, false);
    }
  } catch (e) {
    setStatus(`cannot read the dashboard's API: ${e.message}`, true);
  }
}

poll();
