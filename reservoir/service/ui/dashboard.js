// The reservoir dashboard: polls this service's /v1/activity and /v1/nodes and draws them
// with plain DOM and SVG (no library, nothing fetched from elsewhere). Built to stay
// readable with a thousand nodes: a heatmap per tier (one small cell per node and resource
// class), and a filtered, sorted, paged table of bars.
"use strict";

const ACTIVITY_EVERY_MS = 2000;
const NODES_EVERY_MS = 5000;
const PAGE_SIZE = 25;
const CELL = 11; // heatmap cell, px (with a 2 px gap)
const SVG = "http://www.w3.org/2000/svg";

const state = { nodes: [], page: 0, filter: "", sort: "util", nodesError: null, activityError: null };

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value; else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child);
  return node;
}

function svg(tag, attrs = {}) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, String(value));
  return node;
}

function ms(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  return seconds < 1 ? `${(seconds * 1000).toFixed(1)} ms` : `${seconds.toFixed(2)} s`;
}

function percent(fraction) { return `${Math.round(fraction * 100)}%`; }

// white-blue for an empty class through deep blue to red for a full one
function heat(fraction) {
  const f = Math.max(0, Math.min(1, fraction));
  if (f < 0.75) {
    const t = f / 0.75;
    const c = (a, b) => Math.round(a + (b - a) * t);
    return `rgb(${c(232, 42)},${c(240, 111)},${c(252, 219)})`;
  }
  const t = (f - 0.75) / 0.25;
  const c = (a, b) => Math.round(a + (b - a) * t);
  return `rgb(${c(42, 198)},${c(111, 59)},${c(219, 59)})`;
}

function used(usage) {
  return usage.capacity > 0 ? (usage.used + usage.held) / usage.capacity : 0;
}

async function getJson(path) {
  const response = await fetch(path, { headers: { Accept: "application/json" } });
  if (!response.ok) {
    let detail = response.statusText;
    try { detail = (await response.json()).detail || detail; } catch (_) { /* not JSON */ }
    throw new Error(`${path}: ${response.status} ${detail}`);
  }
  return response.json();
}

function showStatus() {
  const status = document.getElementById("status");
  const problem = state.nodesError || state.activityError;
  status.textContent = problem ? problem : `updated ${new Date().toLocaleTimeString()}`;
  status.classList.toggle("bad", Boolean(problem));
}

// -- activity ------------------------------------------------------------------------------

function drawActivity(a) {
  document.getElementById("rate").textContent = a.placements_per_s.toFixed(2);
  document.getElementById("latency").textContent = `${ms(a.p50_s)} · ${ms(a.p99_s)}`;
  document.getElementById("window").textContent = `(${Math.round(a.reaches_s / 60 * 10) / 10} of ${a.window_s / 60} min)`;
  document.getElementById("bucket").textContent = `${a.bucket_s} s`;
  drawRateChart(a.placed_per_bucket, a.bucket_s);

  const failures = document.querySelector("#failures tbody");
  failures.replaceChildren();
  const reasons = Object.entries(a.failures);
  if (reasons.length === 0) failures.append(el("tr", {}, el("td", { class: "empty" }, "none")));
  for (const [reason, count] of reasons) {
    failures.append(el("tr", {}, el("td", { class: "bad" }, reason), el("td", { class: "num" }, String(count))));
  }

  const recent = document.querySelector("#recent tbody");
  recent.replaceChildren();
  if (a.recent.length === 0) recent.append(el("tr", {}, el("td", { colspan: "6", class: "empty" }, "none yet")));
  for (const r of a.recent) {
    const placed = r.result === "placed";
    recent.append(el("tr", { "data-request-id": r.request_id },
      el("td", {}, el("code", {}, r.request_id || "–")),
      el("td", { class: placed ? "" : "bad" }, placed ? (r.partial ? "placed (partial)" : "placed") : r.result),
      el("td", { class: "placed-on" }, r.nodes.join(", ") || "–"),
      el("td", { class: "num" }, String(r.instances)),
      el("td", { class: "num" }, ms(r.elapsed_s)),
      el("td", { class: "num" }, `${Math.round(r.age_s)} s`)));
  }
}

