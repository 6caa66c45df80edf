// A run's event stream (GET /runs/{id}/events/stream, Server-Sent Events) read with fetch().
//
// EventSource cannot send an Authorization header, so the stream is read from a
// ReadableStream and parsed here, as the HTML standard's event-stream rules say: lines end
// in \n, \r\n or \r; `field: value` (one optional space after the colon); `data` lines join
// with \n; a blank line dispatches; lines starting with `:` are comments (keep-alives).
// After a drop it reconnects after `retry` ms with `Last-Event-ID`, so every event arrives
// once; it stops after the server's `end` event (the run reached a terminal status).

import { authHeaders, failure } from "./api.js";

export class EventStream {
  /**
   * @param {string} runId
   * @param {{onEvent: (e: {id: string|null, type: string, data: any}) => void,
   *          onEnd?: (status: string|null) => void, onError?: (err: Error) => void,
   *          onState?: (state: string) => void}} handlers
   */
  constructor(runId, handlers) {
    this.runId = runId;
    this.handlers = handlers;
    this.lastEventId = null;
    this.retryMs = 1000; // the server's RETRY_MS (app/events/sse.py) until the stream says
    this.controller = null;
    this.closed = false;
    this.reconnects = 0;
  }

  start() {
    this.#loop();
    return this;
  }

  close() {
    this.closed = true;
    this.controller?.abort();
  }

  async #loop() {
    while (!this.closed) {
      let ended = false;
      try {
        ended = await this.#once();
      } catch (err) {
        if (this.closed) return;
        if (err.name === "SignInRequired" || err.name === "NotFound") {
          this.handlers.onError?.(err);
          return;
        }
        this.handlers.onState?.("reconnecting");
      }
      if (ended || this.closed) return;
      this.reconnects += 1;
      this.handlers.onState?.("reconnecting");
      await new Promise((resolve) => setTimeout(resolve, this.retryMs));
    }
  }

  /** One connection; true when the server said `end`. */
  async #once() {
    this.controller = new AbortController();
    const headers = authHeaders({ Accept: "text/event-stream" });
    if (this.lastEventId !== null) headers["Last-Event-ID"] = this.lastEventId;
    const response = await fetch(`/runs/${this.runId}/events/stream`, {
      headers,
      cache: "no-store",
      signal: this.controller.signal,
    });
    if (!response.ok) throw await failure(response);
    this.handlers.onState?.("live");
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    let event = { data: [], type: "", id: null };
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return false; // dropped before `end`: reconnect
      buffer += value;
      // Split off whole lines; a trailing \r may be half of \r\n, so keep it for next time.
      let start = 0;
      for (let i = 0; i < buffer.length; i++) {
        const c = buffer[i];
        if (c !== "\n" && c !== "\r") continue;
        if (c === "\r" && i === buffer.length - 1) break;
        const line = buffer.slice(start, i);
        if (c === "\r" && buffer[i + 1] === "\n") i++;
        start = i + 1;
        if (line === "") {
          if (this.#dispatch(event)) return true;
          event = { data: [], type: "", id: null };
          continue;
        }
        if (line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon === -1 ? line : line.slice(0, colon);
        let val = colon === -1 ? "" : line.slice(colon + 1);
        if (val.startsWith(" ")) val = val.slice(1);
        if (field === "data") event.data.push(val);
        else if (field === "event") event.type = val;
        else if (field === "id" && !val.includes("\0")) event.id = val;
        else if (field === "retry" && /^\d+$/.test(val)) this.retryMs = Number(val);
      }
      buffer = buffer.slice(start);
    }
  }

  /** Hands one parsed event on; true when it was `end`. */
  #dispatch(event) {
    if (event.id !== null) this.lastEventId = event.id;
    if (!event.data.length) return false;
    const text = event.data.join("\n");
    let data;
    try {
      data = JSON.parse(text);
    } catch {
      data = text;
    }
    const type = event.type || "message";
    if (type === "end") {
      this.closed = true;
      this.handlers.onEnd?.(data?.status ?? null);
      return true;
    }
    this.handlers.onEvent({ id: event.id, type, data });
    return false;
  }
}
