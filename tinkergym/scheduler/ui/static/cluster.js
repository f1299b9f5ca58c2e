// The cluster view (an operator key's: GET /v1/cluster): the workers and what each device holds, the leases ending
// soonest, the queue over time, and every tenant's usage beside its quotas. Heartbeats and leases move without job
// events, so this view reads the cluster again every REFRESH_MS while it is shown and the tab is seen.

import uPlot from "./vendor/uPlot.esm.js";
import { getJson } from "./api.js";
import { age, el, say, stateBadge } from "./dom.js";
import { bytes, hours } from "./jobs.js";

export const REFRESH_MS = 5000;

export class ClusterView {
  constructor(onUnauthorized) {
    this.onUnauthorized = onUnauthorized;
    this.root = document.getElementById("cluster-view");
    this.plot = null;
    this.timer = null;
    document.getElementById("refresh-cluster").addEventListener("click", () => this.load());
    document.addEventListener("visibilitychange", () => { if (!this.root.hidden && !document.hidden) this.load(); });
  }

  show() {
    this.root.hidden = false;
    this.load();
  }

  hide() {
    this.root.hidden = true;
    clearTimeout(this.timer);
  }

  async load() {
    clearTimeout(this.timer);
    const ticket = this.ticket = (this.ticket || 0) + 1;
    try {
      const cluster = await getJson("v1/cluster");
      if (this.root.hidden || ticket !== this.ticket) return;
      this.render(cluster);
      say("");
    } catch (error) {
      if (error.status === 401) return this.onUnauthorized(error.message);
      if (ticket !== this.ticket) return;
      say(error.status === 403 ? `This key is not an operator's: ${error.message}` : `Could not read the cluster: ${error.message}`, true);
      if (error.status === 403) return;
    }
    if (!this.root.hidden && ticket === this.ticket) this.timer = setTimeout(() => { if (!document.hidden) this.load(); }, REFRESH_MS);
  }

  render(cluster) {
    const now = cluster.now, q = cluster.queue;
    const queued = Object.values(q.queued).reduce((a, b) => a + b, 0), holding = Object.values(q.holding).reduce((a, b) => a + b, 0);
    document.getElementById("cluster-summary").textContent =
      `Workers: ${cluster.workers.length}; devices ${q.devices_held} held, ${q.devices_free} free; seats ${q.seats_held} held, ` +
      `${q.seats_free} free; ${queued} jobs queued, ${holding} holding devices.`;
    const rows = [];
    for (const worker of cluster.workers) {
      const status = worker.quarantined ? `quarantined: ${worker.quarantine_reason || ""}` : worker.status;
      const devices = worker.devices.length ? worker.devices : [null];
      devices.forEach((device, i) => {
        const holder = device && device.held_by;
        rows.push(el("tr", { "data-worker": worker.name, "data-device": device ? device.index : "" },
          i === 0 ? el("th", { scope: "rowgroup", rowspan: devices.length }, `${worker.name} (${worker.host})`) : null,
          i === 0 ? el("td", { rowspan: devices.length }, status) : null,
          i === 0 ? el("td", { rowspan: devices.length }, `${age(worker.last_seen_at, now)} ago`) : null,
          el("td", {}, device ? describe(device) : ""),
          el("td", {}, holder ? el("a", { href: `#/jobs/${encodeURIComponent(holder.job_id)}` }, holder.job_id) : "free"),
          el("td", {}, holder ? holder.tenant : ""),
          el("td", {}, holder && holder.lease_expires_at ? seconds(holder.lease_expires_at - now) : ""),
        ));
      });
    }
    document.querySelector("#workers-table tbody").replaceChildren(...rows);
    document.getElementById("workers-empty").hidden = cluster.workers.length > 0;
    document.querySelector("#ending-table tbody").replaceChildren(...cluster.ending.map((h) => el("tr", { "data-job": h.job_id },
      el("td", {}, el("a", { href: `#/jobs/${encodeURIComponent(h.job_id)}` }, h.job_id)),
      el("td", {}, h.tenant), el("td", {}, stateBadge(h.state)), el("td", {}, h.epoch),
      el("td", {}, seconds(h.lease_expires_at - now)))));
    document.querySelector("#usage-table tbody").replaceChildren(...cluster.tenants.map((t) => el("tr", { "data-tenant": t.tenant },
      el("th", { scope: "row" }, t.tenant),
      el("td", {}, `${t.queued} / ${t.max_queued}`),
      el("td", {}, `${t.devices_held} / ${t.max_gpus}`),
      el("td", {}, t.seats_held),
      el("td", { "data-device-seconds": t.device_seconds }, hours(t.device_seconds)),
      el("td", { "data-tokens": `${t.tokens_trained}/${t.tokens_sampled}` }, `${count(t.tokens_trained)} / ${count(t.tokens_sampled)}`),
      el("td", {}, `${bytes(t.artifact_bytes)} / ${bytes(t.max_artifact_bytes)}`),
      el("td", {}, t.events))));
    this.chart([...cluster.history, q]);
    document.getElementById("cluster-updated").textContent = `Updated ${new Date().toLocaleTimeString()}`;
  }

