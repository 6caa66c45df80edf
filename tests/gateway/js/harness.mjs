// A harness on the official `openai` npm package: it claims a gateway run's episodes over
// plain HTTP and plays each through the episode's base URL, one plain call, one streamed.
// Usage: node harness.mjs URL KEY RUN_ID. Prints one JSON line per episode, then a summary.
import OpenAI from "openai";

const [url, key, runId] = process.argv.slice(2);
const ended = new Set(["completed", "failed", "cancelled"]);

async function post(path, body, token) {
  const answer = await fetch(`${url}${path}`, {
    method: "POST",
    headers: { Authorization: `Bearer ${token}`, "content-type": "application/json" },
    body: JSON.stringify(body),
  });
  if (!answer.ok) throw new Error(`${path}: ${answer.status} ${await answer.text()}`);
  return answer.json();
}

async function play(episode) {
  const client = new OpenAI({ baseURL: episode.base_url, apiKey: episode.token, maxRetries: 0 });
  const first = await client.chat.completions.create({
    model: "policy",
    messages: episode.messages,
    max_tokens: 8,
  });
  const messages = [...episode.messages, first.choices[0].message, { role: "user", content: "Again." }];
  const stream = await client.chat.completions.create({
    model: "policy",
    messages,
    stream: true,
    stream_options: { include_usage: true },
  });
  let text = "";
  let usage = null;
  for await (const chunk of stream) {
    text += chunk.choices[0]?.delta?.content ?? "";
    usage = chunk.usage ?? usage;
  }
  const models = await client.models.list();
  let refused = null;
  try {
    await client.chat.completions.create({ model: "policy", messages: [] });
  } catch (error) {
    refused = `${error.status} ${error.constructor.name}`;
  }
  const reward = text.length ? (text.split("a").length - 1) / text.length : 0;
  await post(`/episodes/${episode.id}/finish`, { reward }, episode.token);
  return { episode: episode.id, first: first.usage, streamed: usage, models: models.data.map((m) => m.id), refused };
}

let played = 0;
for (;;) {
  const { episodes, run_status } = await post(`/runs/${runId}/episodes/claim`, { max: 4, wait_seconds: 10 }, key);
  if (!episodes.length) {
    if (ended.has(run_status)) break;
    continue;
  }
  for (const line of await Promise.all(episodes.map(play))) {
    console.log(JSON.stringify(line));
    played += 1;
  }
}
console.log(JSON.stringify({ played }));
