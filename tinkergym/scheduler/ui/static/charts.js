// A job's metrics as live charts: one small chart per number its "metrics" events carry (reward/mean, loss, ...),
// by step, with a table of the latest values beside them for readers who do not see the charts.

import uPlot from "./vendor/uPlot.esm.js";
import { el } from "./dom.js";

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

  destroy() {
    for (const { plot } of this.charts.values()) plot.destroy();
    this.reset();
  }
}

function format(value) {
  return Math.abs(value) >= 1e5 || (value !== 0 && Math.abs(value) < 1e-3) ? value.toExponential(3) : String(+value.toFixed(4));
}
