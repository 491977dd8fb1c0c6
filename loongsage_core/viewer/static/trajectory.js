// LoongSage run viewer: one trajectory's tokens, coloured by loss mask, advantage or the
// train-inference gap, with its turns and metadata. Loaded before app.js, whose helpers ($, el,
// fill, fmt, getJSON) and state it uses when called.
"use strict";

// ---------------------------------------------------------------- one trajectory

function tokenColour(mode, seg, i, scale) {
  const trained = seg.loss_mask[i] === 1;
  if (mode === "mask") return trained ? "rgba(46,160,67,0.30)" : "";
  if (!trained) return "";
  if (mode === "advantage") {
    const a = seg.advantages ? seg.advantages[i] : null;
    if (a === null || a === undefined) return "";
    if (a === 0 || !scale) return "rgba(140,150,165,0.25)";
    const w = 0.15 + 0.7 * Math.min(1, Math.abs(a) / scale);
    return a > 0 ? `rgba(46,160,67,${w})` : `rgba(215,58,73,${w})`;
  }
  const d = gap(seg, i);  // mode "gap"
  if (d === null) return "";
  const w = Math.max(0.05, Math.min(1, (Math.log10(d + 1e-12) + 8) / 8));  // 1e-8 .. 1 on a log scale
  return `rgba(255,140,0,${w})`;
}

function gap(seg, i) {
  const o = seg.old_logprobs ? seg.old_logprobs[i] : null, r = seg.rollout_logprobs[i];
  return (o === null || o === undefined || r === null) ? null : Math.abs(o - r);
}

const LEGENDS = {
  mask: [["rgba(46,160,67,0.30)", "trained (mask 1)"], ["", "not trained: prompt, tool output (mask 0)"]],
  advantage: [["rgba(46,160,67,0.8)", "positive"], ["rgba(140,150,165,0.25)", "zero"], ["rgba(215,58,73,0.8)", "negative"]],
  gap: [["rgba(255,140,0,0.1)", "|old − rollout| ≤ 1e-7"], ["rgba(255,140,0,0.55)", "1e-4"], ["rgba(255,140,0,1)", "≥ 1"]],
};

// Where each segment sits in the trajectory's tree: its depth (a root is 0) and the line that says
// where it forked (empty for a root). Records written before segments had a parent show every
// segment as a root.
function segmentTree(rec) {
  const tree = ((rec.metadata || {}).agentflow || {}).tree || [];
  const depth = [];
  return rec.segments.map((seg, s) => {
    const root = seg.parent === null || seg.parent === undefined;
    depth.push(root || seg.parent >= s ? 0 : depth[seg.parent] + 1);
    const reason = (tree[s] || {}).reason;
    return {depth: depth[s], forked: root ? "" :
      `forked from segment ${seg.parent} at token ${seg.fork_at}` + (reason ? ` (${reason})` : "")};
  });
}

function renderTokens() {
  const rec = state.traj;
  if (!rec) return;
  const mode = $("traj-colour").value;
  $("traj-legend").replaceChildren(...LEGENDS[mode].flatMap(([c, t]) =>
    [el("span", {class: "legend-box", style: `background:${c || "transparent"}`}), t]));
  const advs = rec.segments.flatMap(s => (s.advantages || []).filter((a, i) => s.loss_mask[i] === 1 && a !== null));
  const scale = advs.length ? Math.max(...advs.map(Math.abs)) : 0;
  const tree = segmentTree(rec);
  $("traj-tokens").replaceChildren(...rec.segments.map((seg, s) => {
    const trained = seg.loss_mask.reduce((a, b) => a + b, 0);
    const shared = seg.fork_at || 0;  // tokens the segment shares with its parent
    const spans = seg.tokens.map((tok, i) => {
      const span = el("span", {class: "tok" + (seg.loss_mask[i] === 1 ? " m1" : "") + (i < shared ? " shared" : ""),
        "data-i": i});
      span.textContent = seg.token_text[i] === "" ? "∅" : seg.token_text[i];
      const bg = tokenColour(mode, seg, i, scale);
      if (bg) span.style.backgroundColor = bg;
      span.addEventListener("mouseenter", () => showToken(seg, i));
      return span;
    });
    const {depth, forked} = tree[s];
    return el("div", {class: "segment", style: `margin-left:${24 * depth}px`, "data-segment": s},
      el("div", {class: "seg-head", text: `segment ${s}` + (forked ? ` · ${forked}` : "") +
        ` · ${seg.tokens.length} tokens, ${trained} trained · ` +
        (seg.row === null ? "not in the training batch" : `batch row ${seg.row}`)}),
      el("div", {class: "tokens"}, ...spans));
  }));
}

