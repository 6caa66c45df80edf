// Trajectory viewer: one group of one step side by side, its rollouts as columns, each with
// its reward, its group-relative advantage (grpo.js, the run's scale_rewards) and what
// scored it: each reward function's value, RULER's explanation, RIM's verdict per judge and
// per sample. Agent episodes show their turns, each tool call and its result collapsible;
// a gateway episode also its calls (policy version, latency, trained and masked tokens).
//
// The whole step is read (every group: scale_rewards "batch" needs the step's rewards);
// the reward filter then picks the groups with a rollout in range and dims the others, so
// an advantage is always the one the trainer used, never one of a filtered subset.

import * as api from "../api.js";
import { clear, details, fmtNumber, h, json } from "../dom.js";
import { advantages } from "../grpo.js";

export async function mount(root, runId, params) {
  let alive = true;
  const run = await api.get(`/runs/${runId}`);
  const scale = run.grpo?.scale_rewards || "group";
  const state = {
    step: intOr(params.get("step"), Math.max(1, run.step)),
    group: intOr(params.get("group"), null),
    minReward: floatOr(params.get("min_reward")),
    maxReward: floatOr(params.get("max_reward")),
  };

  const stepInput = h("input", { type: "number", min: 0, id: "step", value: state.step });
  const minInput = h("input", { type: "number", step: "any", id: "min-reward", placeholder: "min", value: state.minReward ?? "" });
  const maxInput = h("input", { type: "number", step: "any", id: "max-reward", placeholder: "max", value: state.maxReward ?? "" });
  const prev = h("button", { type: "button", id: "prev-step" }, "←");
  const next = h("button", { type: "button", id: "next-step" }, "→");
  const form = h(
    "form",
    { class: "filters", id: "viewer-filters" },
    h("label", {}, "step ", prev, stepInput, next),
    h("label", {}, "reward ", minInput, " to ", maxInput),
    h("button", { type: "submit" }, "Show"),
  );
  const groupsBar = h("div", { class: "groups", id: "groups" });
  const prompt = h("div", { id: "prompt" });
  const grid = h("div", { class: "rollouts", id: "rollouts" });
  const note = h("p", { class: "muted", id: "viewer-note" });
  root.append(
    h(
      "div",
      { class: "toolbar" },
      h("h1", {}, h("a", { href: `/ui/runs/${runId}`, "data-link": true }, run.trained_model_name || `Run ${runId.slice(0, 8)}`), " · trajectories"),
      form,
    ),
    h(
      "p",
      { class: "muted" },
      `Advantage = (reward − group mean) / (${scale === "batch" ? "std of the step's rewards" : "std of the group"} + 1e-4)`,
      scale === "none" ? " — scale_rewards none: reward − group mean, unscaled." : ` — scale_rewards "${scale}", sample std (n − 1), as TRL computes it.`,
    ),
    groupsBar,
    note,
    prompt,
    grid,
  );

  let rows = [];

  async function load() {
    rows = await api.all(`/runs/${runId}/trajectories`, { step: state.step });
    if (!alive) return;
    show();
  }

  function inRange(reward) {
    if (state.minReward === null && state.maxReward === null) return true;
    if (reward === null) return false;
    if (state.minReward !== null && reward < state.minReward) return false;
    if (state.maxReward !== null && reward > state.maxReward) return false;
    return true;
  }

  function show() {
    const byGroup = new Map();
    for (const t of rows) {
      if (!byGroup.has(t.group_index)) byGroup.set(t.group_index, []);
      byGroup.get(t.group_index).push(t);
    }
    for (const g of byGroup.values()) g.sort((a, b) => a.rollout_index - b.rollout_index);
    const stepRewards = rows.map((t) => t.reward);
    const visible = [...byGroup.keys()].sort((a, b) => a - b).filter((g) => byGroup.get(g).some((t) => inRange(t.reward)));
    clear(groupsBar);
    clear(prompt);
    clear(grid);
    if (!rows.length) {
      note.textContent = `No trajectories at step ${state.step}.`;
      publish(null, []);
      return;
    }
    if (!visible.length) {
      note.textContent = `No group of step ${state.step} has a rollout with a reward in range.`;
      publish(null, []);
      return;
    }
    if (state.group === null || !visible.includes(state.group)) state.group = visible[0];
    for (const g of visible) {
      const rewards = byGroup.get(g).map((t) => t.reward);
      const finite = rewards.filter((r) => r !== null);
      const mean = finite.length ? finite.reduce((a, b) => a + b, 0) / finite.length : null;
      const b = h(
        "button",
        { type: "button", class: g === state.group ? "group active" : "group", "data-group": String(g) },
        `group ${g}`,
        h("small", {}, ` mean ${fmtNumber(mean)}`),
      );
      b.addEventListener("click", () => {
        state.group = g;
        sync();
        show();
      });
      groupsBar.append(b);
    }
    const group = byGroup.get(state.group);
    const adv = advantages(group.map((t) => t.reward), scale, stepRewards);
    note.textContent = `Step ${state.step}, group ${state.group}: ${group.length} rollouts; ${byGroup.size} groups in this step.`;
    const first = group[0].messages || [];
    const cut = firstModelTurn(first);
    prompt.append(
      details(
        `prompt (${cut} message${cut === 1 ? "" : "s"})`,
        h("div", { class: "messages" }, first.slice(0, cut).map((m) => message(m))),
        { cls: "prompt card" },
      ),
    );
    group.forEach((t, i) => {
      grid.append(column(t, adv[i], inRange(t.reward)));
    });
    publish(state.group, group.map((t, i) => ({ id: t.id, rollout_index: t.rollout_index, reward: t.reward, advantage: adv[i] })));
  }

  function publish(group, rollouts) {
    window.trainyard.viewer = { step: state.step, group, scale, rollouts };
  }

  function sync() {
    const q = new URLSearchParams();
    q.set("step", String(state.step));
    if (state.group !== null) q.set("group", String(state.group));
    if (state.minReward !== null) q.set("min_reward", String(state.minReward));
    if (state.maxReward !== null) q.set("max_reward", String(state.maxReward));
    history.replaceState(null, "", `${location.pathname}?${q}`);
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const step = intOr(stepInput.value, state.step);
    state.minReward = floatOr(minInput.value);
    state.maxReward = floatOr(maxInput.value);
    const reload = step !== state.step;
    state.step = step;
    sync();
    if (reload) load().catch(window.trainyard.showError);
    else show();
  });
  for (const [button, delta] of [[prev, -1], [next, 1]]) {
    button.addEventListener("click", () => {
      state.step = Math.max(0, state.step + delta);
      stepInput.value = String(state.step);
      state.group = null;
      sync();
      load().catch(window.trainyard.showError);
    });
  }

  await load();
  return {
    destroy() {
      alive = false;
      delete window.trainyard.viewer;
    },
  };
}

