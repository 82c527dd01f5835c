"use strict";
// The console's page. Its state arrives on /events (server-sent events: each verb's last answer,
// beats, plans' progress) and is drawn with DOM nodes and text nodes only: names, errors and logs
// come from machines, and nothing they say is ever read as HTML.

const state = {
  status: null, nodes: null, modules: null, plans: null, audit: null,
  plans_by_id: new Map(), // id -> the `plan` verb's answer
  changes_by_id: new Map(), // id -> machine -> what its step changes in its declaration
  problems: new Map(), // section -> message
  beats: new Map(), // machine -> when its last beat arrived (ms)
  last_seen: new Map(), // machine -> when the controller last heard it (ms), as `nodes` said
  live: false,
};
const log_view = { machine: null, process: null, following: null };
// Who the console acts as, whether it may approve and reject, and the session's write token
// (/api/me); what the last approve or reject of each plan answered.
let me = null;
const acted = new Map(); // plan id -> the controller's answer, in words

const LOG_KEPT = 256 * 1024; // characters of a followed log the page keeps

// --- building nodes -------------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "onclick") node.addEventListener("click", value);
    else node.setAttribute(key, String(value));
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function link(route, ...children) {
  return el("a", { href: "#/" + route.map(encodeURIComponent).join("/") }, ...children);
}

function word(text, cls) {
  return el("span", { class: cls || String(text) }, text);
}

function table(id, headers, rows) {
  return el("table", { id },
    el("thead", {}, el("tr", {}, headers.map((h) => el("th", {}, h)))),
    el("tbody", {}, rows));
}

function short(digest) {
  if (!digest) return "–";
  return digest.startsWith("sha256:") ? digest.slice(7, 19) : digest;
}

function when(iso) {
  if (!iso) return "–";
  const d = new Date(iso);
  return isNaN(d) ? iso : d.toLocaleString();
}

function ago(ms) {
  const s = Math.max(0, Math.round((Date.now() - ms) / 1000));
  return s < 1 ? "just now" : `${s}s ago`;
}

function card(id, title, ...body) {
  return el("section", { class: "card", id }, el("h2", {}, title), ...body);
}

// --- steering (docs/operations.md, Steering a change) ----------------------------------------

const FINAL = new Set(["done", "failed", "reverted", "cancelled", "rejected"]);

// What the operator's hand adds to a plan's state: held (waiting for approval), paused, a
// revert or a cancel in progress, a tier soaking (its time left, counting down), why cancelled.
function steering(p) {
  const notes = [];
  if (p.state === "held") notes.push(` — waiting for approval (mesh plan approve ${p.id})`);
  if (p.state === "paused") notes.push(` — until mesh plan resume ${p.id}`);
  if (p.phase === "revert" && !FINAL.has(p.state)) notes.push(p.cancelled ? " (cancelling)" : " (reverting)");
  if (p.soak && !FINAL.has(p.state)) {
    notes.push(" — ", el("span", { class: "soaking", "data-soak-until": p.soak.until, "data-soak-tier": p.soak.tier },
      soak_text(p.soak.until, p.soak.tier)));
  }
  if (p.cancelled) notes.push(" — ", word(p.cancelled, "cancelled"));
  return notes;
}

// A held plan's review: who asked, the digest an approval binds to, the approvals so far (one
// the catalog made void shown so), and, where the console's operator may, Approve and Reject.
function review(p) {
  if (p.state !== "held" && !acted.has(p.id)) return "";
  const given = (p.approvals || []).map((a) =>
    el("li", { "data-by": a.by }, `${a.by}, `, when(a.at), a.void ? [" — ", word("void: the plan changed since", "error")] : ""));
  const counted = (p.approvals || []).filter((a) => !a.void).length;
  const parts = [el("h3", {}, "Approval")];
  if (p.state === "held") {
    parts.push(
      el("p", {}, "asked by ", el("strong", { id: "plan-author" }, p.by || "?"), ", doing ", el("code", { id: "plan-digest" }, p.digest || "?")),
      el("p", { id: "plan-approvals" }, `${counted} of ${p.approvals_needed || 1} approval(s), by operators other than its author`),
      given.length ? el("ul", { id: "plan-approvers" }, given) : "");
  }
  if (acted.has(p.id)) parts.push(el("p", { id: "plan-acted" }, acted.get(p.id)));
  return parts;
}

