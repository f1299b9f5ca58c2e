// A job's page: its facts, live metrics charts, recent transcripts, checkpoints (downloaded with the key) and event log,
// and Cancel. Events arrive on the job's event stream (GET /v1/jobs/{id}/events/stream) from the first one, so the page
// needs no polling: a state event reads the job again, a checkpoint event its checkpoints.

import { ApiError, apiUrl, getJson, postJson, request, seg } from "./api.js";
import { MetricCharts } from "./charts.js";
import { age, el, say, stateBadge, timeCell, when } from "./dom.js";
import { EventFollower } from "./sse.js";
import { TranscriptList, transcriptSummary } from "./transcripts.js";

const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
const CANCELLABLE = new Set(["queued", "leased", "starting", "running"]);
/** Events shown in the log at most (the newest); the charts keep every metrics event. */
export const MAX_LOG_ROWS = 500;

export class JobView {
  constructor(onUnauthorized) {
    this.onUnauthorized = onUnauthorized;
    this.root = document.getElementById("job-view");
    this.charts = new MetricCharts();
    this.transcripts = new TranscriptList();
    this.follower = null;
    this.events = [];
    this.lease = null;
    this.cancelButton = document.getElementById("cancel-job");
    this.confirm = document.getElementById("cancel-confirm");
    this.cancelButton.addEventListener("click", () => this.askCancel(true));
    document.getElementById("cancel-no").addEventListener("click", () => this.askCancel(false));
    document.getElementById("cancel-yes").addEventListener("click", () => this.cancel());
    this.showMetrics = document.getElementById("show-metrics-events");
    this.showMetrics.addEventListener("change", () => this.renderLog());
  }

  async show(jobId) {
    this.hide();
    this.root.hidden = false;
    this.jobId = jobId;
    this.job = null;
    this.events = [];
    this.lease = null;
    this.charts.reset();
    this.transcripts.reset();
    this.renderLog();
    document.getElementById("job-title").textContent = `Job ${jobId}`;
    document.getElementById("job-facts").replaceChildren();
    document.getElementById("checkpoints-table").hidden = true;
    this.askCancel(false);
    this.cancelButton.disabled = true;
    if (!(await this.refresh())) return;
    this.loadCheckpoints();
    this.follower = new EventFollower({
      url: apiUrl(`v1/jobs/${seg(jobId)}/events/stream`),
      after: 0,
      request,
      onEvent: (event) => this.onEvent(event),
      onStatus: (status, detail) => this.streamStatus(status, detail),
      onEnd: async () => {
        const job = await this.refresh();
        const again = Boolean(job) && !TERMINAL.has(job.state);
        this.streamStatus(again ? "reconnecting" : "ended", "");
        return again;
      },
    }).start();
  }

  hide() {
    this.root.hidden = true;
    if (this.follower) this.follower.stop();
    this.follower = null;
  }

  /** Reads the job again and shows it; the job, or null when it cannot be read. */
  async refresh() {
    const jobId = this.jobId;
    try {
      const job = await getJson(`v1/jobs/${seg(jobId)}`);
      if (jobId !== this.jobId || this.root.hidden) return null;
      this.job = job;
      this.renderJob();
      return job;
    } catch (error) {
      if (error.status === 401) this.onUnauthorized(error.message);
      else if (error.status === 404) say(`There is no job ${jobId} for this key.`, true);
      else say(`Could not read job ${jobId}: ${error.message}`, true);
      return null;
    }
  }

  renderJob() {
    const job = this.job;
    document.getElementById("job-title").textContent = `Job ${job.name || job.id}`;
    const facts = [
      ["State", stateBadge(job.state)],
      ["Id", job.id],
      ["Kind", job.kind],
      ["Model", (job.config && job.config.model) || ""],
      ["Attempt", job.attempt],
      ["Max attempts", job.max_attempts],
      ["Devices", this.lease ? `${job.gpus}${this.lease.seat !== undefined ? ` (seat ${this.lease.seat})` : ""}` : job.gpus],
      ["Priority", job.priority],
      ["Submitted", timeCell(job.created_at, `${when(job.created_at)} (${age(job.created_at)} ago)`)],
    ];
    if (job.finished_at) facts.push(["Finished", timeCell(job.finished_at, when(job.finished_at))]);
    if (job.queue_position) facts.push(["Queue position", job.queue_position]);
    if (job.wait_reason) facts.push(["Waiting for", job.wait_reason.message]);
    if (job.error) facts.push(["Error", job.error]);
    if (job.end_reason) facts.push(["Ended because", job.end_reason]);
    const dl = document.getElementById("job-facts");
    dl.replaceChildren(...facts.flatMap(([name, value]) => [el("dt", {}, name), el("dd", { "data-fact": name.toLowerCase() }, value)]));
    this.cancelButton.disabled = !CANCELLABLE.has(job.state);
    if (this.cancelButton.disabled) this.askCancel(false);
  }