function intOr(value, fallback) {
  const n = Number.parseInt(value ?? "", 10);
  return Number.isFinite(n) ? n : fallback;
}

function floatOr(value) {
  if (value === null || value === undefined || value === "") return null;
  const n = Number(value);
  return Number.isFinite(n) ? n : null;
}

/** Index of the first message the model wrote: everything before is the prompt. */
function firstModelTurn(messages) {
  const i = messages.findIndex((m) => m.role === "assistant");
  return i === -1 ? messages.length : i;
}

function column(t, advantage, inRange) {
  const messages = t.messages || [];
  const response = messages.slice(firstModelTurn(messages));
  const toolCalls = t.metadata?.tool_calls;
  return h(
    "article",
    { class: inRange ? "rollout card" : "rollout card filtered-out", "data-rollout": String(t.rollout_index), "data-trajectory": t.id },
    h(
      "header",
      {},
      h("h3", {}, `rollout ${t.rollout_index}`),
      h(
        "dl",
        { class: "scores" },
        h("dt", {}, "reward"),
        h("dd", { class: "reward" }, t.reward === null ? "dropped" : fmtNumber(t.reward)),
        h("dt", {}, "advantage"),
        h("dd", { class: advantage >= 0 ? "advantage pos" : "advantage neg" }, fmtNumber(advantage)),
        toolCalls !== undefined ? [h("dt", {}, "tool calls"), h("dd", {}, String(toolCalls))] : null,
      ),
    ),
    episodePanel(t.metadata || {}),
    h("div", { class: "messages" }, response.map((m) => message(m))),
    breakdown(t.reward_breakdown),
    t.metadata && Object.keys(t.metadata).length ? details("metadata", json(t.metadata)) : null,
  );
}