async function act(p, action, body) {
  try {
    const response = await fetch(`/api/plan/${p.id}/${action}`, {
      method: "POST", body: JSON.stringify(body),
      headers: { "Content-Type": "application/json", Accept: "application/json", "X-Mesh-Console-Write": me.write_token },
    });
    const answer = await response.json();
    acted.set(p.id, response.ok ? answer.message : `refused: ${answer.error}`);
  } catch (e) {
    acted.set(p.id, `not sent: ${e.message}`);
  }
  asked_plans.delete(p.id); // its approvals, as the controller has them now
  fetch_plan(p.id);
  render();
}

function soak_text(until, tier) {
  const left = Math.max(0, Math.round((Date.parse(until) - Date.now()) / 1000));
  return `tier ${tier} soaking, ${left}s left`;
}

function render_soaks() {
  for (const cell of document.querySelectorAll("[data-soak-until]")) cell.textContent = soak_text(cell.dataset.soakUntil, cell.dataset.soakTier);
}

// --- the views ------------------------------------------------------------------------------

function seat_card() {
  const s = state.status;
  if (!s) return card("seat", "Seat", el("p", { class: "quiet" }, "asking the controller…"));
  const rows = [];
  const add = (name, ...value) => rows.push(el("dt", {}, name), el("dd", { "data-field": name }, ...value));
  if (s.seat) {
    add("holder", el("strong", { id: "holder" }, s.seat.holder), ` pid ${s.seat.pid} on ${s.seat.host}`);
    add("epoch", el("span", { id: "epoch" }, s.seat.epoch));
    add("since", when(s.seat.since));
    add("version", el("code", {}, short(s.seat.version) || "?"));
    for (const w of s.seat.warnings || []) add("warning", word(w, "error"));
  } else {
    add("holder", word("nobody holds the seat", "error"));
  }
  add("standbys", s.standbys.length
    ? s.standbys.map((b, i) => [i ? ", " : "", el("strong", {}, b.instance), ` pid ${b.pid} on ${b.host}`])
    : word("none", "error"));
  const h = s.handover;
  let handover = "none since this holder started";
  if (h && !h.from) handover = `${when(h.at)}: ${h.to} took the seat, which nobody held before`;
  else if (h && h.planned) handover = `${when(h.at)}: ${h.from} handed it to ${h.to} (${h.gap_ms === null ? "?" : h.gap_ms.toFixed(1)} ms without a holder)`;
  else if (h) handover = `${when(h.at)}: ${h.to} took it over from ${h.from} (gone without handing over)`;
  add("last handover", handover);
  add("machines", `${s.nodes.up} up, ${s.nodes.down} down, ${s.nodes.total} in all`);
  add("plan in progress", s.plan ? [link(["plan", s.plan.id], `plan ${s.plan.id}`, ` ${s.plan.trigger} ${s.plan.subject}`), ": ", word(s.plan.state), steering(s.plan)] : "none");
  return card("seat", "Seat", el("dl", {}, rows));
}

function processes_of(node) {
  if (!node.processes.length) return word("none", "quiet");
  return node.processes.map((p) =>
    el("span", { class: "process", "data-process": p.name },
      el("strong", {}, p.name + (p.trial ? " (new version)" : "")), " ",
      word(p.state), " ", word(p.healthy ? "healthy" : "unhealthy"),
      p.pid ? el("span", { class: "quiet" }, ` pid ${p.pid}${use_of(p)}`) : null,
      p.restarts ? el("span", { class: "restarts" }, ` ${p.restarts} restart(s)${p.in_a_row ? `, ${p.in_a_row} in a row` : ""}`) : null,
      p.reason ? el("span", { class: "reason" }, ` (${p.reason})`) : null));
}

// A running process's use: memory and cpu (cores, over the last few seconds); "" from a host
// of a mesh before process limits, which does not say.
function use_of(p) {
  if (p.memory === undefined || p.memory === null || !p.pid) return "";
  return `, ${bytes(p.memory)}, ${(p.cpu || 0).toFixed(2)} cpu`;
}

function bytes(n) {
  for (const [unit, size] of [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]]) {
    if (n >= size) return `${(n / size).toFixed(1)} ${unit}`;
  }
  return `${n} B`;
}

