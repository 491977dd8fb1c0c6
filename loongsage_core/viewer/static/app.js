// LoongSage run viewer: overview curves (uPlot), a step's trajectories, routing; one trajectory's
// tokens are trajectory.js's.
// Reads the JSON API of loongsage_core/viewer/server.py and polls it to follow live runs.
"use strict";

const POLL_MS = 2000;
const RUN_COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"];
const PHASE_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"];
const DASHES = [[], [6, 4], [2, 3], [10, 3, 2, 3]];
const STEP_INCRS = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000, 10000, 20000, 50000];
const CHARTS = [
  {title: "Reward (mean)", keys: ["rollout/reward_mean"]},
  {title: "Train-inference gap: train/is_approx_k3_kl", keys: ["train/is_approx_k3_kl"], log: true},
  {title: "Response length (mean tokens)", keys: ["rollout/response_length_mean"]},
  {title: "Staleness (policy versions)", keys: ["rollout/staleness_mean", "rollout/staleness_max"]},
  {title: "Loss", keys: ["train/loss", "train/pg_loss"]},
  {title: "Timing per phase (s)", phases: true,
   keys: ["timing/rollout", "timing/old_logprobs", "timing/train", "timing/update_weights", "timing/wait"]},
];

const state = {
  runs: [], metrics: {}, charts: [], chartKey: "",
  view: "overview", step: {run: 0, step: null, rows: [], problem: null}, traj: null,
};

// ---------------------------------------------------------------- helpers

function $(id) { return document.getElementById(id); }

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) {
    if (c === null || c === undefined) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

function fill(node, ...children) {
  // replaceChildren without the null placeholders of optional parts
  node.replaceChildren(...children.filter(c => c !== null && c !== undefined));
}

function fmt(v, digits = 4) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  if (Number.isInteger(v)) return String(v);
  const a = Math.abs(v);
  return (a !== 0 && (a < 1e-3 || a >= 1e5)) ? v.toExponential(2) : v.toFixed(digits).replace(/\.?0+$/, "");
}

async function getJSON(url) {
  const r = await fetch(url, {cache: "no-store"});
  if (!r.ok) throw new Error(`${url}: ${r.status} ${await r.text()}`);
  return r.json();
}

function runColour(i) { return RUN_COLOURS[i % RUN_COLOURS.length]; }

// ---------------------------------------------------------------- runs and metrics (polled)

async function poll() {
  try {
    const data = await getJSON("/api/runs");
    const before = JSON.stringify(state.runs.map(r => r.record_steps));
    state.runs = data.runs;
    let changed = false;
    for (const run of state.runs) {
      const have = state.metrics[run.id] || [];
      if (run.metrics_steps < have.length) {  // the run was resumed: earlier steps are redone
        state.metrics[run.id] = (await getJSON(`/api/runs/${run.id}/metrics`)).rows;
        changed = true;
      } else if (run.metrics_steps > have.length) {
        const since = have.length ? have[have.length - 1].step + 1 : 0;
        const rows = (await getJSON(`/api/runs/${run.id}/metrics?since=${since}`)).rows;
        state.metrics[run.id] = have.concat(rows);
        changed = true;
      }
    }
    renderRuns();
    if (changed) renderCharts();
    if (JSON.stringify(state.runs.map(r => r.record_steps)) !== before) fillStepSelect();
    const live = state.runs.filter(r => !r.finished).length;
    $("live").textContent = (live ? `following ${live} live run${live > 1 ? "s" : ""}` : "all runs finished")
      + ` · updated ${new Date().toLocaleTimeString()}`;
  } catch (err) {
    $("live").textContent = `viewer server unreachable (${err.message}); retrying`;
  }
  setTimeout(poll, POLL_MS);
}

function renderRuns() {
  const box = $("runs");
  box.replaceChildren(...state.runs.map(run => {
    const steps = run.total_steps ? `${run.metrics_steps}/${run.total_steps} steps` : `${run.metrics_steps} steps`;
    return el("span", {class: "run-chip", title: run.path},
      el("span", {class: "swatch", style: `background:${runColour(run.id)}`}),
      el("b", {text: run.name}),
      el("span", {class: "muted", text: `${steps} · ${run.record_steps.length} with records · ` +
                                        (run.finished ? "finished" : "live")}));
  }));
}

// ---------------------------------------------------------------- overview charts (uPlot)

