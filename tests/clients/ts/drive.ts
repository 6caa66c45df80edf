// A whole run driven by a TypeScript client of the Trainyard API: openapi-fetch on the types
// openapi-typescript generated from /openapi.json (./trainyard.d.ts, written next to this
// file by the test). `tsc --strict` checks it against those types first, so the type
// assertions below are part of the test: if the document loses a type, this stops compiling.
//
//   node dist/drive.js BASE_URL API_KEY MODEL
//
// It creates a run, polls it until it completes (with If-None-Match), reads its trajectories,
// metrics, event stream and export, then creates a second run and cancels it, and prints
// what it saw as one JSON object.
import createClient from "openapi-fetch";

import type { components, paths } from "./trainyard.js";

type Schemas = components["schemas"];
type RunCreate = Schemas["RunCreate"];
type RunPublic = Schemas["RunPublic"];

// --- what the document must say, checked by the compiler ------------------------------------

// Request fields with defaults are optional: the two required ones are a whole request.
const minimal: RunCreate = { model_name: "m", task_description: "t" };
// Enums, not strings.
// @ts-expect-error: split is "train" | "validation"
const badSplit: Schemas["InputItem"] = { input_text: "x", split: "test" };
const errorType: NonNullable<Schemas["FieldError"]["type"]> = "inconsistent";
// @ts-expect-error: FieldError.type is an enum of the error types there are
const badErrorType: NonNullable<Schemas["FieldError"]["type"]> = "no_such_error_type";
// @ts-expect-error: an event's level is an enum
const badLevel: Schemas["RunEventPublic"]["level"] = "loud";
const eventType: Schemas["RunEventPublic"]["type"] = "checkpoint";
// Headers are documented.
type Created = paths["/runs"]["post"]["responses"][202];
const createdHeaders: Created["headers"] = { ETag: '"x"', "Idempotent-Replayed": "true" };
type RateLimited = paths["/runs"]["post"]["responses"][429];
const rateLimitedHeaders: RateLimited["headers"] = { "Retry-After": 1 };
// 503 (the database unreachable) is a documented problem.
type Unavailable = paths["/runs/{run_id}"]["get"]["responses"][503];
const unavailable: Unavailable["content"]["application/problem+json"]["status"] = 503;
// The event stream and the export are text, not JSON.
type Stream = paths["/runs/{run_id}/events/stream"]["get"]["responses"][200];
const streamText: Stream["content"]["text/event-stream"] = "retry: 2000\n\n";
type Export = paths["/trajectories/export"]["get"]["responses"][200];
const exportText: Export["content"]["application/x-ndjson"] = "{}\n";
void [minimal, badSplit, errorType, badErrorType, badLevel, eventType, createdHeaders];
void [rateLimitedHeaders, unavailable, streamText, exportText];

// An answer's run types reward, grpo and generator as precisely as the request does.
function settingsOf(run: RunPublic): { beta: number; rewardType: "ruler" | "rim" | "function" } {
  const beta: number = run.grpo.beta; // required in an answer: always there
  // A judge named from the catalog (endpoint) has no model of its own in the run.
  const judge: string | null | undefined = run.generator?.model;
  void judge;
  return { beta, rewardType: run.reward.type };
}

// --- the run ----------------------------------------------------------------------------------

const [base, key, model] = process.argv.slice(2);
if (!base || !key || !model) throw new Error("usage: node drive.js BASE_URL API_KEY MODEL");
const client = createClient<paths>({ baseUrl: base, headers: { Authorization: `Bearer ${key}` } });

function fail(what: string, error: unknown, response: Response): never {
  throw new Error(`${what}: ${response.status} ${JSON.stringify(error)}`);
}

const body: RunCreate = {
  model_name: model,
  task_description: "Answer with as many letters a as you can.",
  rollouts_per_group: 4,
  learning_rate: 5e-3,
  max_steps: 2,
  inputs: [{ input_text: "Say something." }, { input_text: "Sing.", split: "train" }],
  reward: { type: "function", functions: [{ name: "char_fraction", args: { char: "a" } }] },
  grpo: { groups_per_step: 2, max_completion_length: 8, beta: 0, warmup_ratio: 0 },
};