function drawRateChart(counts, bucketS) {
  const chart = document.getElementById("rate-chart");
  chart.replaceChildren();
  const width = 600, height = 120, top = 14, bottom = 16;
  const most = Math.max(1, ...counts);
  const step = width / counts.length;
  counts.forEach((count, i) => {
    const h = (count / most) * (height - top - bottom);
    const bar = svg("rect", { x: i * step + 1, y: height - bottom - h, width: Math.max(1, step - 2), height: h, fill: "#2a6fdb" });
    bar.append(svg("title"));
    bar.firstChild.textContent = `${count} placed in ${bucketS} s`;
    chart.append(bar);
  });
  const label = (x, text, anchor) => {
    const t = svg("text", { x, y: height - 3, "font-size": 10, fill: "#68707f", "text-anchor": anchor });
    t.textContent = text;
    chart.append(t);
  };
  label(2, `-${Math.round(counts.length * bucketS / 60)} min`, "start");
  label(width - 2, "now", "end");
  const peak = svg("text", { x: 2, y: 10, "font-size": 10, fill: "#68707f" });
  peak.textContent = `peak ${most} per ${bucketS} s (${(most / bucketS).toFixed(1)}/s)`;
  chart.append(peak);
}

// -- nodes ---------------------------------------------------------------------------------

function resourceClasses(nodes) {
  const seen = new Set();
  for (const n of nodes) for (const rc of Object.keys(n.usage)) seen.add(rc);
  return [...seen].sort();
}

function drawTiers() {
  const nodes = state.nodes;
  document.getElementById("node-count").textContent = String(nodes.length);
  const mean = nodes.length ? nodes.reduce((s, n) => s + n.utilisation, 0) / nodes.length : 0;
  document.getElementById("cluster-util").textContent = nodes.length ? percent(mean) : "–";

  const tiers = new Map();
  for (const n of nodes) {
    if (!tiers.has(n.tier)) tiers.set(n.tier, []);
    tiers.get(n.tier).push(n);
  }
  const box = document.getElementById("tiers");
  box.replaceChildren(legend());
  if (nodes.length === 0) { box.append(el("p", { class: "empty" }, "no node answered")); return; }
  const available = Math.max(200, box.clientWidth - 140);
  const columns = Math.max(10, Math.floor(available / CELL));
  for (const tier of [...tiers.keys()].sort((a, b) => a - b)) {
    const members = tiers.get(tier).slice().sort((a, b) => a.name.localeCompare(b.name));
    const tierMean = members.reduce((s, n) => s + n.utilisation, 0) / members.length;
    const section = el("div", { class: "tier", "data-tier": String(tier) },
      el("h3", {}, `tier ≤ ${tier}% `, el("small", {}, `${members.length} node${members.length === 1 ? "" : "s"}, mean utilisation ${percent(tierMean)}`)));
    const grid = el("div", { class: "heat" });
    for (const rc of resourceClasses(members)) {
      const rows = Math.ceil(members.length / columns);
      const cols = Math.min(columns, members.length);
      const map = svg("svg", { width: cols * CELL, height: rows * CELL, role: "img", "aria-label": `${rc} by node` });
      members.forEach((n, i) => {
        const usage = n.usage[rc];
        const cell = svg("rect", {
          x: (i % columns) * CELL, y: Math.floor(i / columns) * CELL, width: CELL - 2, height: CELL - 2, rx: 1,
          fill: usage ? heat(used(usage)) : "#edf0f4", "data-node": n.name,
        });
        const title = svg("title");
        title.textContent = usage
          ? `${n.name} ${rc}: ${usage.used} used + ${usage.held} held of ${usage.capacity}`
          : `${n.name}: no ${rc}`;
        cell.append(title);
        map.append(cell);
      });
      grid.append(el("div", { class: "rc" }, rc), map);
    }
    section.append(grid);
    box.append(section);
  }
}

