// Runs list: status, model, learning key, step/total, reward sparkline, created; filters
// (status, model, learning key) and cursor paging (next_cursor; back through the cursors
// already seen). Tick 2–5 runs to compare them.

import * as api from "../api.js";
import { clear, fmtTime, h, sparkline, statusBadge } from "../dom.js";

const STATUSES = [
  "pending", "generating", "warming_up", "collecting", "scoring",
  "training", "paused", "completed", "failed", "cancelled",
];
const PAGE = 25;

export async function mount(root, params) {
  const filters = {
    status: params.get("status") || "",
    model_name: params.get("model_name") || "",
    learning_key: params.get("learning_key") || "",
  };
  const cursors = [null]; // cursors[i]: the `after` of page i
  let pageIndex = 0;
  const picked = new Set();
  let alive = true;

  const status = h(
    "select",
    { name: "status", id: "filter-status" },
    h("option", { value: "" }, "any status"),
    STATUSES.map((s) => h("option", { value: s, selected: s === filters.status }, s)),
  );
  const model = h("input", {
    name: "model_name",
    id: "filter-model",
    placeholder: "model",
    value: filters.model_name,
  });
  const learningKey = h("input", {
    name: "learning_key",
    id: "filter-learning-key",
    placeholder: "learning key",
    value: filters.learning_key,
  });
  const form = h(
    "form",
    { class: "filters", id: "filters" },
    status,
    model,
    learningKey,
    h("button", { type: "submit" }, "Filter"),
  );
  const compare = h("button", { type: "button", id: "compare-picked", disabled: true }, "Compare");
  const body = h("tbody");
  const table = h(
    "table",
    { class: "runs", id: "runs" },
    h(
      "thead",
      {},
      h(
        "tr",
        {},
        h("th", {}, ""),
        h("th", {}, "status"),
        h("th", {}, "run"),
        h("th", {}, "model"),
        h("th", {}, "learning key"),
        h("th", { class: "num" }, "step"),
        h("th", {}, "reward"),
        h("th", {}, "created"),
      ),
    ),
    body,
  );
  const prev = h("button", { type: "button", id: "prev-page", disabled: true }, "← Newer");
  const next = h("button", { type: "button", id: "next-page", disabled: true }, "Older →");
  const info = h("span", { class: "muted", id: "page-info" });
  root.append(
    h("div", { class: "toolbar" }, h("h1", {}, "Runs"), form, compare),
    table,
    h("div", { class: "pager" }, prev, info, next),
  );

  function query() {
    return {
      status: filters.status || undefined,
      model_name: filters.model_name || undefined,
      learning_key: filters.learning_key || undefined,
    };
  }

  async function load() {
    const page = await api.get("/runs", { ...query(), limit: PAGE, after: cursors[pageIndex] });
    if (!alive) return;
    clear(body);
    if (!page.data.length) {
      body.append(h("tr", {}, h("td", { colspan: 8, class: "muted" }, "No runs.")));
    }
    for (const run of page.data) body.append(row(run));
    cursors.length = pageIndex + 1;
    if (page.next_cursor) cursors.push(page.next_cursor);
    next.disabled = !page.next_cursor;
    prev.disabled = pageIndex === 0;
    info.textContent = `page ${pageIndex + 1}`;
    // Sparklines after the table is drawn: one small metrics read per row.
    await Promise.all(page.data.map((run) => spark(run)));
  }

  function row(run) {
    const total = run.max_steps ?? "?";
    const box = h("input", {
      type: "checkbox",
      class: "pick",
      value: run.id,
      "aria-label": `compare ${run.id}`,
      checked: picked.has(run.id),
    });
    box.addEventListener("change", () => {
      if (box.checked) picked.add(run.id);
      else picked.delete(run.id);
      compare.disabled = picked.size < 2 || picked.size > 5;
      compare.textContent = picked.size ? `Compare ${picked.size}` : "Compare";
    });
    return h(
      "tr",
      { "data-run": run.id },
      h("td", {}, box),
      h("td", {}, statusBadge(run.status)),
      h(
        "td",
        {},
        h(
          "a",
          { href: `/ui/runs/${run.id}`, "data-link": true, class: "mono" },
          run.trained_model_name || run.id.slice(0, 8),
        ),
      ),
      h("td", { class: "model", title: run.model_name }, shortModel(run.model_name)),
      h("td", {}, run.learning_key || "–"),
      h("td", { class: "num" }, `${run.step}/${total}`),
      h("td", { class: "spark", "data-spark": run.id }),
      h("td", {}, fmtTime(run.created_at)),
    );
  }

  async function spark(run) {
    const cell = body.querySelector(`[data-spark="${run.id}"]`);
    try {
      const m = await api.metrics(run.id, { name: "reward_mean" });
      if (!alive || !cell) return;
      cell.append(sparkline(m.reward_mean?.values || []));
    } catch {
      /* a run deleted meanwhile: no sparkline */
    }
  }

  form.addEventListener("submit", (event) => {
    event.preventDefault();
    filters.status = status.value;
    filters.model_name = model.value.trim();
    filters.learning_key = learningKey.value.trim();
    const search = new URLSearchParams(
      Object.entries(filters).filter(([, v]) => v),
    ).toString();
    history.replaceState(null, "", `/ui${search ? `?${search}` : ""}`);
    cursors.length = 1;
    pageIndex = 0;
    load().catch(window.trainyard.showError);
  });
  next.addEventListener("click", () => {
    pageIndex += 1;
    load().catch(window.trainyard.showError);
  });
  prev.addEventListener("click", () => {
    pageIndex = Math.max(0, pageIndex - 1);
    load().catch(window.trainyard.showError);
  });
  compare.addEventListener("click", () => {
    window.trainyard.navigate(`/ui/compare?runs=${[...picked].join(",")}`);
  });

  await load();
  return {
    destroy() {
      alive = false;
    },
  };
}

function shortModel(name) {
  const parts = name.split("/");
  return parts.length > 2 ? `…/${parts.slice(-2).join("/")}` : name;
}
