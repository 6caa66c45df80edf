// Line charts on uPlot (vendored, 1.6.32): one instance per chart for the page's life, new
// points given with setData (never a new chart per update), so 10,000 steps × 10 series
// redraw in milliseconds. Every chart is on window.trainyard.charts under its id: the
// browser tests read what is drawn from there (u.data is exactly what uPlot plots).

import { h } from "./dom.js";

export const PALETTE = [
  "#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c",
  "#0891b2", "#ca8a04", "#db2777", "#4b5563", "#65a30d",
];

export function registry() {
  window.trainyard = window.trainyard || {};
  window.trainyard.charts = window.trainyard.charts || {};
  return window.trainyard.charts;
}

// Steps are whole numbers: no tick at step 2.5.
const STEP_INCRS = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1e3, 2e3, 2.5e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6];

/** A y-axis label: three significant digits, no "-0". */
function tick(v) {
  if (v === null || v === undefined) return "";
  if (v === 0 || Object.is(v, -0)) return "0";
  const abs = Math.abs(v);
  if (abs >= 1e5 || abs < 1e-3) return v.toExponential(1);
  return String(Number(v.toPrecision(3)));
}

/** A run's metric series by name, each sorted by step; new points merge in. */
export class MetricStore {
  constructor() {
    this.series = new Map(); // name -> {steps: number[], values: number[]}
    this.lastStep = -1;
  }

  /** Merges ``{name: {steps, values}}``; returns the names that changed. */
  merge(fetched) {
    const changed = new Set();
    for (const [name, incoming] of Object.entries(fetched)) {
      let s = this.series.get(name);
      if (!s) {
        s = { steps: [], values: [] };
        this.series.set(name, s);
      }
      for (let i = 0; i < incoming.steps.length; i++) {
        const step = incoming.steps[i];
        const value = incoming.values[i];
        const n = s.steps.length;
        if (n === 0 || step > s.steps[n - 1]) {
          s.steps.push(step);
          s.values.push(value);
        } else {
          const at = lowerBound(s.steps, step);
          if (s.steps[at] === step) s.values[at] = value; // a redone step overwrites
          else {
            s.steps.splice(at, 0, step);
            s.values.splice(at, 0, value);
          }
        }
        if (step > this.lastStep) this.lastStep = step;
      }
      changed.add(name);
    }
    return changed;
  }

  names() {
    return [...this.series.keys()];
  }

  get(name) {
    return this.series.get(name);
  }
}

function lowerBound(sorted, x) {
  let lo = 0;
  let hi = sorted.length;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (sorted[mid] < x) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/** x = the union of the series' steps; each series null where it has no point. When every
 * series has the same steps (the common case: one value per name per step) the store's own
 * arrays are handed over as they are, uncopied: uPlot never writes to its data. */
function sameArray(a, b) {
  if (a === b) return true;
  if (a.length !== b.length) return false;
  for (let i = a.length - 1; i >= 0; i--) if (a[i] !== b[i]) return false;
  return true;
}

export function align(seriesList) {
  const present = seriesList.filter(Boolean);
  if (!present.length) return [[], ...seriesList.map(() => [])];
  const first = present[0].steps;
  const sameSteps =
    present.length === seriesList.length && present.every((s) => sameArray(s.steps, first));
  if (sameSteps) return [first, ...seriesList.map((s) => s.values)];
  const all = new Set();
  for (const s of present) for (const step of s.steps) all.add(step);
  const steps = [...all].sort((a, b) => a - b);
  const index = new Map(steps.map((step, i) => [step, i]));
  const columns = seriesList.map((s) => {
    const out = new Array(steps.length).fill(null);
    if (s) for (let i = 0; i < s.steps.length; i++) out[index.get(s.steps[i])] = s.values[i];
    return out;
  });
  return [steps, ...columns];
}

/**
 * One chart. ``lines``: [{label, color?, dash?}]; ``band``: indexes (1-based, into lines)
 * of the upper and lower series filled between.
 */
export class Chart {
  constructor(id, title, lines, { band = null, height = 200, spanGaps = false, empty = "No data yet." } = {}) {
    this.id = id;
    this.lines = lines;
    this.el = h(
      "section",
      { class: "chart", "data-chart": id },
      h("h3", {}, title),
      h("div", { class: "plot" }),
      h("p", { class: "empty muted" }, empty),
    );
    const plot = this.el.querySelector(".plot");
    const series = [
      { label: "step" },
      ...lines.map((line, i) => ({
        label: line.label,
        stroke: line.color || PALETTE[i % PALETTE.length],
        width: line.width ?? 1.5,
        dash: line.dash,
        fill: line.fill,
        spanGaps: line.spanGaps ?? spanGaps,
        points: { show: line.points ?? false },
        value: (_u, v) => (v === null || v === undefined ? "–" : Number(v).toPrecision(4)),
      })),
    ];
    const opts = {
      width: 400,
      height,
      scales: { x: { time: false } },
      series,
      axes: [
        { label: "step", labelSize: 18, size: 34, incrs: STEP_INCRS },
        { size: 60, values: (_u, splits) => splits.map(tick) },
      ],
      legend: { live: true },
      cursor: { drag: { x: true, y: false }, points: { size: 6 } },
    };
    if (band) opts.bands = [{ series: band, fill: "rgba(37, 99, 235, 0.15)" }];
    this.u = new uPlot(opts, [[], ...lines.map(() => [])], plot);
    registry()[id] = this.u;
    this.observer = new ResizeObserver(() => this.resize());
    this.observer.observe(this.el);
  }

  resize() {
    const width = Math.max(240, Math.floor(this.el.clientWidth - 16));
    if (width !== this.u.width) this.u.setSize({ width, height: this.u.height });
  }

  /** New data: [steps, ...one column per line]. */
  setData(data) {
    this.el.classList.toggle("has-data", data[0].length > 0);
    this.u.setData(data);
  }

  destroy() {
    this.observer.disconnect();
    this.u.destroy();
    if (registry()[this.id] === this.u) delete registry()[this.id];
  }
}
