// Run page: status, step/total, ETA, attempt and worker; live charts; the events timeline;
// checkpoints; inputs; the run's settings.
//
// Live updates: after the first read of the metrics the page follows the run's event
// stream (sse.js). A `step` event past the last step read reads the steps since
// (`step_min`..`step_max`) and hands them to the charts with setData; a `step` event at or
// below one streamed before it (a resumed attempt doing steps again) and `eval` read again
// from that step; `status`, `lease`, `checkpoint` and the stream's `end` update
// the header and tables. Reads are coalesced: at most one in flight, and events arriving
// meanwhile widen the next one instead of queueing more.
//
// The page knows how far its series are whole (`through`) and reads on from there. A read
// of several requests (the first two; more than 20 names) is answered from different
// moments, so each stops at a step known to be committed (`step_max`): the run's `step`,
// then the last `step` or `eval` event's (a step's metric points commit with its event:
// app/runs/lifecycle/step_moves.py). Without that bound one request could hold a step the
// others missed, and the next read, starting after it, would never fetch what they missed.

import * as api from "../api.js";
import { align, Chart, MetricStore } from "../charts.js";
import {
  put,
  clear,
  details,
  fmtClock,
  fmtDuration,
  fmtNumber,
  fmtTime,
  h,
  json,
  statusBadge,
} from "../dom.js";
import { EventStream } from "../sse.js";

const TERMINAL = new Set(["completed", "failed", "cancelled"]);
const TIMELINE_MAX = 300;

/** The metric names each chart draws, as the worker records them (workers/pipeline/callback.py:
 * TRL's logged values plus reward_mean/std/min/max, step_seconds, tokens_per_second, and
 * eval_* from the evaluations). */
export function chartSpecs(run) {
  const components = componentNames(run);
  const evalMetrics = evalMetricNames(run);
  return [
    {
      id: "reward",
      title: "Reward (mean ± std)",
      names: ["reward_mean", "reward_std"],
      lines: [
        { label: "reward_mean", color: "#2563eb", width: 2 },
        { label: "mean + std", color: "rgba(37,99,235,0.35)", width: 1 },
        { label: "mean − std", color: "rgba(37,99,235,0.35)", width: 1 },
      ],
      band: [2, 3],
      columns: (store) => {
        const mean = store.get("reward_mean");
        const std = store.get("reward_std");
        const [steps, m, s] = align([mean, std]);
        const up = m.map((v, i) => (v === null || s[i] === null ? null : v + s[i]));
        const lo = m.map((v, i) => (v === null || s[i] === null ? null : v - s[i]));
        return [steps, m, up, lo];
      },
    },
    {
      id: "components",
      title: "Reward components",
      names: components.map((c) => c.name),
      lines: components.map((c) => ({ label: c.label })),
    },
    simple("loss", "Loss", ["loss"]),
    {
      ...simple("kl", "KL", ["kl"]),
      empty: run.grpo?.beta === 0 ? "Not measured: grpo.beta is 0 (no reference model)." : undefined,
    },
    simple("entropy", "Entropy", ["entropy"]),
    simple("completion_length", "Completion length (tokens)", ["completions/mean_length"]),
    {
      id: "eval_reward",
      title: "Eval reward and metrics (validation inputs)",
      names: ["eval_reward", ...evalMetrics.map((m) => m.name)],
      lines: [
        { label: "eval_reward", points: true, spanGaps: true },
        ...evalMetrics.map((m) => ({ label: m.label, points: true, spanGaps: true })),
      ],
    },
    simple("step_seconds", "Step seconds", ["step_seconds"]),
    ...(run.grpo?.async_rollouts ? asyncSpecs() : []),
  ];
}

/** An asynchronous run's charts (docs/async.md): how stale each step's rollouts were, the
 * generation the step before hid (or the trainer waited for), and TRL's correction. */
function asyncSpecs() {
  return [
    {
      ...simple("async_staleness", "Staleness (policy versions)", ["async/staleness"]),
      lines: [{ label: "async/staleness", points: true }],
    },
    simple("async_time", "Generation and wait (seconds)", [
      "async/generation_seconds",
      "async/wait_seconds",
      "step_seconds",
    ]),
    simple("importance_sampling", "Importance-sampling ratio", [
      "sampling/importance_sampling_ratio/mean",
      "sampling/importance_sampling_ratio/min",
      "sampling/importance_sampling_ratio/max",
    ]),
  ];
}

