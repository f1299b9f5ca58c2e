// The jobs view: the tenant's jobs, newest first, filtered by state, a page at a time, refreshed every few seconds.
// (The API streams one job's events, not the list, so the list is read again: POLL_MS apart, while the tab is seen.)

import { getJson } from "./api.js";
import { age, el, say, stateBadge, timeCell } from "./dom.js";

/** The job states, in their order in the state machine (tinkergym.scheduler.states.STATES). */
export const STATES = ["queued", "leased", "starting", "running", "cancelling", "succeeded", "failed", "cancelled"];
export const POLL_MS = 5000;

export class JobsView {
  constructor(onUnauthorized) {
    this.onUnauthorized = onUnauthorized;
    this.root = document.getElementById("jobs-view");
    this.body = this.root.querySelector("#jobs-table tbody");
    this.stateFilter = document.getElementById("state-filter");
    this.pageSize = document.getElementById("page-size");
    this.prev = document.getElementById("prev-page");
    this.next = document.getElementById("next-page");
    for (const state of STATES) this.stateFilter.append(el("option", { value: state }, state));
    this.cursors = [null]; // the cursor of each page seen so far; the last is the page shown
    this.nextCursor = null;
    this.timer = null;
    this.stateFilter.addEventListener("change", () => this.restart());
    this.pageSize.addEventListener("change", () => this.restart());
    document.getElementById("refresh-jobs").addEventListener("click", () => this.load());
    this.prev.addEventListener("click", () => { if (this.cursors.length > 1) { this.cursors.pop(); this.load(); } });
    this.next.addEventListener("click", () => { if (this.nextCursor) { this.cursors.push(this.nextCursor); this.load(); } });
    document.addEventListener("visibilitychange", () => { if (!this.root.hidden && !document.hidden) this.load(); });
  }

  /** Shows the view with `state` filtered (from the address), from its first page. */
  show(state) {
    this.root.hidden = false;
    this.stateFilter.value = STATES.includes(state) ? state : "";
    this.cursors = [null];
    this.load();
  }

  hide() {
    this.root.hidden = true;
    clearTimeout(this.timer);
  }

  restart() {
    const state = this.stateFilter.value;
    const wanted = state ? `#/jobs?state=${encodeURIComponent(state)}` : "#/jobs";
    if (location.hash !== wanted) history.replaceState(null, "", wanted);
    this.cursors = [null];
    this.load();
  }

  async load() {
    clearTimeout(this.timer);
    const ticket = this.ticket = (this.ticket || 0) + 1; // a newer load (a click, a filter) wins over one in flight
    const cursor = this.cursors[this.cursors.length - 1];
    try {
      const page = await getJson("v1/jobs", { state: this.stateFilter.value, limit: this.pageSize.value, cursor });
      if (this.root.hidden || ticket !== this.ticket) return;
      this.render(page);
      say("");
    } catch (error) {
      if (error.status === 401) return this.onUnauthorized(error.message);
      if (ticket !== this.ticket) return;
      say(`Could not list jobs: ${error.message}`, true);
    }
    if (!this.root.hidden && ticket === this.ticket) this.timer = setTimeout(() => { if (!document.hidden) this.load(); }, POLL_MS);
  }

  render(page) {
    this.nextCursor = page.next_cursor;
    const rows = page.jobs.map((job) => el("tr", { "data-job": job.id },
      el("td", {}, el("a", { href: `#/jobs/${encodeURIComponent(job.id)}` }, job.name || job.id)),
      el("td", {}, stateBadge(job.state)),
      el("td", {}, job.kind),
      el("td", {}, (job.config && job.config.model) || ""),
      el("td", {}, job.attempt),
      el("td", {}, job.gpus),
      el("td", {}, timeCell(job.created_at, age(job.created_at))),
      el("td", {}, job.wait_reason ? job.wait_reason.message : ""),
    ));
    this.body.replaceChildren(...rows);
    document.getElementById("jobs-empty").hidden = rows.length > 0;
    this.prev.disabled = this.cursors.length <= 1;
    this.next.disabled = !this.nextCursor;
    document.getElementById("page-label").textContent = `Page ${this.cursors.length}`;
    document.getElementById("jobs-updated").textContent = `Updated ${new Date().toLocaleTimeString()}`;
  }
}
