// A job's recent transcripts: the "transcript" events its training run reports (a few episodes of a step: the first,
// the best and the worst, their messages cut short), newest first. Each episode is a <details> whose summary line says
// the step, reward and finish reason, and which opens to the conversation, each turn labelled with its role in text
// (System, User / env, Assistant, Tool call, Tool result) as well as by colour.
// The text is model-written and may be hostile: it goes into the page as text nodes (el()), never as markup.

import { el } from "./dom.js";

/** Transcript events (steps) shown at most: the newest, and any episode left open. */
export const MAX_TRANSCRIPTS = 20;
const TOOL_CALL = /<tool_call>\s*([\s\S]*?)\s*<\/tool_call>/g;
const TOOL_RESPONSE = /<tool_response>\s*([\s\S]*?)\s*<\/tool_response>/g;
const LABELS = { system: "System", observation: "User / env", assistant: "Assistant", "tool-call": "Tool call",
                 "tool-result": "Tool result", other: "Other" };

export class TranscriptList {
  /** Shows the list in `#transcripts` (index.html's, else a section made here, after the metrics). */
  constructor() {
    if (!document.querySelector('link[href="transcripts.css"]')) { // until index.html links it
      document.head.append(el("link", { rel: "stylesheet", href: "transcripts.css" }));
    }
    this.root = document.getElementById("transcripts") || makeSection();
    this.list = this.root.querySelector(".transcript-list");
    this.empty = this.root.querySelector(".transcripts-empty");
    this.reset();
  }

  reset() {
    this.steps = []; // one entry per event: the <details> of its episodes
    this.list.replaceChildren();
    this.empty.hidden = false;
  }

  /** Takes one "transcript" event's data; its episodes go first in the list. */
  add(data) {
    const episodes = Array.isArray(data && data.episodes) ? data.episodes : [];
    if (episodes.length === 0) return;
    const items = episodes.map((episode) => renderEpisode(data.step, episode));
    this.list.prepend(...items);
    this.steps.push(items);
    while (this.steps.length > MAX_TRANSCRIPTS) { // an episode the reader has opened stays until the page shows another job
      for (const item of this.steps.shift()) if (!item.querySelector("details").open) item.remove();
    }
    this.empty.hidden = true;
  }
}

/** One line for the event log: which episodes of which step the event holds (the Transcripts section shows them). */
export function transcriptSummary(data) {
  const episodes = Array.isArray(data && data.episodes) ? data.episodes : [];
  const which = episodes.map((e) => `${e.episode} (${(e.picked || []).join(", ")})`).join(", ");
  return `step ${data && data.step}: episodes ${which || "none"} of ${data && data.of} (shown under Transcripts)`;
}

function makeSection() {
  const section = el("section", { id: "transcripts", class: "transcripts", "aria-labelledby": "transcripts-title" },
    el("h3", { id: "transcripts-title" }, "Transcripts"),
    el("p", { class: "hint transcripts-empty" },
      "No transcripts reported yet: a training run sends a few episodes of each step it writes transcripts for."),
    el("ul", { class: "transcript-list", "aria-label": "Recent episodes, newest first" }));
  const after = document.getElementById("metrics-table");
  if (after) after.after(section);
  else document.getElementById("job-view").append(section);
  return section;
}

function number(value) {
  return typeof value === "number" && Number.isFinite(value) ? String(Number(value.toFixed(3))) : "none";
}

function renderEpisode(step, episode) {
  const picked = Array.isArray(episode.picked) && episode.picked.length ? ` (${episode.picked.join(", ")})` : "";
  const title = `Step ${step}, episode ${episode.episode}${picked}: reward ${number(episode.total_reward)}, ${episode.finish_reason || "unfinished"}`;
  const facts = [`Sampled tokens: ${number(episode.sampled_tokens)}`];
  if (Array.isArray(episode.rewards) && episode.rewards.length) facts.push(`rewards by turn: ${episode.rewards.map(number).join(", ")}`);
  const turns = (Array.isArray(episode.messages) ? episode.messages : []).flatMap(renderMessage);
  return el("li", {},
    el("details", { class: "transcript", "data-step": step, "data-episode": episode.episode },
      el("summary", {}, title),
      el("p", { class: "hint" }, facts.join("; ")),
      episode.error ? el("p", { class: "error" }, `Error: ${episode.error}`) : null,
      el("ol", { class: "conversation", "aria-label": `Conversation of step ${step}, episode ${episode.episode}` }, ...turns)));
}

/** A message as turns of the conversation: an assistant's text and each tool call it makes are turns of their own, as are
 * the tool results in an observation. */
function renderMessage(message) {
  if (!message || typeof message !== "object") return [];
  if (Number.isFinite(message.left_out)) {
    return [el("li", { class: "turn turn-gap", "data-role": "gap" }, `... ${message.left_out} messages left out ...`)];
  }
  const content = typeof message.content === "string" ? message.content : "";
  const role = String(message.role || "");
  const turns = [];
  if (role === "system") turns.push(["system", content]);
  else if (role === "user") turns.push(...split(content, TOOL_RESPONSE, "observation", "tool-result"));
  else if (role === "tool") turns.push(["tool-result", content]);
  else if (role === "assistant") turns.push(...split(content, TOOL_CALL, "assistant", "tool-call"));
  else turns.push(["other", content]);
  if (typeof message.tool_calls === "string" && message.tool_calls) turns.push(["tool-call", message.tool_calls]);
  const name = typeof message.name === "string" && message.name ? ` (${message.name})` : "";
  return turns.map(([kind, text]) => el("li", { class: `turn turn-${kind}`, "data-role": kind },
    el("span", { class: "turn-role" }, kind === "other" ? `${role || "no role"}${name}` : `${LABELS[kind]}${name}`),
    el("div", { class: "turn-text" }, text)));
}

/** `text` as [kind, text] parts: the blocks `pattern` finds as `blockKind`, the text around them as `kind`. */
function split(text, pattern, kind, blockKind) {
  const parts = [];
  let at = 0;
  for (const match of text.matchAll(pattern)) {
    const before = text.slice(at, match.index).trim();
    if (before) parts.push([kind, before]);
    parts.push([blockKind, match[1]]);
    at = match.index + match[0].length;
  }
  const rest = text.slice(at).trim();
  if (rest || parts.length === 0) parts.push([kind, rest]);
  return parts;
}