function showToken(seg, i) {
  const parts = [`token ${i}: id ${seg.tokens[i]} ${JSON.stringify(seg.token_text[i])}`, `mask ${seg.loss_mask[i]}`,
    `rollout log-prob ${fmt(seg.rollout_logprobs[i], 6)}`];
  if (seg.old_logprobs) parts.push(`old log-prob ${fmt(seg.old_logprobs[i], 6)}`, `|diff| ${fmt(gap(seg, i))}`);
  if (seg.advantages) parts.push(`advantage ${fmt(seg.advantages[i])}`);
  parts.push(`weight version ${seg.weight_versions[i]}`);
  $("token-info").textContent = parts.join(" · ");
}

function kv(pairs) {
  return pairs.flatMap(([k, v]) => [el("div", {class: "k", text: k}), el("div", {}, v)]);
}

function renderTrajectory() {
  const rec = state.traj;
  const {run, step} = state.step;
  fill($("traj-nav"),
    el("a", {href: `#/step/${run}/${step}`, text: `← ${state.runs[run] ? state.runs[run].name : "run"}, step ${step}`}),
    rec.index > 0 ? el("a", {href: `#/traj/${run}/${step}/${rec.index - 1}`, text: "previous"}) : null,
    rec.index + 1 < rec.step_total ? el("a", {href: `#/traj/${run}/${step}/${rec.index + 1}`, text: "next"}) : null);
  const timing = Object.entries(rec.timing || {}).map(([k, v]) => `${k} ${fmt(v, 3)}`).join(", ");
  $("traj-head").replaceChildren(...kv([
    ["trajectory", `${rec.id} (sample ${rec.index} of ${rec.step_total} in step ${rec.step})`],
    ["source / agent", `${rec.source} / ${rec.agent || "?"}`],
    ["status", el("span", {class: `status-${rec.status}`, text: rec.status + (rec.finish_reason ? ` (finish: ${rec.finish_reason})` : "")})],
    ["reward", fmt(rec.reward ? rec.reward.score : null)],
    ["response length", `${rec.response_length} generated tokens, ${rec.turns.length} turns, ${rec.tool_calls.length} tool calls`],
    ["weight versions", rec.weight_versions ? `${rec.weight_versions[0]}..${rec.weight_versions[1]}, trained at ${rec.policy_version}, staleness ${rec.staleness}` : "–"],
    ["trained", rec.trained ? "yes" : rec.filtered ? "no: a filter dropped its group" : "no"],
    ["timing (s)", timing || "–"],
    ["label", JSON.stringify(rec.label)],
  ]));
  const err = $("traj-error");
  err.hidden = !rec.error;
  err.textContent = rec.error ? `Error: ${rec.error}` : "";
  const reward = rec.reward;
  const box = $("traj-reward");
  if (!reward) {
    box.replaceChildren(el("p", {class: "muted", text: "not scored (the agent did not complete)"}));
  } else {
    const comps = Object.entries(reward.components || {});
    fill(box,
      el("p", {}, el("b", {text: `score ${fmt(reward.score)}`}), reward.reason ? ` — ${reward.reason}` : ""),
      comps.length ? el("table", {class: "components"},
        el("thead", {}, el("tr", {}, el("th", {text: "reward"}), el("th", {text: "score"}), el("th", {text: "reason"}),
          el("th", {text: "details"}))),
        el("tbody", {}, ...comps.map(([name, c]) => el("tr", {},
          el("td", {text: name}), el("td", {text: fmt(c.score)}),
          el("td", {class: c.error ? "status-failed" : "", text: c.error || c.reason || ""}),
          el("td", {text: Object.entries(c.details || {}).map(([k, v]) => `${k}=${fmt(v)}`).join(", ")}))))) : null);
  }
  renderTokens();
  $("traj-turns").replaceChildren(...(rec.turns.length ? rec.turns.map((t, k) => el("div", {class: "turn"},
    el("b", {text: `turn ${k}`}), el("span", {class: "muted", text: ` · segment ${t.segment}, tokens ${t.start}–${t.end}`}),
    t.prompt_text ? el("details", {}, el("summary", {text: `what the model read (${t.prompt_text.length} characters)`}),
      el("pre", {text: t.prompt_text})) : null,
    el("pre", {class: "response-text", text: t.response_text}),
    ...t.tool_calls.map(c => el("div", {class: "call"},
      el("div", {}, el("b", {text: `tool call ${c.name}`}), el("code", {text: ` ${c.arguments || ""}`})),
      el("div", {class: "muted", text: "output (sandbox / tool)"}),
      el("pre", {class: "tool-output", text: c.output === null ? "(no output returned)" : String(c.output)})))))
    : [el("p", {class: "muted", text: "no model turns were recorded"})]));
  $("traj-messages").replaceChildren(...(rec.messages || []).map(m => el("details", {},
    el("summary", {text: `${m.role}${m.tool_calls ? ` (${m.tool_calls.length} tool calls)` : ""}: ` +
      contentSummary(m.content).slice(0, 120)}),
    ...messageBody(m, rec.images || {}))));
}