/** A gateway episode: its calls (read when opened), each with the policy version that
 * answered it, its latency and its tokens: the completion trained on, the tokens its prompt
 * added after the previous call (tool results, user turns) masked out of the loss. */
function episodePanel(m) {
  if (!m.episode_id) return null;
  const body = h("div", { class: "episode-calls" }, h("p", { class: "muted" }, "loading its calls…"));
  const panel = details(
    [
      h("span", { class: "role" }, "episode"),
      ` ${m.calls} call${m.calls === 1 ? "" : "s"} · policy v${m.policy_version ?? "–"} · `,
      h("span", { class: "trained" }, `${m.trained_tokens} trained`),
      " / ",
      h("span", { class: "masked" }, `${m.masked_tokens} masked`),
      " tokens",
      m.sequence === "split"
        ? h("span", { class: "tag", title: "the harness edited its history: each chain of calls trained as a sample of its own" }, `split: ${m.chains} samples`)
        : null,
    ],
    body,
    { cls: "episode" },
  );
  panel.dataset.episode = m.episode_id;
  panel.addEventListener("toggle", async () => {
    if (!panel.open || panel.dataset.loaded) return;
    panel.dataset.loaded = "1";
    const episode = await api.get(`/episodes/${m.episode_id}`);
    clear(body);
    body.append(callsTable(episode));
  });
  return panel;
}

function callsTable(episode) {
  let before = null; // the previous call's prompt + completion tokens (of the same claim)
  const rows = episode.call_log.map((c) => {
    const fresh = before === null || c.seq === 1 ? c.prompt_tokens : c.prompt_tokens - before;
    before = c.prompt_tokens + c.completion_tokens;
    return h(
      "tr",
      {},
      h("td", { class: "num" }, `${c.issue}.${c.seq}`),
      h("td", { class: "num" }, `v${c.policy_version}`),
      h("td", { class: "num masked" }, c.seq === 1 ? `${c.prompt_tokens} prompt` : `+${fresh}`),
      h("td", { class: "num trained" }, String(c.completion_tokens)),
      h("td", { class: "num" }, `${fmtNumber(c.latency_ms, 1)} ms`),
      h("td", {}, c.response?.finish_reason ?? ""),
    );
  });
  return h(
    "table",
    { class: "small calls" },
    h(
      "thead",
      {},
      h("tr", {}, ["call", "policy", "masked", "trained", "latency", "finish"].map((x) => h("th", {}, x))),
    ),
    h("tbody", {}, rows),
  );
}

function message(m) {
  const role = m.role || "?";
  if (role === "tool") {
    const failed = Boolean(m.error);
    return details(
      [
        h("span", { class: "role" }, "tool result"),
        ` ${m.name || ""}`,
        failed ? h("span", { class: "tag bad" }, "error") : h("span", { class: "tag" }, "ok"),
        m.duration_ms !== undefined ? h("small", {}, ` ${fmtNumber(m.duration_ms, 1)} ms`) : null,
      ],
      h(
        "div",
        {},
        m.tool_call_id ? h("p", { class: "muted mono" }, `call ${m.tool_call_id}`) : null,
        failed ? h("pre", { class: "error" }, String(m.error)) : null,
        h("pre", { class: "content" }, contentText(m.content)),
      ),
      { cls: failed ? "msg tool-result failed" : "msg tool-result" },
    );
  }
  return h(
    "div",
    { class: `msg role-${role}` },
    h("span", { class: "role" }, role),
    m.content ? h("pre", { class: "content" }, contentText(m.content)) : null,
    (m.tool_calls || []).map((call) => {
      const fn = call.function || {};
      const args = typeof fn.arguments === "string" ? fn.arguments : JSON.stringify(fn.arguments);
      return details(
        [h("span", { class: "role" }, "tool call"), ` ${fn.name || "?"}(`, h("code", {}, short(args, 60)), ")"],
        h("div", {}, call.id ? h("p", { class: "muted mono" }, `id ${call.id}`) : null, h("pre", { class: "content" }, pretty(fn.arguments))),
        { cls: "tool-call" },
      );
    }),
  );
}

function contentText(content) {
  if (typeof content === "string") return content;
  if (Array.isArray(content)) return content.map((p) => (typeof p === "string" ? p : p.text ?? JSON.stringify(p))).join("");
  return JSON.stringify(content, null, 2);
}

