// The dashboard's shell: sign-in, the client-side router, and the page in <main>.
//
// Paths (each answered by the API with this same page, app/ui/router.py):
//   /ui                              runs list
//   /ui/runs/{id}                    run page
//   /ui/runs/{id}/trajectories       trajectory viewer (?step=&group=&min_reward=&max_reward=)
//   /ui/compare?runs=a,b             comparison

import * as api from "./api.js";
import { clear, h, put } from "./dom.js";

performance.mark("trainyard:boot");
window.trainyard = window.trainyard || {};
window.trainyard.charts = window.trainyard.charts || {};

const main = document.getElementById("main");
let current = null; // the page shown: {destroy()}

const routes = [
  [/^\/ui\/?$/, () => import("./pages/runs.js"), () => []],
  [/^\/ui\/runs\/([0-9a-fA-F-]{36})\/?$/, () => import("./pages/run.js"), (m) => [m[1]]],
  [
    /^\/ui\/runs\/([0-9a-fA-F-]{36})\/trajectories\/?$/,
    () => import("./pages/trajectories.js"),
    (m) => [m[1]],
  ],
  [/^\/ui\/compare\/?$/, () => import("./pages/compare.js"), () => []],
];

export function navigate(path, { replace = false } = {}) {
  if (replace) history.replaceState(null, "", path);
  else history.pushState(null, "", path);
  render();
}
window.trainyard.navigate = navigate;

function signInForm(message) {
  const input = h("input", {
    type: "password",
    name: "key",
    id: "key",
    autocomplete: "off",
    placeholder: "ty_…",
    required: true,
  });
  const error = h("p", { class: "error", id: "signin-error", role: "alert" }, message || "");
  error.hidden = !message;
  const button = h("button", { type: "submit" }, "Sign in");
  const form = h(
    "form",
    { class: "signin card", id: "signin" },
    h("h1", {}, "Sign in"),
    h(
      "p",
      { class: "muted" },
      "Use an API key of your project (",
      h("code", {}, "trainyard status --key"),
      " prints the one ",
      h("code", {}, "trainyard up"),
      " made). It is kept in this tab only.",
    ),
    h("label", { for: "key" }, "API key"),
    input,
    button,
    error,
  );
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    button.disabled = true;
    error.hidden = true;
    const candidate = input.value.trim();
    try {
      api.signIn(candidate, await api.checkKey(candidate));
      render();
    } catch (err) {
      error.textContent = `Sign-in failed: ${err.message || err}`;
      error.hidden = false;
    } finally {
      button.disabled = false;
    }
  });
  return form;
}

export function showSignIn(message) {
  current?.destroy?.();
  current = null;
  api.setKey(null);
  header();
  put(main, signInForm(message));
  document.getElementById("key")?.focus();
}

function header(me = null) {
  const signedIn = Boolean(api.key());
  document.getElementById("signout").hidden = !signedIn;
  const who = document.getElementById("who");
  who.textContent = !signedIn ? "" : me ? `${me.project.name} · ${me.key.role}` : "signed in";
  who.title = me ? `key ${me.key.prefix}… (${me.key.name || "no name"})` : "";
  // Pages mark what needs more than reading with data-needs="member" or "admin"; the
  // stylesheet hides it for a key whose role does not allow it (the API would say 403).
  if (me) document.body.dataset.role = me.key.role;
  else delete document.body.dataset.role;
  window.trainyard.me = me;
}

/** What a page shows when loading it failed. */
export function showError(err) {
  if (err.name === "SignInRequired") {
    showSignIn(`Sign-in failed: ${err.message}`);
    return;
  }
  const notFound = err.name === "NotFound";
  put(main, 
    h(
      "div",
      { class: notFound ? "card not-found" : "card error", id: notFound ? "not-found" : "failed" },
      h("h1", {}, notFound ? "Not found" : "Something went wrong"),
      h("p", {}, notFound ? "This run does not exist or belongs to another project." : ""),
      h("p", { class: "muted" }, err.message || String(err)),
      h("p", {}, h("a", { href: "/ui", "data-link": true }, "Back to the runs")),
    ),
  );
}
window.trainyard.showError = showError;

async function render() {
  current?.destroy?.();
  current = null;
  window.trainyard.ready = false; // the page is shown
  window.trainyard.settled = false; // the page or its error is shown
  header();
  if (!api.key()) {
    showSignIn();
    return;
  }
  let me;
  try {
    me = await api.me(); // once per page load: a reload signs in from sessionStorage
  } catch (err) {
    showError(err); // a key revoked meanwhile: the sign-in form again
    window.trainyard.settled = true;
    return;
  }
  header(me);
  const path = location.pathname;
  for (const [pattern, load, args] of routes) {
    const m = path.match(pattern);
    if (!m) continue;
    const page = await load();
    const root = clear(main);
    try {
      current = await page.mount(root, ...args(m), new URLSearchParams(location.search));
      window.trainyard.ready = true;
    } catch (err) {
      showError(err);
    }
    window.trainyard.settled = true;
    return;
  }
  showError(Object.assign(new Error(`No page at ${path}.`), { name: "NotFound" }));
  window.trainyard.settled = true;
}

document.addEventListener("click", (event) => {
  const a = event.target.closest("a[data-link]");
  if (!a || event.metaKey || event.ctrlKey || event.shiftKey || event.button !== 0) return;
  event.preventDefault();
  navigate(a.getAttribute("href"));
});
window.addEventListener("popstate", render);
document.getElementById("signout").addEventListener("click", () => showSignIn());
render();