function declaration_of(node) {
  if (!node.digest_wanted) return word("none", "quiet");
  if (node.drained && node.digest_wanted !== node.digest_applied) {
    // drained: what it has stays; what the catalog composes waits for `mesh undrain`
    return [el("code", {}, short(node.digest_applied)), " (wants ", el("code", {}, short(node.digest_wanted)), ") ", word("held by the drain", "drained")];
  }
  if (node.digest_wanted === node.digest_applied) return [el("code", {}, short(node.digest_applied)), " applied"];
  return [el("code", {}, short(node.digest_applied)), " → ", el("code", {}, short(node.digest_wanted)), " ", word("applying", "applying")];
}

function drained_of(node) {
  // `mesh drain`: every plan skips the machine; it keeps what it runs until `mesh undrain`
  return node.drained ? word("drained", "drained") : word("in plans", "quiet");
}

function beat_text(name) {
  // Until a beat arrives on this page (a machine that is down sends none), the controller's
  // word on when it last heard the machine.
  const at = state.beats.get(name) ?? state.last_seen.get(name);
  return at === undefined ? "–" : ago(at);
}

function machines_card() {
  if (!state.nodes) return card("machines-card", "Machines", el("p", { class: "quiet" }, "asking the controller…"));
  const rows = state.nodes.nodes.map((n) =>
    el("tr", { "data-machine": n.name },
      el("td", { class: "name" }, link(["machine", n.name], n.name)),
      el("td", { class: "tier" }, n.tier),
      el("td", { class: "state" }, word(n.up ? "up" : "down")),
      el("td", { class: "drain" }, drained_of(n)),
      el("td", { class: "beat", "data-beat": n.name }, beat_text(n.name)),
      el("td", { class: "processes" }, n.up ? null : el("span", { class: "quiet" }, "as last reported: "), processes_of(n)),
      el("td", { class: "declaration" }, declaration_of(n)),
      el("td", { class: "apply-error" }, n.apply_error ? word(n.apply_error, "error") : ""),
      el("td", { class: "version" }, el("code", {}, n.version === null ? "?" : short(n.version)))));
  return card("machines-card", "Machines",
    table("machines", ["machine", "tier", "", "plans", "last beat", "processes", "declaration", "apply error", "mesh version"], rows));
}

function modules_card() {
  if (!state.modules) return card("modules-card", "Modules", el("p", { class: "quiet" }, "asking the controller…"));
  if (!state.modules.modules.length) return card("modules-card", "Modules", el("p", { class: "quiet" }, "no module pushed yet"));
  const rows = state.modules.modules.map((m) =>
    el("tr", { "data-module": m.name },
      el("td", {}, el("strong", {}, m.name)),
      el("td", {}, el("code", {}, m.version)),
      el("td", {}, when(m.pushed_at), el("span", { class: "quiet" }, m.pushed_by ? ` by ${m.pushed_by}` : "")),
      el("td", { class: "assigned" }, m.assigned.length ? m.assigned.map((a, i) => [i ? ", " : "", link(["machine", a], a)]) : word("nowhere", "quiet")),
      el("td", {}, m.processes.join(", ")),
      el("td", {}, m.containers.join(", "))));
  return card("modules-card", "Modules",
    table("modules", ["module", "version", "pushed", "assigned to", "processes", "containers"], rows));
}

function plans_card() {
  if (!state.plans) return card("plans-card", "Plans", el("p", { class: "quiet" }, "asking the controller…"));
  if (!state.plans.plans.length) return card("plans-card", "Plans", el("p", { class: "quiet" }, "no plan yet"));
  const rows = state.plans.plans.map((p) =>
    el("tr", { "data-plan": p.id },
      el("td", {}, link(["plan", p.id], `plan ${p.id}`)),
      el("td", { class: "state" }, word(p.state), steering(p)),
      el("td", {}, `${p.trigger} ${p.subject}`),
      el("td", {}, p.by),
      el("td", {}, `${p.done}/${p.machines}`),
      el("td", {}, p.tier === null || p.tier === undefined ? "–" : `tier ${p.tier}`),
      el("td", {}, when(p.created)),
      el("td", {}, p.failure ? word(p.failure, "error") : "")));
  return card("plans-card", "Plans",
    table("plans", ["plan", "state", "change", "by", "done", "rolling", "created", "failure"], rows));
}