async function create(request: RunCreate, idempotencyKey: string) {
  const created = await client.POST("/runs", {
    body: request,
    params: { header: { "Idempotency-Key": idempotencyKey } },
  });
  if (!created.data) fail("create_run", created.error, created.response);
  return { run: created.data, response: created.response };
}

async function poll(runId: string, done: (run: RunPublic) => boolean): Promise<RunPublic> {
  let etag: string | undefined;
  let last: RunPublic | undefined;
  const deadline = Date.now() + 600_000; // only turns a hang into a failure
  for (;;) {
    const got = await client.GET("/runs/{run_id}", {
      params: { path: { run_id: runId }, header: etag ? { "If-None-Match": etag } : {} },
    });
    if (got.response.status !== 304) {
      if (!got.data) fail("get_run", got.error, got.response);
      last = got.data;
      etag = got.response.headers.get("ETag") ?? undefined;
      if (done(last)) return last;
    }
    if (Date.now() > deadline) throw new Error(`run ${runId} never got there: ${last?.status}`);
    await new Promise((resolve) => setTimeout(resolve, 250));
  }
}

const idempotencyKey = `ts-${Date.now()}`;
const { run: created, response: createdResponse } = await create(body, idempotencyKey);
const replay = await create(body, idempotencyKey);
const finished = await poll(created.id, (r) => ["completed", "failed", "cancelled"].includes(r.status));

const trajectories = await client.GET("/runs/{run_id}/trajectories", {
  params: { path: { run_id: created.id }, query: { limit: 100 } },
});
if (!trajectories.data) fail("list_run_trajectories", trajectories.error, trajectories.response);
const roles = new Set<Schemas["TrajectoryMessage-Output"]["role"]>();
for (const t of trajectories.data.data) for (const m of t.messages ?? []) roles.add(m.role);

const metrics = await client.GET("/runs/{run_id}/metrics", {
  params: { path: { run_id: created.id } },
});
if (!metrics.data) fail("get_run_metrics", metrics.error, metrics.response);

// The stream of a finished run: every event, then `end`; text, split here as SSE is.
const stream = await client.GET("/runs/{run_id}/events/stream", {
  params: { path: { run_id: created.id } },
  parseAs: "text",
});
if (stream.data === undefined) fail("stream_run_events", stream.error, stream.response);
const streamed = stream.data
  .split("\n\n")
  .flatMap((block) => block.split("\n").filter((line) => line.startsWith("event: ")))
  .map((line) => line.slice("event: ".length));

const exported = await client.GET("/trajectories/export", {
  params: { query: { run_id: [created.id] } },
  parseAs: "text",
});
if (exported.data === undefined) fail("export_trajectories", exported.error, exported.response);
const lines = exported.data.split("\n").filter((line) => line.length > 0);

const { run: second } = await create({ ...body, max_steps: 1000 }, `${idempotencyKey}-2`);
const cancel = await client.POST("/runs/{run_id}/cancel", {
  params: { path: { run_id: second.id } },
});
if (!cancel.data) fail("cancel_run", cancel.error, cancel.response);
const cancelled = await poll(second.id, (r) => r.status === "cancelled");

console.log(
  JSON.stringify({
    created: { id: created.id, status: created.status, etag: createdResponse.headers.get("ETag") },
    replayed: replay.response.headers.get("Idempotent-Replayed"),
    replayed_id: replay.run.id,
    finished: { status: finished.status, step: finished.step, error: finished.error },
    settings: settingsOf(finished),
    trajectories: trajectories.data.data.length,
    roles: [...roles].sort(),
    rewards: trajectories.data.data.map((t) => t.reward),
    metrics: metrics.data.series.map((s) => s.name),
    streamed,
    exported: lines.length,
    exported_run: lines.length ? (JSON.parse(lines[0] ?? "{}") as Schemas["TrajectoryPublic"]).run_id : null,
    cancel_answer: [cancel.data.status, cancel.data.cancel_requested],
    cancelled: cancelled.status,
  }),
);
