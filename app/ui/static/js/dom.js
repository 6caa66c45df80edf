// Small DOM helpers. Everything a run or a trajectory holds is set as text, never as HTML:
// completions and judges' explanations are model output.

const SVG = "http://www.w3.org/2000/svg";

/** h("div", {class: "x", onclick: fn}, "text", child, [more]) */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  setAttrs(el, attrs);
  append(el, children);
  return el;
}

function setAttrs(el, attrs) {
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on") && typeof value === "function") {
      el.addEventListener(name.slice(2), value);
    } else if (name === "dataset") {
      Object.assign(el.dataset, value);
    } else if (value === true) {
      el.setAttribute(name, "");
    } else {
      el.setAttribute(name, String(value));
    }
  }
}

function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

export function clear(el) {
  while (el.firstChild) el.firstChild.remove();
  return el;
}

/** Replaces el's children (null, undefined and false are skipped, as in h()). */
export function put(el, ...children) {
  clear(el);
  append(el, children);
  return el;
}

export function fmtClock(iso) {
  if (!iso) return "–";
  return new Date(iso).toLocaleTimeString(undefined, { hour12: false });
}

export function fmtNumber(value, digits = 3) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (typeof value !== "number") return String(value);
  if (Number.isInteger(value)) return String(value);
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e5)) return value.toExponential(2);
  return value.toFixed(digits);
}

export function fmtTime(iso) {
  if (!iso) return "–";
  const d = new Date(iso);
  return d.toLocaleString(undefined, {
    year: "numeric",
    month: "short",
    day: "numeric",
    hour: "2-digit",
    minute: "2-digit",
    second: "2-digit",
  });
}

export function fmtDuration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "–";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s} s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m} min ${s % 60} s`;
  const hours = Math.floor(m / 60);
  return `${hours} h ${m % 60} min`;
}

export function statusBadge(status) {
  return h("span", { class: `status status-${status}`, "data-status": status }, status);
}

/** A reward sparkline as inline SVG: cheap enough for every row of a list. */
export function sparkline(values, { width = 120, height = 28 } = {}) {
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("class", "sparkline");
  const finite = values.filter(Number.isFinite);
  if (finite.length < 2) {
    svg.dataset.points = String(finite.length);
    return svg;
  }
  let lo = Math.min(...finite);
  let hi = Math.max(...finite);
  if (hi === lo) {
    hi += 0.5;
    lo -= 0.5;
  }
  // At most one point per pixel column: a 10,000-step run draws as fast as a short one.
  const stride = Math.max(1, Math.ceil(values.length / width));
  const points = [];
  for (let i = 0; i < values.length; i += stride) {
    if (!Number.isFinite(values[i])) continue;
    const x = (i / (values.length - 1)) * (width - 2) + 1;
    const y = height - 1 - ((values[i] - lo) / (hi - lo)) * (height - 2);
    points.push(`${x.toFixed(1)},${y.toFixed(1)}`);
  }
  const line = document.createElementNS(SVG, "polyline");
  line.setAttribute("points", points.join(" "));
  svg.append(line);
  svg.dataset.points = String(finite.length);
  svg.dataset.last = String(finite[finite.length - 1]);
  return svg;
}

/** A collapsible block. */
export function details(summary, body, { open = false, cls = "" } = {}) {
  return h("details", { class: cls, open }, h("summary", {}, summary), body);
}

export function json(value) {
  return h("pre", { class: "json" }, JSON.stringify(value, null, 2));
}