function audit_card() {
  // who changed what, as the mesh verified it (docs/security.md): the newest entries
  if (!state.audit) return card("audit-card", "Audit", el("p", { class: "quiet" }, "asking the controller…"));
  if (!state.audit.entries.length) return card("audit-card", "Audit", el("p", { class: "quiet" }, "no change asked yet"));
  const rows = state.audit.entries.map((e) =>
    el("tr", { "data-entry": e.id },
      el("td", {}, when(e.at)),
      el("td", { class: "who" }, e.who),
      el("td", {}, e.verb),
      el("td", {}, e.subject),
      el("td", { class: "state" }, e.outcome === "ok" ? word("ok", "done") : word(e.outcome, "error")),
      el("td", { class: "quiet" }, e.detail)));
  return card("audit-card", "Audit",
    table("audit", ["at", "who", "verb", "subject", "outcome", "detail"], rows));
}

function plan_card(id) {
  const p = state.plans_by_id.get(id);
  if (!p) return card("plan", `Plan ${id}`, el("p", { class: "quiet" }, "asking the controller…"));
  const tiers = p.tiers.map((t) =>
    el("tr", { "data-tier": t.tier },
      el("td", {}, `tier ${t.tier}`),
      el("td", { class: "state" }, word(t.state)),
      el("td", { class: "count" }, `${t.done}/${t.total}`)));
  const steps = p.steps.map((s) =>
    el("tr", { "data-machine": s.machine, "data-tier": s.tier },
      el("td", {}, link(["machine", s.machine], s.machine)),
      el("td", {}, s.tier),
      el("td", { class: "state" }, word(s.state), s.reverted ? " (reverted)" : ""),
      el("td", {}, el("code", {}, short(s.before)), " → ", el("code", {}, short(s.after))),
      el("td", {}, when(s.started)),
      el("td", {}, when(s.finished)),
      el("td", { class: "error" }, s.error || "")));
  return card("plan", `Plan ${p.id}`,
    el("p", { id: "plan-summary" },
      el("strong", {}, `${p.trigger} ${p.subject}`), ` by ${p.by || "?"}: `, word(p.state),
      steering(p),
      p.failure ? [" — ", word(p.failure, "error")] : ""),
    p.note ? el("p", { id: "plan-note" }, "note: ", p.note) : "",
    review(p),
    el("h3", {}, "Tiers"),
    p.tiers.length ? table("plan-tiers", ["tier", "state", "done"], tiers) : el("p", { class: "quiet" }, "no steps yet"),
    el("h3", {}, "Steps"),
    p.steps.length ? table("plan-steps", ["machine", "tier", "state", "declaration", "started", "finished", "error"], steps) : "",
    plan_changes(p.id));
}

// What each step changes in its machine's declaration (secrets are never in one): what an
// approver of a held plan reads, with nothing but its id.
function plan_changes(id) {
  const changes = state.changes_by_id.get(id);
  if (!changes) return "";
  const said = (c) => `${c.op} ${c.kind} ${c.name}` +
    (c.op === "~" ? ` (${Object.entries(c.fields).map(([k, [a, b]]) => `${k}: ${JSON.stringify(a)} → ${JSON.stringify(b)}`).join("; ")})` : "");
  const items = [...changes].filter(([, list]) => list.length).map(([machine, list]) =>
    el("li", { "data-machine": machine }, el("strong", {}, machine), ": ", list.map(said).join(", ")));
  return [el("h3", {}, "Changes"),
    items.length ? el("ul", { id: "plan-changes" }, items) : el("p", { class: "quiet" }, "no declaration changes")];
}

function shown_plan() {
  // the plan in progress, else the newest one
  if (state.status && state.status.plan) return state.status.plan.id;
  if (state.plans && state.plans.plans.length) return state.plans.plans[0].id;
  return null;
}

function overview() {
  const id = shown_plan();
  if (id !== null) fetch_plan(id);
  return [seat_card(), machines_card(), id === null ? null : plan_card(id), plans_card(), modules_card(), audit_card()];
}