function chartData(spec) {
  // x: the union of the runs' steps; one series per (run, key) that has any value
  const steps = new Set();
  const series = [];
  state.runs.forEach(run => {
    const rows = state.metrics[run.id] || [];
    spec.keys.forEach((key, k) => {
      if (!rows.some(r => typeof r[key] === "number")) return;
      series.push({run, key, k, byStep: new Map(rows.map(r => [r.step, r[key]]))});
      rows.forEach(r => steps.add(r.step));
    });
  });
  const xs = [...steps].sort((a, b) => a - b);
  const data = [xs, ...series.map(s => xs.map(x => (typeof s.byStep.get(x) === "number" ? s.byStep.get(x) : null)))];
  return {series, data};
}

function flatRange(u, min, max) {
  // a flat curve (a gap of exactly 0, a constant reward) gets an axis around its value
  if (min === max) { const pad = Math.abs(min) * 0.5 || 0.5; return [min - pad, max + pad]; }
  return uPlot.rangeNum(min, max, 0.1, true);
}

function renderCharts() {
  const box = $("charts");
  const built = CHARTS.map(spec => ({spec, ...chartData(spec)}));
  const key = JSON.stringify(built.map(b => b.series.map(s => [s.run.id, s.key])));
  if (key === state.chartKey && state.charts.length) {
    built.forEach((b, i) => { if (state.charts[i]) state.charts[i].setData(b.data); });
    return;
  }
  state.charts.forEach(c => c && c.destroy());
  state.charts = [];
  state.chartKey = key;
  box.replaceChildren();
  for (const b of built) {
    const card = el("div", {class: "chart", "data-title": b.spec.title}, el("h3", {text: b.spec.title}));
    box.append(card);
    if (!b.series.length) {
      card.append(el("div", {class: "empty muted", text: "not in these runs' metrics" +
        (b.spec.keys[0].includes("staleness") ? " (synchronous runs train on fresh samples: staleness 0)" : "")}));
      state.charts.push(null);
      continue;
    }
    const many = state.runs.length > 1;
    // a log axis where every value is positive (the k3 gap spans orders of magnitude), else linear
    const values = b.data.slice(1).flat().filter(v => v !== null);
    const log = b.spec.log && values.length && values.every(v => v > 0);
    const opts = {
      width: Math.max(300, card.clientWidth - 12), height: 220,
      scales: {x: {time: false}, y: log ? {distr: 3} : {range: flatRange}},
      axes: [{label: "step", incrs: STEP_INCRS, values: (u, splits) => splits.map(v => fmt(v))},
             {size: 70, values: (u, splits) => splits.map(v => fmt(v, 3))}],
      series: [{label: "step"}, ...b.series.map(s => ({
        label: (many ? `${s.run.name} ` : "") + s.key.split("/").pop(),
        stroke: b.spec.phases ? PHASE_COLOURS[s.k % PHASE_COLOURS.length] : runColour(s.run.id),
        dash: b.spec.phases ? DASHES[s.run.id % DASHES.length] : DASHES[s.k % DASHES.length],
        width: 2, spanGaps: true, points: {show: b.data[0].length < 60},
        value: (u, v) => fmt(v),
      }))],
      hooks: {ready: [u => u.over.addEventListener("click", () => {
        const idx = u.cursor.idx;
        if (idx !== null && idx !== undefined) openStep(state.step.run, u.data[0][idx]);
      })]},
    };
    state.charts.push(new uPlot(opts, b.data, card));
  }
}

window.addEventListener("resize", () => {
  state.charts.forEach(c => c && c.setSize({width: Math.max(300, c.root.parentNode.clientWidth - 12), height: 220}));
});

// ---------------------------------------------------------------- a step's trajectories

function fillStepSelect() {
  const runSel = $("step-run");
  const current = state.step.run;
  runSel.replaceChildren(...state.runs.map(r => el("option", {value: r.id, text: r.name})));
  runSel.value = String(current);
  const run = state.runs[current];
  const sel = $("step-step");
  const steps = run ? [...run.record_steps].reverse() : [];
  sel.replaceChildren(...steps.map(s => el("option", {value: s, text: `step ${s}`})));
  if (state.step.step !== null && steps.includes(state.step.step)) sel.value = String(state.step.step);
}

async function openStep(run, step) {
  location.hash = `#/step/${run}/${step}`;
}

