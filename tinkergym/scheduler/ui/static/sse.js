// Server-sent events read from a fetch() body: EventSource cannot send an Authorization header.

/** Parses the text/event-stream format (the WHATWG HTML standard's rules) fed in chunks of any size. */
export class SseParser {
  constructor() {
    this.buffer = "";
    this.data = [];
    this.type = "";
    this.lastId = null;
    this.retry = null;
    this.sawCr = false;
  }

  /** Feed decoded text; returns the events it completed: {id, type, data}. */
  feed(text) {
    if (this.sawCr && text.startsWith("\n")) text = text.slice(1); // a CRLF split across chunks
    this.sawCr = text.endsWith("\r");
    this.buffer += text;
    const done = [];
    const lines = this.buffer.split(/\r\n|\r|\n/);
    this.buffer = lines.pop();
    for (const line of lines) {
      const event = this.line(line);
      if (event) done.push(event);
    }
    return done;
  }

  line(line) {
    if (line === "") {
      if (this.data.length === 0) { this.type = ""; return null; }
      const event = { id: this.lastId, type: this.type || "message", data: this.data.join("\n") };
      this.data = [];
      this.type = "";
      return event;
    }
    if (line.startsWith(":")) return null; // a comment: the keep-alive
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "data") this.data.push(value);
    else if (field === "event") this.type = value;
    else if (field === "id" && !value.includes("\0")) this.lastId = value;
    else if (field === "retry" && /^\d+$/.test(value)) this.retry = Number(value);
    return null;
  }
}

/**
 * Follows an event stream: connects, hands each event to onEvent, and reconnects after a drop with the
 * Last-Event-ID it saw, so nothing is lost or repeated. When the server closes the stream (it does after the job's
 * terminal event, and when it shuts down) onEnd is awaited: it answers whether to connect again.
 * `request(url, init)` makes the authenticated fetch and answers the Response (throwing with .status on an error).
 */
export class EventFollower {
  constructor({ url, after = 0, request, onEvent, onStatus = () => {}, onEnd = async () => false, idleMs = 45000 }) {
    Object.assign(this, { url, request, onEvent, onStatus, onEnd, idleMs });
    this.lastId = String(after);
    this.retryMs = 1000;
    this.stopped = false;
    this.controller = null;
  }

  start() { this.loop(); return this; }

  stop() {
    this.stopped = true;
    if (this.controller) this.controller.abort();
  }

  async loop() {
    let failures = 0;
    while (!this.stopped) {
      let ended = false;
      try {
        ended = await this.once();
        failures = 0;
      } catch (error) {
        if (this.stopped) return;
        if (error && error.status && error.status < 500 && error.status !== 429) {
          this.onStatus("stopped", error.message);
          return; // 401, 403, 404: trying again will not help
        }
        failures += 1;
        this.onStatus("reconnecting", error && error.message ? error.message : String(error));
      }
      if (this.stopped) return;
      if (ended && !(await this.onEnd())) return;
      const wait = Math.min(30000, this.retryMs * 2 ** Math.min(failures, 5));
      await new Promise((resolve) => setTimeout(resolve, wait));
    }
  }

  // One connection; true when the server ended the stream after the job's last event.
  async once() {
    this.controller = new AbortController();
    const headers = { Accept: "text/event-stream", "Last-Event-ID": this.lastId };
    const response = await this.request(this.url, { headers, signal: this.controller.signal });
    this.onStatus("live", "");
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    const parser = new SseParser();
    let idle = null;
    const arm = () => {
      clearTimeout(idle);
      idle = setTimeout(() => this.controller.abort(), this.idleMs); // no byte, not even a keep-alive: a dead link
    };
    arm();
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return true; // the server closes the stream only after the job's terminal event
        arm();
        for (const event of parser.feed(value)) {
          if (event.id !== null) this.lastId = event.id;
          let body;
          try { body = JSON.parse(event.data); } catch { continue; }
          this.onEvent(body, event.type);
        }
        if (parser.retry !== null) this.retryMs = parser.retry;
      }
    } finally {
      clearTimeout(idle);
    }
  }
}
