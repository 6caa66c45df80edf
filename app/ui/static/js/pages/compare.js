// Comparison of 2–5 runs: their reward curves overlaid on one chart, and their settings
// side by side (every field flattened to a dotted path), the rows that differ marked.

import * as api from "../api.js";
import { align, Chart, PALETTE } from "../charts.js";
import { fmtTime, h, put, statusBadge } from "../dom.js";

const MAX = 5;
// What a run was asked to do; the rest of a run (status, timestamps, progress) is not config.
const CONFIG_FIELDS = [
  "model_name", "trained_model_name", "learning_key", "task_description", "system_prompt",
  "rollouts_per_group", "learning_rate", "num_epochs", "max_steps", "num_examples",
  "dataset_id", "reward", "grpo", "generator", "environment", "sft", "config",
];

export async function mount(root, params) {
  let alive = true;
  const ids = (params.get("runs") || "").split(",").map((s) => s.trim()).filter(Boolean);
  const picker = h("div", { class: "picker card", id: "picker" });
  const chartBox = h("div", { id: "compare-chart" });
  const table = h("div", { id: "compare-config" });
  const onlyDiff = h("input", { type: "checkbox", id: "only-differences" });
  root.append(
    h("div", { class: "toolbar" }, h("h1", {}, "Compare runs")),
    picker,
    chartBox,
    h("section", { class: "card" }, h("h2", {}, "Settings ", h("label", { class: "muted" }, onlyDiff, " only differences")), table),
  );

  // Recent runs to pick from; runs named in the URL come first.
  const recent = await api.get("/runs", { limit: 50 });
  const picked = new Set(ids.slice(0, MAX));
  const form = h("form", { id: "pick-runs" });
  const known = new Map(recent.data.map((r) => [r.id, r]));
  const runs = [];
  for (const id of picked) {
    runs.push(known.get(id) || (await api.get(`/runs/${id}`)));
  }
  for (const r of runs) known.set(r.id, r);
  for (const r of [...runs, ...recent.data.filter((r) => !picked.has(r.id))]) {
    form.append(
      h(
        "label",
        { class: "pick" },
        h("input", { type: "checkbox", name: "run", value: r.id, checked: picked.has(r.id) }),
        " ",
        statusBadge(r.status),
        ` ${r.trained_model_name || r.id.slice(0, 8)} `,
        h("small", { class: "muted" }, fmtTime(r.created_at)),
      ),
    );
  }
  const go = h("button", { type: "submit" }, "Compare");
  const hint = h("span", { class: "muted" }, " pick 2 to 5 runs");
  form.append(h("div", {}, go, hint));
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const chosen = [...form.querySelectorAll("input[name=run]:checked")].map((i) => i.value);
    if (chosen.length < 2 || chosen.length > MAX) {
      hint.textContent = ` pick 2 to 5 runs (${chosen.length} picked)`;
      hint.classList.add("error");
      return;
    }
    window.trainyard.navigate(`/ui/compare?runs=${chosen.join(",")}`);
  });
  picker.append(form);

  let chart = null;
  if (runs.length >= 2) {
    const series = await Promise.all(runs.map((r) => api.metrics(r.id, { name: "reward_mean" })));
    if (!alive) return { destroy() {} };
    chart = new Chart(
      "compare:reward",
      "Reward mean by step",
      runs.map((r, i) => ({ label: label(r), color: PALETTE[i % PALETTE.length], width: 2 })),
      { height: 280, spanGaps: true },
    );
    chartBox.append(chart.el);
    chart.resize();
    chart.setData(align(series.map((m) => m.reward_mean || { steps: [], values: [] })));
    renderTable(runs);
  } else {
    chartBox.append(h("p", { class: "muted" }, "Pick at least two runs."));
  }

  function renderTable(list) {
    const flat = list.map((r) => flatten(Object.fromEntries(CONFIG_FIELDS.map((f) => [f, r[f]]))));
    const keys = [...new Set(flat.flatMap((f) => Object.keys(f)))].sort(byField);
    const body = h("tbody");
    let differing = 0;
    for (const key of keys) {
      const values = flat.map((f) => (key in f ? JSON.stringify(f[key]) : undefined));
      const differs = new Set(values).size > 1;
      if (differs) differing += 1;
      body.append(
        h(
          "tr",
          { class: differs ? "differs" : "same", "data-key": key },
          h("th", { class: "mono" }, key),
          values.map((v) => h("td", { class: "mono" }, v === undefined ? "—" : short(v))),
        ),
      );
    }
    put(table, 
      h("p", { class: "muted", id: "differences" }, `${differing} of ${keys.length} settings differ.`),
      h(
        "table",
        { class: "config" },
        h("thead", {}, h("tr", {}, h("th", {}, "setting"), list.map((r, i) => h("th", { class: `run-${i}` }, h("a", { href: `/ui/runs/${r.id}`, "data-link": true }, label(r)))))),
        body,
      ),
    );
  }
  onlyDiff.addEventListener("change", () => table.classList.toggle("only-differences", onlyDiff.checked));

  return {
    destroy() {
      alive = false;
      chart?.destroy();
    },
  };
}

function label(r) {
  return `${r.trained_model_name || "run"} ${r.id.slice(0, 8)}`;
}

function short(text) {
  return text.length > 200 ? `${text.slice(0, 200)}…` : text;
}

/** {a: {b: 1}, c: [1]} → {"a.b": 1, "c": [1]}: objects flatten, lists stay one value. */
export function flatten(value, prefix = "", out = {}) {
  if (value && typeof value === "object" && !Array.isArray(value)) {
    const entries = Object.entries(value);
    if (!entries.length && prefix) out[prefix] = {};
    for (const [k, v] of entries) flatten(v, prefix ? `${prefix}.${k}` : k, out);
  } else if (prefix) {
    out[prefix] = value;
  }
  return out;
}

function byField(a, b) {
  const ia = CONFIG_FIELDS.indexOf(a.split(".")[0]);
  const ib = CONFIG_FIELDS.indexOf(b.split(".")[0]);
  return ia - ib || a.localeCompare(b);
}
