// The REST API as the dashboard reads it: every request carries the signed-in key.
//
// The key lives in sessionStorage: it is a bearer credential for a whole project, so it
// stays with the tab that was signed in (gone when the tab closes, never shared with other
// tabs or written to disk for the next browser session); a new tab signs in again.

const KEY = "trainyard.key";

export class SignInRequired extends Error {
  constructor(message) {
    super(message);
    this.name = "SignInRequired";
  }
}

export class NotFound extends Error {
  constructor(message) {
    super(message);
    this.name = "NotFound";
  }
}

export class ApiError extends Error {
  constructor(status, problem) {
    super(problem?.detail || problem?.title || `HTTP ${status}`);
    this.name = "ApiError";
    this.status = status;
    this.problem = problem;
  }
}

export function key() {
  return sessionStorage.getItem(KEY);
}

export function setKey(value) {
  if (value) sessionStorage.setItem(KEY, value);
  else sessionStorage.removeItem(KEY);
  signedIn = null;
}

// What the signed-in key may do. The roles in order, each allowed what the ones before it
// are (app/auth/roles.py): a viewer reads, a member also creates and controls runs and
// uploads datasets, an admin also manages webhooks. The API refuses (403) whatever the key's
// role does not allow; the pages only leave out what would be refused.
const ROLES = ["viewer", "member", "admin"];
let signedIn = null; // GET /me's answer for the signed-in key, asked once per page load

/** The signed-in key, its project and its role (``GET /me``), asked once and kept. */
export async function me() {
  if (signedIn === null) signedIn = await get("/me");
  return signedIn;
}

/** Whether the signed-in key's role allows what ``role`` may do (false before ``me()``). */
export function may(role) {
  const have = ROLES.indexOf(signedIn?.key?.role);
  return have >= 0 && have >= ROLES.indexOf(role);
}

export function authHeaders(extra = {}) {
  const k = key();
  return k ? { Authorization: `Bearer ${k}`, ...extra } : { ...extra };
}

async function problemOf(response) {
  try {
    return await response.json();
  } catch {
    return null;
  }
}

/** The error a non-2xx answer means to the page: sign in again, not found, or a problem. */
export async function failure(response) {
  const problem = await problemOf(response);
  if (response.status === 401) {
    return new SignInRequired(problem?.detail || "The API key was not accepted.");
  }
  if (response.status === 404) return new NotFound(problem?.detail || "Not found.");
  return new ApiError(response.status, problem);
}

function url(path, params) {
  const u = new URL(path, location.origin);
  for (const [name, value] of Object.entries(params || {})) {
    if (value === undefined || value === null || value === "") continue;
    for (const v of Array.isArray(value) ? value : [value]) u.searchParams.append(name, v);
  }
  return u;
}

/** GET ``path`` as JSON; throws SignInRequired / NotFound / ApiError. */
export async function get(path, params, { signal } = {}) {
  const response = await fetch(url(path, params), {
    headers: authHeaders({ Accept: "application/json" }),
    cache: "no-store",
    signal,
  });
  if (!response.ok) throw await failure(response);
  return response.json();
}

/** Every page of a cursor-paged list (``{data, has_more, next_cursor}``), up to ``max`` rows. */
export async function all(path, params = {}, { max = 10_000, signal } = {}) {
  const rows = [];
  let after;
  for (;;) {
    const page = await get(path, { limit: 200, ...params, after }, { signal });
    rows.push(...page.data);
    if (!page.has_more || !page.next_cursor || rows.length >= max) return rows;
    after = page.next_cursor;
  }
}

/** The run's metric series as ``{name: {steps: [], values: []}}``. */
export async function metrics(runId, params = {}, options = {}) {
  const body = await get(`/runs/${runId}/metrics`, params, options);
  const out = {};
  for (const series of body.series) {
    const steps = new Array(series.points.length);
    const values = new Array(series.points.length);
    series.points.forEach((p, i) => {
      steps[i] = p.step;
      values[i] = p.value;
    });
    out[series.name] = { steps, values };
  }
  return out;
}

/** Checks a key by asking ``GET /me`` with it: its answer (project, key, role) when the key
 * is accepted, for ``signIn``. */
export async function checkKey(candidate) {
  const response = await fetch(url("/me"), {
    headers: { Authorization: `Bearer ${candidate}`, Accept: "application/json" },
    cache: "no-store",
  });
  if (response.ok) return response.json();
  throw await failure(response);
}

/** Signs ``candidate`` in with what ``checkKey`` answered for it. */
export function signIn(candidate, answer) {
  setKey(candidate);
  signedIn = answer;
}