function pretty(args) {
  if (typeof args !== "string") return JSON.stringify(args, null, 2);
  try {
    return JSON.stringify(JSON.parse(args), null, 2);
  } catch {
    return args;
  }
}

function short(text, n) {
  const s = String(text ?? "");
  return s.length > n ? `${s.slice(0, n)}…` : s;
}

/** What scored the rollout, as the workers store it (workers/rewards). */
function breakdown(b) {
  if (!b) return null;
  const parts = [];
  if (b.functions) {
    parts.push(
      h(
        "table",
        { class: "small functions" },
        h("tbody", {}, Object.entries(b.functions).map(([name, value]) => h("tr", {}, h("td", {}, name), h("td", { class: "num" }, fmtNumber(value))))),
      ),
    );
  }
  if (b.ruler) {
    const r = b.ruler;
    parts.push(
      h(
        "div",
        { class: "judge ruler" },
        h("h4", {}, "RULER", r.judge ? h("small", {}, ` ${r.judge}`) : null, r.score !== undefined ? h("span", { class: "score" }, fmtNumber(r.score)) : null),
        r.dropped ? h("p", { class: "error" }, `dropped: ${r.error}`) : h("p", { class: "explanation" }, r.explanation || ""),
      ),
    );
  }
  if (b.rim) parts.push(rim(b.rim));
  for (const [key, value] of Object.entries(b)) {
    if (!["functions", "ruler", "rim"].includes(key)) parts.push(details(key, json(value)));
  }
  return h("section", { class: "breakdown" }, h("h4", { class: "label" }, "scored by"), parts);
}

function rim(r) {
  const judges = Object.entries(r.judges || {});
  return h(
    "div",
    { class: "judge rim" },
    h("h4", {}, "RIM", r.score !== undefined ? h("span", { class: "score" }, fmtNumber(r.score)) : null),
    r.dropped ? h("p", { class: "error" }, `dropped: ${r.error}`) : null,
    r.mean !== undefined && r.mean !== r.score ? h("p", { class: "muted" }, `mean of judges ${fmtNumber(r.mean)}`) : null,
    (r.anomalies || []).length ? h("p", { class: "error" }, `anomalies: ${r.anomalies.join(", ")}`) : null,
    (r.rules_fired || []).length
      ? h("ul", { class: "rules" }, r.rules_fired.map((f) => h("li", {}, `${f.rule}${f.judge ? ` (${f.judge})` : ""}: ${fmtNumber(f.before)} → ${fmtNumber(f.after)}`)))
      : null,
    (r.excluded || []).length ? h("p", { class: "muted" }, `excluded: ${r.excluded.join(", ")}`) : null,
    judges.map(([name, v]) =>
      details(
        [
          h("span", { class: "judge-name" }, name),
          ` ${fmtNumber(v.score)}`,
          v.escalation ? h("span", { class: "tag" }, v.escalation) : null,
          (r.judges_used || []).includes(name) ? null : h("span", { class: "tag bad" }, "not used"),
        ],
        h(
          "div",
          { class: "verdict" },
          h("p", { class: "muted" }, `uncertainty ${fmtNumber(v.uncertainty)} · spread ${fmtNumber(v.spread)}`, flagsText(v.flags)),
          // The samples carry their own rationales; the verdict's are the large model's
          // when the judge was escalated.
          v.escalation === "escalated" ? (v.rationales || []).map((text) => h("p", { class: "explanation" }, text)) : null,
          h(
            "ol",
            { class: "samples" },
            (v.samples || []).map((s) => sample(s)),
            v.large ? sample(v.large, "large") : null,
          ),
        ),
        { cls: "rim-judge", open: true },
      ),
    ),
  );
}

function flagsText(flags) {
  const raised = Object.entries(flags || {}).filter(([, on]) => on).map(([f]) => f);
  return raised.length ? ` · flags: ${raised.join(", ")}` : "";
}

function sample(s, label = "") {
  return h(
    "li",
    { class: "sample" },
    h("span", { class: "mono" }, `${label ? `${label} ` : ""}${s.model} @ T=${s.temperature}`),
    s.error ? h("span", { class: "error" }, ` failed: ${s.error}`) : [` score ${fmtNumber(s.score)}, uncertainty ${fmtNumber(s.uncertainty)}`, flagsText(s.flags)],
    s.rationale ? h("p", { class: "explanation" }, s.rationale) : null,
  );
}