function machine_view(name) {
  const back = el("p", {}, link([], "← the fleet"));
  const node = state.nodes && state.nodes.nodes.find((n) => n.name === name);
  if (!node) return [back, card("machine", name, el("p", { class: "quiet" }, state.nodes ? "no such machine" : "asking the controller…"))];
  const f = node.facts;
  const rows = [];
  const add = (label, ...value) => rows.push(el("dt", {}, label), el("dd", { "data-field": label }, ...value));
  add("state", word(node.up ? "up" : "down"), " (last seen ", when(node.last_seen), ")");
  add("last beat", el("span", { "data-beat": node.name }, beat_text(node.name)));
  add("tier", node.tier);
  add("plans", drained_of(node));
  add("labels", Object.entries(node.labels).map(([k, v]) => `${k}=${v}`).join(", ") || "none");
  add("declaration", declaration_of(node));
  if (node.apply_error) add("apply error", word(node.apply_error, "error"));
  add("mesh version", el("code", {}, node.version === null ? "?" : short(node.version)));
  if (f) {
    add("machine", `${f.os} ${f.arch}, ${f.cpus} cpus, ${(f.memory / 2 ** 30).toFixed(1)} GiB, ${f.hostname}`);
    add("python", f.python || "?");
    add("container engine", f.container_engine || "none");
    if (f.limits) add("limits", `${f.limits.join(", ") || "none"}${f.cgroups ? ` (cgroup ${f.cgroups})` : ""}`);
  }
  const procs = node.processes.map((p) =>
    el("tr", { "data-process": p.name },
      el("td", {}, el("strong", {}, p.name + (p.trial ? " (new version)" : ""))),
      el("td", { class: "state" }, word(p.state)),
      el("td", { class: "health" }, word(p.healthy ? "healthy" : "unhealthy")),
      el("td", {}, p.pid || "–"),
      el("td", { class: "memory" }, p.pid && p.memory !== undefined && p.memory !== null ? bytes(p.memory) : "–"),
      el("td", { class: "cpu" }, p.pid && p.cpu !== undefined && p.cpu !== null ? p.cpu.toFixed(2) : "–"),
      el("td", { class: "restarts" }, `${p.restarts || 0}` + (p.in_a_row ? ` (${p.in_a_row} in a row)` : "")),
      el("td", { class: "since" }, p.since ? when(p.since) : "–"),
      el("td", { class: "reason" }, [p.reason || "", p.said ? ` — last said: ${p.said}` : "", p.check ? ` check: ${p.check}` : ""]),
      el("td", {}, el("button", { type: "button", "data-log": p.name, onclick: () => open_log(name, p.name) }, "log"))));
  return [back, card("machine", `Machine ${node.name}`, el("dl", {}, rows)),
    card("machine-processes", "Processes",
      procs.length ? table("processes", ["process", "state", "health", "pid", "memory", "cpu", "restarts", "running since", "why", ""], procs) : el("p", { class: "quiet" }, "none"))];
}

function plan_view(id) {
  fetch_plan(id);
  return [el("p", {}, link([], "← the fleet")), plan_card(id)];
}

// --- drawing ------------------------------------------------------------------------------

function route() {
  const parts = location.hash.replace(/^#\/?/, "").split("/").filter(Boolean).map(decodeURIComponent);
  return parts;
}

function render() {
  const [kind, arg] = route();
  let content;
  if (kind === "machine" && arg) content = machine_view(arg);
  else if (kind === "plan" && /^\d+$/.test(arg || "")) content = plan_view(Number(arg));
  else content = overview();
  document.getElementById("view").replaceChildren(...content.flat().filter(Boolean));
  // Approve and Reject live outside the view (drawn anew at each event), so what an operator
  // types as a reject's reason is never lost to a redraw; shown on a held plan's page alone.
  const held = kind === "plan" && state.plans_by_id.get(Number(arg));
  document.getElementById("steer").hidden = !(held && held.state === "held" && me && me.steers);
  document.getElementById("approve").textContent = `Approve as ${(me && me.operator) || "this console"}`;
  const logs = document.getElementById("log");
  logs.hidden = !(kind === "machine" && log_view.machine === arg && log_view.process);
  if (logs.hidden) log_view.following = null; // left the machine's page: stop following
  const problems = [...state.problems].map(([section, message]) => el("li", { "data-section": section }, `${section}: ${message}`));
  document.getElementById("problems").replaceChildren(...problems);
  const conn = document.getElementById("connection");
  conn.dataset.live = String(state.live);
  conn.textContent = state.live ? "live" : "reconnecting…";
}

function render_beats() {
  for (const cell of document.querySelectorAll("[data-beat]")) cell.textContent = beat_text(cell.dataset.beat);
}

// --- what the server says ---------------------------------------------------------------------

async function fetch_json(path) {
  const response = await fetch(path, { headers: { Accept: "application/json" } });
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || `${response.status}`);
  return body;
}

const asked_plans = new Set(); // asked once; then its `plan` events keep it current

