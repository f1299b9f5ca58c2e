// A job's metrics as live charts: one small chart per number its "metrics" events carry (reward/mean, loss, ...),
// by step, with a table of the latest values beside them for readers who do not see the charts.

import uPlot from "./vendor/uPlot.esm.js";
import { el } from "./dom.js";

/** The stacked bars of each step's phases (see stepTime). */
const STEP_TIME = "step-time";
/** Charts drawn at most; further metrics are listed in the table alone. */
export const MAX_CHARTS = 24;
const WIDTH = 360, HEIGHT = 180;
const COLOURS = ["#0b57b0", "#a4161a", "#135e2b", "#6a3d9a", "#8a4b00", "#006c73"];

export class MetricCharts {
  constructor() {
    this.container = document.getElementById("charts");
    this.tableBody = document.querySelector("#metrics-table tbody");
    this.reset();
  }

  reset() {
    this.series = new Map(); // metric -> Map(step -> value)
    this.charts = new Map(); // metric -> {plot, figure}
    this.pending = false;
    this.container.replaceChildren();
    this.tableBody.replaceChildren();
    document.getElementById("metrics-table").hidden = true;
    document.getElementById("metrics-empty").hidden = false;
  }

  /** Takes one "metrics" event's data (numbers by name, and `step`); `seq` stands in for a missing step. */
  add(data, seq) {
    const step = Number.isFinite(data.step) ? data.step : seq;
    for (const [name, value] of Object.entries(data)) {
      if (name === "step" || typeof value !== "number" || !Number.isFinite(value)) continue;
      if (!this.series.has(name)) this.series.set(name, new Map());
      this.series.get(name).set(step, value); // a step run again (a resumed job) replaces its point
    }
    if (!this.pending) {
      this.pending = true;
      requestAnimationFrame(() => this.draw());
    }
  }

  draw() {
    this.pending = false;
    this.stepTime();
    const names = [...this.series.keys()].sort();
    document.getElementById("metrics-empty").hidden = names.length > 0;
    document.getElementById("metrics-table").hidden = names.length === 0;
    const rows = [];
    names.forEach((name, i) => {
      const points = [...this.series.get(name).entries()].sort((a, b) => a[0] - b[0]);
      const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
      const [lastStep, lastValue] = points[points.length - 1];
      rows.push(el("tr", { "data-metric": name },
        el("th", { scope: "row" }, name), el("td", {}, lastStep), el("td", {}, format(lastValue)), el("td", {}, points.length)));
      if (i < MAX_CHARTS) this.chart(name, i, xs, ys, `${points.length} points; latest ${format(lastValue)} at step ${lastStep}`);
    });
    this.tableBody.replaceChildren(...rows);
  }

  chart(name, index, xs, ys, summary) {
    let entry = this.charts.get(name);
    if (!entry) {
      const figure = el("figure", { class: "chart", role: "img", "data-metric": name });
      const caption = el("figcaption", {}, el("h4", {}, name));
      figure.append(caption);
      this.container.append(figure);
      const plot = new uPlot({
        width: WIDTH, height: HEIGHT,
        scales: { x: { time: false } },
        legend: { show: false },
        axes: [{ label: "step", stroke: "#1b1f24" }, { stroke: "#1b1f24", size: 60 }],
        series: [{ label: "step" }, { label: name, stroke: COLOURS[index % COLOURS.length], width: 2 }],
      }, [xs, ys], figure);
      entry = { plot, figure };
      this.charts.set(name, entry);
    } else {
      entry.plot.setData([xs, ys]);
    }
    entry.figure.setAttribute("aria-label", `${name} by step: ${summary}`);
    entry.figure.dataset.points = String(xs.length);
  }

  /** Where each step's time went, as stacked bars: its rollout (or, sampling ahead, the wait for it), its update, and the
   * rest of the step (advantages, metrics), from the `time/*` numbers every training step reports. */
  stepTime() {
    const step = this.series.get("time/step_s"), update = this.series.get("time/update_s");
    const rollout = this.series.get("time/rollout_s") || this.series.get("time/rollout_wait_s");
    if (!step || !update || !rollout) return;
    const xs = [...step.keys()].filter((x) => update.has(x) && rollout.has(x)).sort((a, b) => a - b);
    if (xs.length === 0) return;
    const low = xs.map((x) => rollout.get(x));
    const mid = xs.map((x, i) => low[i] + update.get(x));
    const top = xs.map((x, i) => Math.max(step.get(x), mid[i]));
    const last = xs.length - 1;
    const summary = `${xs.length} steps; step ${xs[last]}: rollout ${format(low[last])} s, update ${format(mid[last] - low[last])} s, ` +
      `other ${format(top[last] - mid[last])} s of ${format(top[last])} s`;
    let entry = this.charts.get(STEP_TIME);
    if (!entry) {
      const figure = el("figure", { class: "chart chart-wide", role: "img", "data-metric": STEP_TIME });
      figure.append(el("figcaption", {}, el("h4", {}, "where each step's time went (s)")));
      this.container.prepend(figure);
      const bars = uPlot.paths.bars({ size: [0.7, 40] });
      // Drawn back to front, each bar the sum of its part and those below it: the visible bands are the parts.
      const plot = new uPlot({
        width: WIDTH * 2, height: HEIGHT,
        scales: { x: { time: false }, y: { range: (_u, _min, max) => [0, max > 0 ? max * 1.1 : 1] } },  // bars stand on 0
        axes: [{ label: "step", stroke: "#1b1f24" }, { stroke: "#1b1f24", size: 60 }],
        series: [{ label: "step" },
          { label: "other", fill: "#9aa4ae", stroke: "#5b636b", paths: bars },
          { label: "update", fill: "#6a9fd8", stroke: "#0b57b0", paths: bars },
          { label: "rollout", fill: "#e0a45c", stroke: "#8a4b00", paths: bars }],
      }, [xs, top, mid, low], figure);
      entry = { plot, figure };
      this.charts.set(STEP_TIME, entry);
    } else {
      entry.plot.setData([xs, top, mid, low]);
    }
    entry.figure.setAttribute("aria-label", `where each step's time went: ${summary}`);
    entry.figure.dataset.points = String(xs.length);
  }

  destroy() {
    for (const { plot } of this.charts.values()) plot.destroy();
    this.reset();
  }
}

function format(value) {
  return Math.abs(value) >= 1e5 || (value !== 0 && Math.abs(value) < 1e-3) ? value.toExponential(3) : String(+value.toFixed(4));
}