function simple(id, title, names) {
  return { id, title, names, lines: names.map((name) => ({ label: name })) };
}

/** Each reward component's series: one per reward function (or judge), when the worker
 * records them as ``reward/<name>``, and the combined reward. */
export function componentNames(run) {
  const reward = run.reward || {};
  const names = [];
  if (reward.type === "function") {
    const fns = (reward.functions || []).map((f) => f.name);
    fns.forEach((name, i) => {
      const key = fns.filter((n) => n === name).length === 1 ? name : `${name}[${i}]`;
      names.push({ name: `reward/${key}`, label: key });
    });
  } else if (reward.type === "rim") {
    const judges = reward.active_judges || {};
    for (const [judge, on] of Object.entries(judges)) {
      if (on) names.push({ name: `reward/rim/${judge}`, label: `rim ${judge}` });
    }
  } else {
    names.push({ name: "reward/ruler", label: "ruler" });
  }
  // The combined reward: reward_mean, which the reward chart reads already (TRL's own
  // rewards/trainyard/mean is the same number: Trainyard hands TRL one function).
  names.push({ name: "reward_mean", label: "combined (reward_mean)" });
  return names;
}

/** The run's extra evaluation metrics (grpo.eval_metrics), as the worker records them:
 * ``eval_metric/<label>`` (the API fills in each label). */
export function evalMetricNames(run) {
  return (run.grpo?.eval_metrics || []).map((m) => ({
    name: `eval_metric/${m.label}`,
    label: m.label,
  }));
}

export function totalSteps(run, lastStepMessage) {
  if (run.max_steps) return run.max_steps;
  const m = lastStepMessage && /^step \d+\/(\d+)/.exec(lastStepMessage);
  return m ? Number(m[1]) : null;
}