async function loadStep(run, step) {
  state.step.run = run;
  const info = state.runs[run];
  if (step === null || step === undefined || Number.isNaN(step)) {
    step = info && info.record_steps.length ? info.record_steps[info.record_steps.length - 1] : null;
  }
  state.step.step = step;
  fillStepSelect();
  const problem = $("step-problem");
  if (step === null) {
    state.step.rows = [];
    problem.hidden = false;
    problem.textContent = "This run has no rollout records yet (they appear once its first step is written).";
    renderTable();
    return;
  }
  if (info && !info.record_steps.includes(step)) {
    state.step.rows = [];
    problem.hidden = false;
    problem.textContent = `Step ${step} has no rollout records (yet, or run.rollout_records = 0).`;
    renderTable();
    return;
  }
  const data = await getJSON(`/api/runs/${run}/steps/${step}`);
  state.step.rows = data.rows;
  problem.hidden = !data.problem;
  problem.textContent = data.problem ? `Shown in part: ${data.problem}` : "";
  const sources = [...new Set(data.rows.map(r => r.source))].sort();
  const srcSel = $("step-source");
  const keep = srcSel.value;
  srcSel.replaceChildren(el("option", {value: "", text: "all"}), ...sources.map(s => el("option", {value: s, text: s})));
  srcSel.value = sources.includes(keep) ? keep : "";
  renderTable();
}

function renderTable() {
  const source = $("step-source").value, status = $("step-status").value;
  const query = $("step-search").value.trim().toLowerCase();
  const sort = $("step-sort").value;
  let rows = state.step.rows.filter(r => (!source || r.source === source) && (!status || r.status === status) &&
    (!query || `${r.id} ${r.response_text} ${r.error || ""} ${r.reason}`.toLowerCase().includes(query)));
  const desc = sort.startsWith("-"), key = sort.replace(/^-/, "");
  rows = rows.slice().sort((a, b) => {
    const x = a[key] ?? -Infinity, y = b[key] ?? -Infinity;
    const order = x < y ? -1 : x > y ? 1 : 0;
    return order ? (desc ? -order : order) : a.index - b.index;
  });
  $("step-count").textContent = `${rows.length} of ${state.step.rows.length} trajectories`;
  const {run, step} = state.step;
  $("traj-table").tBodies[0].replaceChildren(...rows.map(r => el("tr",
    {"data-index": r.index, onclick: () => { location.hash = `#/traj/${run}/${step}/${r.index}`; }},
    el("td", {text: r.index}), el("td", {text: r.source}), el("td", {text: r.agent || ""}),
    el("td", {class: `status-${r.status}`, text: r.status, title: r.error || ""}),
    el("td", {text: fmt(r.reward)}), el("td", {text: r.reason}),
    el("td", {text: r.response_length}), el("td", {text: r.turns}), el("td", {text: r.tool_calls}),
    el("td", {text: fmt(r.staleness)}),
    el("td", {text: r.trained ? "yes" : r.filtered ? "no (group filtered)" : "no"}),
    el("td", {class: "response", text: r.response_text, title: r.response_text}))));
}

for (const id of ["step-source", "step-status", "step-sort"]) $(id).addEventListener("change", renderTable);
$("step-search").addEventListener("input", renderTable);
$("step-run").addEventListener("change", e => openStep(Number(e.target.value), NaN));
$("step-step").addEventListener("change", e => openStep(state.step.run, Number(e.target.value)));

// ---------------------------------------------------------------- routing

async function route() {
  const parts = location.hash.replace(/^#\/?/, "").split("/");
  const view = ["overview", "step", "traj"].includes(parts[0]) ? parts[0] : "overview";
  state.view = view;
  for (const v of ["overview", "step", "traj"]) $(`view-${v}`).hidden = v !== view;
  document.querySelectorAll("header nav a").forEach(a => a.classList.toggle("active", a.dataset.view === view));
  const run = parts[1] !== undefined && parts[1] !== "" ? Number(parts[1]) : state.step.run;
  const step = parts[2] !== undefined ? Number(parts[2]) : state.step.step;
  if (view === "overview") renderCharts();
  else if (view === "step") await loadStep(run, step);
  else if (parts[3] !== undefined) await loadTrajectory(run, step, Number(parts[3]));
  else if (state.traj) renderTrajectory();
}

window.addEventListener("hashchange", () => { route().catch(err => console.warn(err)); });
$("traj-colour").addEventListener("change", renderTokens);

(async function main() {
  await poll();
  await route();
})();
