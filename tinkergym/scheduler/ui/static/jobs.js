// The jobs view: the key's jobs (an operator's: every tenant's), newest first, filtered by state and tenant, a page at a
// time, kept live by GET /v1/jobs/changes: the stream says when the jobs changed and the page reads its list again.
// Each (re)connection starts with a "changed", so the list is read afresh after a dropped stream; no timer polls.

import { apiUrl, getJson, request } from "./api.js";
import { age, el, say, stateBadge, timeCell } from "./dom.js";
import { EventFollower } from "./sse.js";

/** The job states, in their order in the state machine (tinkergym.scheduler.states.STATES). */
export const STATES = ["queued", "leased", "starting", "running", "cancelling", "succeeded", "failed", "cancelled"];
/** The least time between two reads of the list, however often the stream says it changed. */
export const MIN_GAP_MS = 500;

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
    this.tenantFilter = document.getElementById("tenant-filter");
    this.usage = document.getElementById("usage-line");
    this.liveLabel = document.getElementById("jobs-live");
    this.cursors = [null]; // the cursor of each page seen so far; the last is the page shown
    this.nextCursor = null;
    this.follower = null;
    this.loading = false; // a read of the list in flight
    this.dirty = false; // told of a change during that read: read again after it
    this.lastLoad = 0;
    this.timer = null;
    this.stateFilter.addEventListener("change", () => this.restart());
    this.pageSize.addEventListener("change", () => this.restart());
    this.tenantFilter.addEventListener("change", () => this.restart());
    document.getElementById("refresh-jobs").addEventListener("click", () => this.load());
    this.prev.addEventListener("click", () => { if (this.cursors.length > 1) { this.cursors.pop(); this.load(); } });
    this.next.addEventListener("click", () => { if (this.nextCursor) { this.cursors.push(this.nextCursor); this.load(); } });
  }

  /** Shows the view with `state` and `tenant` filtered (from the address), from its first page; `me` is GET /v1/me. */
  show(state, tenant, me) {
    this.root.hidden = false;
    this.me = me;
    this.stateFilter.value = STATES.includes(state) ? state : "";
    document.getElementById("tenant-filter-group").hidden = !(me && me.operator);
    document.getElementById("owner-column").hidden = !(me && me.operator);
    this.tenantFilter.value = me && me.operator ? tenant || "" : "";
    this.cursors = [null];
    this.follow(); // its first message reads the list
  }

  hide() {
    this.root.hidden = true;
    clearTimeout(this.timer);
    if (this.follower) this.follower.stop();
    this.follower = null;
  }

  follow() {
    if (this.follower) this.follower.stop();
    this.liveLabel.textContent = "Connecting...";
    this.follower = new EventFollower({
      url: apiUrl("v1/jobs/changes"), request,
      onEvent: (_body, type) => { if (type === "changed") this.changed(); },
      onStatus: (status, message) => {
        if (status === "stopped" && /401/.test(message)) this.onUnauthorized(message);
        this.liveLabel.textContent = status === "live" ? "Live" : status === "reconnecting" ? `Reconnecting (${message})` : `Not live: ${message}`;
        this.root.dataset.live = status;
      },
      onEnd: async () => !this.root.hidden, // the scheduler shut the stream (a restart): connect again
    }).start();
  }

  /** The stream says the jobs changed: read the list now, or once the read in flight ends, at most every MIN_GAP_MS. */
  changed() {
    if (this.loading) { this.dirty = true; return; }
    clearTimeout(this.timer);
    const wait = Math.max(0, this.lastLoad + MIN_GAP_MS - Date.now());
    this.timer = setTimeout(() => this.load(), wait);
  }

  restart() {
    const query = new URLSearchParams();
    if (this.stateFilter.value) query.set("state", this.stateFilter.value);
    if (this.tenantFilter.value.trim()) query.set("tenant", this.tenantFilter.value.trim());
    const wanted = query.toString() ? `#/jobs?${query}` : "#/jobs";
    if (location.hash !== wanted) history.replaceState(null, "", wanted);
    this.cursors = [null];
    this.load();
  }

  async load() {
    clearTimeout(this.timer);
    const ticket = this.ticket = (this.ticket || 0) + 1; // a newer load (a click, a filter) wins over one in flight
    const cursor = this.cursors[this.cursors.length - 1];
    this.loading = true;
    this.dirty = false;
    this.lastLoad = Date.now();
    try {
      const tenant = this.tenantFilter.value.trim();
      const [page, usage] = await Promise.all([
        getJson("v1/jobs", { state: this.stateFilter.value, limit: this.pageSize.value, cursor, tenant }),
        getJson("v1/usage").catch(() => null),
      ]);
      if (this.root.hidden || ticket !== this.ticket) return;
      this.render(page);
      this.renderUsage(usage);
      say("");
    } catch (error) {
      if (error.status === 401) return this.onUnauthorized(error.message);
      if (ticket !== this.ticket) return;
      say(`Could not list jobs: ${error.message}`, true);
    } finally {
      if (ticket === this.ticket) {
        this.loading = false;
        if (this.dirty && !this.root.hidden) this.changed();
      }
    }
  }

  /** The key's tenant's usage beside its quotas (an operator's: the cluster view has every tenant's). */
  renderUsage(usage) {
    const mine = usage && this.me && usage.tenants.find((t) => t.tenant === this.me.tenant);
    this.usage.hidden = !mine;
    if (!mine) return;
    this.usage.textContent = `Tenant ${mine.tenant}: ${mine.queued} of ${mine.max_queued} queued jobs, ` +
      `${mine.devices_held} of ${mine.max_gpus} devices held` + (mine.seats_held ? ` and ${mine.seats_held} seats` : "") +
      `, ${hours(mine.device_seconds)} device-hours used, ${mine.tokens_trained} tokens trained and ${mine.tokens_sampled} sampled, ` +
      `${bytes(mine.artifact_bytes)} of ${bytes(mine.max_artifact_bytes)} stored.`;
  }

  /** Shows `rows`, keeping the rows and cells already shown that did not change: the list reads itself again whenever a
   * job changes, and a row replaced under the pointer would lose the click on its link that had begun (mouse down on the
   * old link, up on the new one is no click). */
  keepRows(rows) {
    const shown = new Map([...this.body.children].map((tr) => [tr.dataset.job, tr]));
    const kept = rows.map((row) => {
      const before = shown.get(row.dataset.job);
      if (!before || before.children.length !== row.children.length) return row;
      before.dataset.state = row.dataset.state;
      [...row.children].forEach((cell, i) => {
        if (before.children[i].outerHTML !== cell.outerHTML) before.children[i].replaceWith(cell);
      });
      return before;
    });
    const same = kept.length === this.body.children.length && kept.every((tr, i) => this.body.children[i] === tr);
    if (!same) this.body.replaceChildren(...kept);
  }

  render(page) {
    this.nextCursor = page.next_cursor;
    const operator = this.me && this.me.operator;
    const rows = page.jobs.map((job) => el("tr", { "data-job": job.id, "data-state": job.state },
      el("td", {}, el("a", { href: `#/jobs/${encodeURIComponent(job.id)}` }, job.name || job.id)),
      operator ? el("td", { "data-owner": job.tenant }, job.tenant) : null,
      el("td", {}, stateBadge(job.state)),
      el("td", { "data-position": job.queue_position ?? "" }, job.queue_position ?? ""),
      el("td", {}, job.kind),
      el("td", {}, (job.config && job.config.model) || ""),
      el("td", {}, job.attempt),
      el("td", { "data-seat": job.seat ?? "" }, job.seat ? "a shared server's seat" : job.gpus),
      el("td", {}, timeCell(job.created_at, age(job.created_at))),
      el("td", {}, job.wait_reason ? job.wait_reason.message : ""),
    ));
    this.keepRows(rows);
    document.getElementById("jobs-empty").hidden = rows.length > 0;
    this.prev.disabled = this.cursors.length <= 1;
    this.next.disabled = !this.nextCursor;
    document.getElementById("page-label").textContent = `Page ${this.cursors.length}`;
    document.getElementById("jobs-updated").textContent = `Updated ${new Date().toLocaleTimeString()}`;
  }
}

/** "0.25" device-hours from seconds. */
export function hours(seconds) {
  return String(+(seconds / 3600).toFixed(seconds < 36 ? 4 : 2));
}

/** "1.5 GiB" from bytes. */
export function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${+n.toFixed(1)} ${units[i]}`;
}