// A message's content as the page shows it: text as text; a list of parts one by one, each image
// the record stores (``{"type": "image", "sha256"}``) drawn inline from the record's ``images``.
function contentSummary(content) {
  if (!Array.isArray(content)) return String(content ?? "");
  return content.map(p => p && p.type === "image" ? "[image]" : (p && p.text) || "").join("");
}

function messageBody(m, images) {
  if (!Array.isArray(m.content)) {
    return [el("pre", {text: typeof m.content === "string" ? m.content : JSON.stringify(m, null, 1)})];
  }
  return m.content.map(p => {
    if (p && p.type === "image" && images[p.sha256]) {
      return el("figure", {class: "msg-image"},
        el("img", {src: `data:${imageMime(images[p.sha256])};base64,${images[p.sha256]}`, alt: `image ${p.sha256}`}),
        el("figcaption", {class: "muted", text: `image ${p.sha256.slice(0, 12)}`}));
    }
    return el("pre", {text: p && typeof p.text === "string" ? p.text : JSON.stringify(p, null, 1)});
  });
}

// The MIME type of base64 image bytes, from their first bytes (PNG, JPEG, GIF, WEBP, BMP).
function imageMime(b64) {
  const kinds = [["iVBOR", "image/png"], ["/9j/", "image/jpeg"], ["R0lG", "image/gif"], ["UklG", "image/webp"],
    ["Qk", "image/bmp"]];
  const hit = kinds.find(([prefix]) => b64.startsWith(prefix));
  return hit ? hit[1] : "application/octet-stream";
}

async function loadTrajectory(run, step, index) {
  state.step.run = run;
  if (state.step.step !== step || !state.step.rows.length) await loadStep(run, step);
  try {
    state.traj = await getJSON(`/api/runs/${run}/steps/${step}/${index}`);
  } catch (err) {
    $("traj-error").hidden = false;
    $("traj-error").textContent = String(err.message);
    return;
  }
  renderTrajectory();
}