  /** Jobs queued and holding devices over time, the samples the scheduler kept and now. */
  chart(samples) {
    const xs = samples.map((s) => s.t);
    const sum = (o) => Object.values(o).reduce((a, b) => a + b, 0);
    const data = [xs, samples.map((s) => sum(s.queued)), samples.map((s) => sum(s.holding)), samples.map((s) => s.devices_held)];
    const container = document.getElementById("queue-chart");
    if (!this.plot) {
      const figure = el("figure", { class: "chart chart-wide", role: "img", id: "queue-figure" });
      figure.append(el("figcaption", {}, el("h4", {}, "jobs queued and holding, devices held")));
      container.replaceChildren(figure);
      this.plot = new uPlot({
        width: 720, height: 180,
        axes: [{ stroke: "#1b1f24" }, { stroke: "#1b1f24", size: 50 }],
        series: [{}, { label: "queued", stroke: "#8a4b00", width: 2 }, { label: "holding", stroke: "#0b57b0", width: 2 },
          { label: "devices held", stroke: "#135e2b", width: 2, dash: [6, 4] }],
      }, data, figure);
      this.figure = figure;
    } else {
      this.plot.setData(data);
    }
    const last = data.map((d) => d[d.length - 1]);
    this.figure.setAttribute("aria-label", `queue over time, ${xs.length} samples; now ${last[1]} queued, ${last[2]} holding, ${last[3]} devices held`);
    this.figure.dataset.points = String(xs.length);
  }
}

/** "gpu 0 cuda:0", "slot 0" (not "slot 0 slot 0": a name that already says the place is shown alone), "slot 1 seat 0 (tiny)". */
export function describe(device) {
  const seat = device.seat_of !== null && device.seat_of !== undefined;
  const place = seat ? `seat on device ${device.seat_of}` : `${device.kind} ${device.index}`;
  const name = device.name || "";
  // A seat's name says its device and seat ("slot 1 seat 0"); a worker's own name for a device often says its place too.
  const what = !name ? place : seat || name.includes(place) ? name : `${place} ${name}`;
  const shared = device.shared ? ` (${device.shared.model})` : "";
  return `${what}${shared}${device.active ? "" : ", inactive"}`;
}

function seconds(s) {
  return s <= 0 ? "ended" : `${Math.round(s)} s`;
}

/** "1.2 M" tokens. */
export function count(n) {
  return n >= 1e9 ? `${+(n / 1e9).toFixed(1)} G` : n >= 1e6 ? `${+(n / 1e6).toFixed(1)} M` : n >= 1e4 ? `${+(n / 1e3).toFixed(1)} k` : String(n);
}