async function fetch_plan(id) {
  if (asked_plans.has(id)) return; // asked even when its events came first: for its changes
  asked_plans.add(id);
  try {
    const plan = await fetch_json(`/api/plan/${id}`);
    state.changes_by_id.set(id, new Map(plan.steps.map((s) => [s.machine, s.changes || []])));
    // A `plan` event that came while this was asked is as new or newer: an answer that was
    // slower to arrive must not put an older state back (nothing may come after it to fix it).
    if (!state.plans_by_id.has(id) || acted.has(id)) state.plans_by_id.set(id, plan);
    state.problems.delete("plan");
  } catch (e) {
    asked_plans.delete(id); // asked again at the next event
    state.problems.set("plan", e.message);
  }
  render();
}

function log_path(machine, process) {
  return `/api/logs/${encodeURIComponent(machine)}/${encodeURIComponent(process)}`;
}

async function open_log(machine, process) {
  const token = {}; // this reading; another one (or leaving the page) ends its following
  Object.assign(log_view, { machine, process, following: token });
  const text = document.getElementById("log-text");
  const note = document.getElementById("log-note");
  document.getElementById("log-title").textContent = `Log of ${process} on ${machine}`;
  note.textContent = "reading…";
  render();
  let offset;
  try {
    const reply = await fetch_json(log_path(machine, process));
    text.textContent = reply.data;
    offset = reply.offset;
  } catch (e) {
    text.textContent = "";
    note.textContent = e.message;
    return;
  }
  // Then follow it, as `mesh logs -f` does: each read waits at the host until there is more.
  note.textContent = `its last 64 KiB, then what comes, as it comes (since ${new Date().toLocaleTimeString()})`;
  while (log_view.following === token) {
    try {
      const more = await fetch_json(`${log_path(machine, process)}?offset=${offset}&wait=20`);
      if (log_view.following !== token) return;
      if (more.data) text.textContent = (text.textContent + more.data).slice(-LOG_KEPT);
      offset = more.offset;
    } catch (e) {
      if (log_view.following === token) note.textContent = `stopped following: ${e.message}`;
      return;
    }
  }
}

function listen() {
  const events = new EventSource("/events");
  const on = (name, handle) => events.addEventListener(name, (e) => { handle(JSON.parse(e.data)); render(); });
  on("status", (s) => { state.status = s; });
  on("nodes", (n) => {
    state.nodes = n;
    state.last_seen = new Map(n.nodes.filter((m) => m.last_seen).map((m) => [m.name, Date.parse(m.last_seen)]));
  });
  on("modules", (m) => { state.modules = m; });
  on("audit", (a) => { state.audit = a; });
  on("plans", (p) => { state.plans = p; });
  on("plan", (p) => { state.plans_by_id.set(p.id, p); });
  on("progress", (summary) => {
    // the plans list moves at once; the plan's tiers and steps follow in its `plan` event
    if (!state.plans) return;
    const others = state.plans.plans.filter((p) => p.id !== summary.id);
    state.plans = { plans: [summary, ...others].sort((a, b) => b.id - a.id) };
  });
  on("problem", ({ section, message }) => {
    if (message === null) state.problems.delete(section);
    else state.problems.set(section, message);
  });
  on("ready", () => { state.live = true; });
  events.addEventListener("beat", (e) => {
    state.beats.set(JSON.parse(e.data).name, Date.now());
    render_beats();
  });
  events.onerror = () => {
    state.live = false; // EventSource connects again by itself, unless it was refused
    if (events.readyState === EventSource.CLOSED) {
      // 401: the console started again since (a new token), or the cookie is gone
      state.problems.set("console", "it asks who you are: open the URL it printed (…/?token=…)");
    }
    render();
  };
}

window.addEventListener("hashchange", render);
document.addEventListener("DOMContentLoaded", () => {
  const shown = () => state.plans_by_id.get(Number(route()[1]));
  document.getElementById("approve").addEventListener("click", () => act(shown(), "approve", { digest: shown().digest }));
  document.getElementById("reject").addEventListener("click", () =>
    act(shown(), "reject", { reason: document.getElementById("reject-reason").value }));
  document.getElementById("log-refresh").addEventListener("click", () => {
    if (log_view.machine && log_view.process) open_log(log_view.machine, log_view.process);
  });
  listen();
  fetch_json("/api/me").then((m) => { me = m; render(); }, (e) => state.problems.set("console", e.message));
  render();
  setInterval(() => { render_beats(); render_soaks(); }, 1000);
});