function legend() {
  const box = el("div", { class: "legend" }, "0%");
  const bar = svg("svg", { width: 120, height: 10 });
  for (let i = 0; i < 24; i++) bar.append(svg("rect", { x: i * 5, y: 0, width: 5, height: 10, fill: heat(i / 23) }));
  box.append(bar, "100% taken (used + held)");
  return box;
}

function usageBar(rc, usage) {
  const width = 70;
  const bar = svg("svg", { width, height: 8 });
  const part = (value) => (usage.capacity > 0 ? (value / usage.capacity) * width : 0);
  bar.append(svg("rect", { x: 0, y: 0, width, height: 8, fill: "#edf0f4", rx: 2 }));
  bar.append(svg("rect", { x: 0, y: 0, width: part(usage.used), height: 8, fill: heat(used(usage)), rx: 2 }));
  bar.append(svg("rect", { x: part(usage.used), y: 0, width: part(usage.held), height: 8, fill: "#f0b429" }));
  return el("span", { class: "bar", title: `${usage.used} used + ${usage.held} held of ${usage.capacity}` },
    rc, bar, `${usage.used + usage.held}/${usage.capacity}`);
}

function drawTable() {
  const wanted = state.filter.toLowerCase();
  const rows = state.nodes.filter((n) => n.name.toLowerCase().includes(wanted));
  const by = {
    util: (a, b) => b.utilisation - a.utilisation || a.name.localeCompare(b.name),
    name: (a, b) => a.name.localeCompare(b.name),
    tier: (a, b) => a.tier - b.tier || a.name.localeCompare(b.name),
  }[state.sort];
  rows.sort(by);
  const pages = Math.max(1, Math.ceil(rows.length / PAGE_SIZE));
  state.page = Math.min(state.page, pages - 1);
  const shown = rows.slice(state.page * PAGE_SIZE, (state.page + 1) * PAGE_SIZE);
  document.getElementById("page").textContent = `page ${state.page + 1} of ${pages} (${rows.length} node${rows.length === 1 ? "" : "s"})`;
  const body = document.querySelector("#nodes tbody");
  body.replaceChildren();
  for (const n of shown) {
    const bars = el("div", { class: "bars" });
    for (const rc of Object.keys(n.usage).sort()) bars.append(usageBar(rc, n.usage[rc]));
    body.append(el("tr", { "data-node": n.name },
      el("td", {}, el("code", {}, n.name)), el("td", {}, `${n.tier}%`), el("td", {}, bars),
      el("td", { class: "num" }, String(n.allocations)), el("td", { class: "num" }, String(n.reservations))));
  }
}

// -- polling -------------------------------------------------------------------------------

function every(ms, work) {
  const run = async () => {
    try { await work(); } finally { setTimeout(run, ms); }
  };
  run();
}

every(ACTIVITY_EVERY_MS, async () => {
  try {
    drawActivity(await getJson("../v1/activity"));
    state.activityError = null;
  } catch (error) {
    state.activityError = error.message;
  }
  showStatus();
});

every(NODES_EVERY_MS, async () => {
  try {
    state.nodes = await getJson("../v1/nodes");
    state.nodesError = null;
    drawTiers();
    drawTable();
    document.body.dataset.nodesLoaded = String(state.nodes.length);
  } catch (error) {
    state.nodesError = error.message;
  }
  showStatus();
});

document.getElementById("filter").addEventListener("input", (e) => { state.filter = e.target.value; state.page = 0; drawTable(); });
document.getElementById("sort").addEventListener("change", (e) => { state.sort = e.target.value; drawTable(); });
document.getElementById("prev").addEventListener("click", () => { state.page = Math.max(0, state.page - 1); drawTable(); });
document.getElementById("next").addEventListener("click", () => { state.page += 1; drawTable(); });
window.addEventListener("resize", () => drawTiers());