export async function mount(root, runId) {
  performance.mark("trainyard:run:start");
  let alive = true;
  let stream = null;
  let etag = null;
  let worker = null;
  let lastStepMessage = null;
  const store = new MetricStore();

  // First reads together: the run, the series every run has, checkpoints, inputs; then
  // the reward components, whose names depend on the run's reward.
  const baseNames = chartSpecs({ reward: {} })
    .filter((s) => s.id !== "components")
    .flatMap((s) => s.names);
  // Each read's failure is awaited below; handled now, so that one rejecting while the run
  // is still being read is not reported as unhandled (a run not found fails them all).
  const quiet = (p) => {
    p.catch(() => {});
    return p;
  };
  const baseP = quiet(fetchMetrics(baseNames, {}));
  const checkpointsP = quiet(api.get(`/runs/${runId}/checkpoints`, { limit: 50 }));
  const inputsP = quiet(api.get(`/runs/${runId}/inputs`, { limit: 50 }));
  let run = await fetchRun();
  const specs = chartSpecs(run);
  const names = [...new Set(specs.flatMap((s) => s.names))];
  const extra = names.filter((n) => !baseNames.includes(n));

  // What the charts hold: every point at steps ≤ `through`. `committed`: the last step
  // whose points are committed, as far as the page knows; `rereadFrom`: a step to read
  // again from (an evaluation's); `ended`: the run is over, every point committed.
  let through = -1;
  let committed = run.step;
  let rereadFrom = null;
  let ended = TERMINAL.has(run.status);
  // The highest step of the `step` events streamed so far: a step at or below it is one a
  // resumed attempt does again (the stream replays a run's events in order).
  let streamMax = -1;
  // The first read of the series every run has holds every step up to its last (steps
  // commit in order); the second, made after the run was read, every step up to the run's.
  const metricsP = Promise.all([
    baseP,
    fetchMetrics(extra, { step_max: ended ? undefined : run.step }),
  ]).then(([base, more]) => {
    const last = Math.max(-1, ...Object.values(base).map((s) => s.steps.at(-1) ?? -1));
    through = ended ? last : Math.min(last, run.step);
    committed = Math.max(committed, last);
    return { ...base, ...more };
  });

  // --- layout -------------------------------------------------------------------------
  const head = h("div", { class: "run-head card", id: "run-head" });
  const charts = specs.map(
    (spec) =>
      new Chart(`run:${spec.id}`, spec.title, spec.lines, { band: spec.band, empty: spec.empty }),
  );
  const timeline = h("ol", { class: "timeline", id: "events" });
  const timelineNote = h("p", { class: "muted", id: "events-note" });
  const liveState = h("span", { class: "live", id: "live-state" }, "connecting…");
  const checkpointsBox = h("div", { id: "checkpoints" });
  const inputsBox = h("div", { id: "inputs" });
  root.append(
    head,
    h("section", { class: "charts", id: "charts" }, charts.map((c) => c.el)),
    h(
      "div",
      { class: "columns" },
      h(
        "section",
        { class: "card" },
        h("h2", {}, "Events ", liveState),
        timelineNote,
        timeline,
      ),
      h(
        "div",
        {},
        h("section", { class: "card" }, h("h2", {}, "Checkpoints"), checkpointsBox),
        h("section", { class: "card" }, h("h2", {}, "Inputs"), inputsBox),
        h(
          "section",
          { class: "card" },
          h("h2", {}, "Settings"),
          details("reward", json(run.reward)),
          details("grpo", json(run.grpo)),
          run.environment ? details("environment", json(run.environment)) : null,
          run.sft ? details("sft", json({ ...run.sft, examples: undefined })) : null,
          Object.keys(run.config || {}).length ? details("config", json(run.config)) : null,
        ),
      ),
    ),
  );
  for (const c of charts) c.resize();
  renderHead();

  store.merge(await metricsP);
  drawCharts();
  performance.mark("trainyard:run:charts");
  renderCheckpoints(await checkpointsP);
  renderInputs(await inputsP);
  performance.mark("trainyard:run:rendered");
  performance.measure("trainyard:run:first-render", "trainyard:run:start", "trainyard:run:rendered");

  // --- live ---------------------------------------------------------------------------
  let metricsInFlight = false;
  let runDirty = false;
  let runInFlight = false;
  let checkpointsDirty = false;
  const queued = [];
  let flushScheduled = false;
  let eventCount = 0;

  stream = new EventStream(runId, {
    onEvent(event) {
      if (!alive) return;
      onEvent(event);
    },
    onEnd(status) {
      if (!alive) return;
      liveState.textContent = `ended (${status})`;
      liveState.dataset.state = "ended";
      refreshRun();
      ended = true;
      pumpMetrics();
      refreshCheckpoints();
    },
    onError(err) {
      if (alive) window.trainyard.showError(err);
    },
    onState(state) {
      if (!alive) return;
      liveState.textContent = state;
      liveState.dataset.state = state;
    },
  }).start();
  window.trainyard.run = { id: runId, store, stream };
  pumpMetrics(); // the steps the first reads may have left out, if any

  function onEvent(event) {
    eventCount += 1;
    queued.push(event);
    if (!flushScheduled) {
      flushScheduled = true;
      requestAnimationFrame(flushTimeline);
    }
    const data = event.data?.data || {};
    switch (event.data?.type || event.type) {
      case "step":
        lastStepMessage = event.data.message;
        if (typeof data.step !== "number") break;
        if (data.step > committed) {
          committed = data.step;
          if (data.step > run.step) run = { ...run, step: data.step };
          renderHead();
          pumpMetrics();
        } else if (data.step <= streamMax) {
          // A step done again: the run resumed from an earlier checkpoint, and the step's
          // points were replaced with the new attempt's. Read them again from it.
          rereadFrom = Math.min(rereadFrom ?? data.step, data.step);
          pumpMetrics();
        }
        streamMax = Math.max(streamMax, data.step);
        break;
      case "eval":
        // An evaluation commits after its step's training metrics and before the next
        // step's: one at a step the charts hold whole already is in them.
        if (typeof data.step === "number" && data.step >= through) {
          committed = Math.max(committed, data.step);
          rereadFrom = Math.min(rereadFrom ?? data.step, data.step);
          pumpMetrics();
        }
        break;
      case "status":
        if (data.to && data.to !== run.status) {
          run = { ...run, status: data.to };
          renderHead();
        }
        refreshRun();
        break;
      case "lease":
        worker = data.owner || worker;
        if (data.attempt) run = { ...run, attempt: Math.max(run.attempt, data.attempt) };
        renderHead();
        break;
      case "checkpoint":
        refreshCheckpoints();
        break;
      default:
        break;
    }
  }

  function flushTimeline() {
    flushScheduled = false;
    if (!alive) return;
    const fresh = queued.splice(0, queued.length).slice(-TIMELINE_MAX);
    const frag = document.createDocumentFragment();
    for (let i = fresh.length - 1; i >= 0; i--) frag.append(eventItem(fresh[i].data));
    timeline.prepend(frag);
    while (timeline.childElementCount > TIMELINE_MAX) timeline.lastElementChild.remove();
    timelineNote.textContent =
      eventCount > TIMELINE_MAX
        ? `${eventCount} events; the latest ${TIMELINE_MAX} shown, newest first.`
        : `${eventCount} events, newest first.`;
  }

  /** The steps to read next, {from, to}, or null. After the end, every step from the
   * last one held (its evaluation may have committed after it) to the run's last. */
  function nextRead() {
    if (ended) {
      const from = Math.min(through, rereadFrom ?? Infinity);
      return from === Infinity ? null : { from, to: null };
    }
    const from = Math.min(through + 1, rereadFrom ?? Infinity);
    return from <= committed ? { from, to: committed } : null;
  }

  /** Reads ``range``'s points; once they are in hand, the charts hold every step up to its
   * end. */
  async function readMetrics(range) {
    rereadFrom = null;
    try {
      const fresh = await fetchMetrics(names, {
        step_min: Math.max(0, range.from),
        step_max: range.to ?? undefined,
      });
      through = Math.max(through, range.to ?? Infinity);
      return fresh;
    } catch (err) {
      if (range.from <= through) rereadFrom = Math.min(rereadFrom ?? range.from, range.from);
      throw err;
    }
  }

  async function pumpMetrics() {
    if (metricsInFlight) return;
    metricsInFlight = true;
    try {
      for (let range = nextRead(); range !== null && alive; range = nextRead()) {
        const fresh = await readMetrics(range);
        if (!alive) return;
        if (Object.keys(fresh).length) {
          store.merge(fresh);
          drawCharts();
          performance.mark(`trainyard:step-drawn:${store.lastStep}`);
          renderHead();
        }
      }
    } catch (err) {
      if (err.name === "SignInRequired") {
        window.trainyard.showError(err);
        return;
      }
      // A 429, a 5xx or the network: the same read again in a second, nothing lost.
      if (alive) setTimeout(pumpMetrics, 1000);
    } finally {
      metricsInFlight = false;
    }
  }

  async function refreshRun() {
    runDirty = true;
    if (runInFlight) return;
    runInFlight = true;
    try {
      while (runDirty && alive) {
        runDirty = false;
        const fresh = await fetchRun();
        if (fresh && alive) {
          run = fresh;
          renderHead();
        }
      }
    } catch (err) {
      if (err.name === "SignInRequired") window.trainyard.showError(err);
    } finally {
      runInFlight = false;
    }
  }

  async function refreshCheckpoints() {
    if (checkpointsDirty) return;
    checkpointsDirty = true;
    try {
      const page = await api.get(`/runs/${runId}/checkpoints`, { limit: 50 });
      if (alive) renderCheckpoints(page);
    } finally {
      checkpointsDirty = false;
    }
  }

  // --- reads --------------------------------------------------------------------------
  /** GET /runs/{id} with If-None-Match: null when unchanged (304). */
  async function fetchRun() {
    const headers = api.authHeaders({ Accept: "application/json" });
    if (etag) headers["If-None-Match"] = etag;
    const response = await fetch(`/runs/${runId}`, { headers, cache: "no-store" });
    if (response.status === 304) return null;
    if (!response.ok) throw await api.failure(response);
    etag = response.headers.get("ETag");
    return response.json();
  }

  async function fetchMetrics(wanted, params) {
    if (!wanted.length) return {};
    // At most 20 names a request (the API's cap): split, read together.
    const chunks = [];
    for (let i = 0; i < wanted.length; i += 20) chunks.push(wanted.slice(i, i + 20));
    const parts = await Promise.all(
      chunks.map((chunk) => api.metrics(runId, { ...params, name: chunk })),
    );
    return Object.assign({}, ...parts);
  }

  // --- drawing ------------------------------------------------------------------------
  function drawCharts() {
    specs.forEach((spec, i) => {
      const data = spec.columns
        ? spec.columns(store)
        : align(spec.names.map((name) => store.get(name)));
      charts[i].setData(data);
    });
  }

  function renderHead() {
    const total = totalSteps(run, lastStepMessage);
    const seconds = store.get("step_seconds")?.values || [];
    const recent = seconds.slice(-20).sort((a, b) => a - b);
    const median = recent.length ? recent[Math.floor(recent.length / 2)] : null;
    const remaining = total !== null ? Math.max(0, total - run.step) : null;
    const eta =
      TERMINAL.has(run.status) || run.status === "paused"
        ? "–"
        : median !== null && remaining !== null
          ? fmtDuration(median * remaining)
          : "–";
    const pct = total ? Math.min(100, (100 * run.step) / total) : 0;
    const bar = h("div", { class: "bar" });
    bar.style.width = `${pct}%`; // CSSOM, not a style attribute: the page's CSP allows only this
    put(head, 
      h(
        "div",
        { class: "title" },
        h("h1", {}, run.trained_model_name || `Run ${run.id.slice(0, 8)}`),
        h("span", { id: "run-status" }, statusBadge(run.status)),
        h(
          "nav",
          { class: "actions" },
          h("a", { href: `/ui/runs/${run.id}/trajectories`, "data-link": true, id: "to-trajectories" }, "Trajectories"),
          h("a", { href: `/ui/compare?runs=${run.id}`, "data-link": true }, "Compare…"),
        ),
      ),
      h(
        "div",
        { class: "progress", title: `${pct.toFixed(0)}%` },
        bar,
      ),
      h(
        "dl",
        { class: "facts" },
        fact("step", h("span", { id: "run-step" }, `${run.step}/${total ?? "?"}`)),
        fact("ETA", h("span", { id: "run-eta" }, eta)),
        fact("attempt", h("span", { id: "run-attempt" }, String(run.attempt))),
        fact("worker", h("span", { id: "run-worker", class: "mono" }, worker || "–")),
        fact("model", h("span", { class: "mono", title: run.model_name }, run.model_name)),
        fact("learning key", run.learning_key || "–"),
        fact("reward", fmtNumber(run.metrics?.avg_reward)),
        fact("eval reward", fmtNumber(run.metrics?.eval_reward)),
        fact("created", fmtTime(run.created_at)),
        fact("started", fmtTime(run.started_at)),
        fact("completed", fmtTime(run.completed_at)),
        fact("id", h("span", { class: "mono" }, run.id)),
      ),
      run.error ? h("p", { class: "error", id: "run-error" }, run.error) : null,
    );
  }

  function renderCheckpoints(page) {
    clear(checkpointsBox);
    if (!page.data.length) {
      checkpointsBox.append(h("p", { class: "muted" }, "None yet."));
      return;
    }
    checkpointsBox.append(
      h(
        "table",
        { class: "small" },
        h("thead", {}, h("tr", {}, h("th", {}, "step"), h("th", {}, "eval reward"), h("th", {}, "path"))),
        h(
          "tbody",
          {},
          page.data.map((c) =>
            h(
              "tr",
              {},
              h("td", { class: "num" }, String(c.step), c.is_final ? h("span", { class: "tag" }, "final") : null),
              h("td", { class: "num" }, fmtNumber(c.metrics?.eval_reward)),
              h("td", { class: "mono path", title: c.path }, c.path),
            ),
          ),
        ),
      ),
    );
  }

  function renderInputs(page) {
    clear(inputsBox);
    const table = h(
      "table",
      { class: "small" },
      h("thead", {}, h("tr", {}, h("th", {}, "#"), h("th", {}, "split"), h("th", {}, "input"), h("th", {}, "context"))),
      h(
        "tbody",
        {},
        page.data.map((i) =>
          h(
            "tr",
            {},
            h("td", { class: "num" }, String(i.index)),
            h("td", {}, i.split),
            h("td", { class: "text" }, i.input_text),
            h("td", { class: "mono" }, i.context ? JSON.stringify(i.context) : ""),
          ),
        ),
      ),
    );
    inputsBox.append(table);
    if (page.next_cursor) {
      const more = h("button", { type: "button", class: "link" }, "More…");
      more.addEventListener("click", async () => {
        const next = await api.get(`/runs/${runId}/inputs`, { limit: 200, after: page.next_cursor });
        page = { data: [...page.data, ...next.data], next_cursor: next.next_cursor };
        renderInputs(page);
      });
      inputsBox.append(more);
    }
  }

  return {
    destroy() {
      alive = false;
      stream?.close();
      for (const c of charts) c.destroy();
      delete window.trainyard.run;
    },
  };
}

function fact(label, value) {
  return [h("dt", {}, label), h("dd", {}, value)];
}

function eventItem(e) {
  return h(
    "li",
    { class: `event level-${e.level} type-${e.type}`, "data-type": e.type, "data-id": String(e.id) },
    h("time", { datetime: e.created_at, title: fmtTime(e.created_at) }, fmtClock(e.created_at)),
    h("span", { class: "type" }, e.type),
    h("span", { class: "message" }, e.message),
  );
}