  onEvent(event) {
    if (event.type === "transcript" && event.data) {
      this.transcripts.add(event.data);
      event = { ...event, data: transcriptSummary(event.data) }; // the log keeps its one line, not the episodes
    }
    this.events.push(event);
    if (event.type === "metrics" && event.data) this.charts.add(event.data, event.seq);
    if (event.type === "lease" && event.data) { this.lease = event.data; if (this.job) this.renderJob(); }
    if (event.type === "state") this.refresh();
    if (event.type === "checkpoint") this.loadCheckpoints();
    if (event.type !== "metrics" || this.showMetrics.checked) this.scheduleLog();
  }

  scheduleLog() {
    if (this.logPending) return;
    this.logPending = true;
    requestAnimationFrame(() => { this.logPending = false; this.renderLog(); });
  }

  renderLog() {
    const shown = this.showMetrics.checked ? this.events : this.events.filter((e) => e.type !== "metrics");
    const rows = shown.slice(-MAX_LOG_ROWS).reverse().map((e) => el("tr", { "data-seq": e.seq },
      el("td", {}, e.seq), el("td", {}, timeCell(e.created_at, new Date(e.created_at * 1000).toLocaleTimeString())),
      el("td", {}, e.type), el("td", { class: "data" }, typeof e.data === "string" ? e.data : JSON.stringify(e.data))));
    document.querySelector("#events-table tbody").replaceChildren(...rows);
  }

  async loadCheckpoints() {
    const jobId = this.jobId;
    try {
      const { checkpoints } = await getJson(`v1/jobs/${seg(jobId)}/checkpoints`);
      if (jobId !== this.jobId) return;
      const rows = checkpoints.map((c) => el("tr", { "data-checkpoint": c.name },
        el("td", {}, c.step), el("td", {}, c.name), el("td", {}, c.epoch), el("td", {}, timeCell(c.created_at, when(c.created_at))),
        el("td", {}, el("button", { type: "button", "data-list": c.name, "aria-expanded": "false" }, `List files of ${c.name}`))));
      document.querySelector("#checkpoints-table tbody").replaceChildren(...rows);
      document.getElementById("checkpoints-table").hidden = rows.length === 0;
      document.getElementById("checkpoints-empty").hidden = rows.length > 0;
      for (const button of document.querySelectorAll("#checkpoints-table button[data-list]")) {
        button.addEventListener("click", () => this.listFiles(button));
      }
    } catch (error) {
      if (error.status === 401) this.onUnauthorized(error.message);
      else say(`Could not list checkpoints: ${error.message}`, true);
    }
  }

  // A checkpoint's files, each a button that downloads it with the key (a plain link could not carry the key).
  async listFiles(button) {
    const name = button.dataset.list;
    try {
      const listing = await getJson(`v1/jobs/${seg(this.jobId)}/artifacts/${seg(name)}`);
      const list = el("ul", { class: "files" }, ...listing.files.map((f) => el("li", {},
        el("button", { type: "button", "data-file": f.path }, `Download ${f.path}`), ` ${f.size} bytes`)));
      for (const b of list.querySelectorAll("button[data-file]")) b.addEventListener("click", () => this.download(name, b.dataset.file));
      button.replaceWith(list);
    } catch (error) {
      if (error instanceof ApiError && error.status === 401) this.onUnauthorized(error.message);
      else say(`Could not list the files of ${name}: ${error.message}`, true);
    }
  }

  async download(name, path) {
    try {
      const url = apiUrl(`v1/jobs/${seg(this.jobId)}/artifacts/${seg(name)}/${path.split("/").map(seg).join("/")}`);
      const blob = await (await request(url)).blob();
      const link = el("a", { href: URL.createObjectURL(blob), download: path.split("/").pop() });
      document.body.append(link);
      link.click();
      link.remove();
      setTimeout(() => URL.revokeObjectURL(link.href), 60000);
      say(`Downloaded ${path} of ${name}.`);
    } catch (error) {
      say(`Could not download ${path}: ${error.message}`, true);
    }
  }

  askCancel(open) {
    this.confirm.hidden = !open;
    this.cancelButton.hidden = open;
    if (open) document.getElementById("cancel-no").focus();
  }

  async cancel() {
    this.askCancel(false);
    try {
      this.job = await postJson(`v1/jobs/${seg(this.jobId)}/cancel`, {});
      this.renderJob();
      say(`Job ${this.job.name || this.job.id} is ${this.job.state}.`);
    } catch (error) {
      if (error.status === 401) this.onUnauthorized(error.message);
      else say(`Could not cancel: ${error.message}`, true);
    }
    this.cancelButton.focus();
  }

  streamStatus(status, detail) {
    const text = { live: "Live: new events appear as they happen.", reconnecting: "Connection lost; reconnecting...",
                   ended: "The job has ended.", stopped: `Event stream stopped: ${detail}` }[status] || status;
    document.getElementById("stream-state").textContent = text;
  }
}
