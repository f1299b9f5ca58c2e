// Building elements from data: text always goes in as text, never as markup.

/** An element: `el("a", {href: "#"}, "text", child)`; attributes that are null or false are left out. */
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (name === "class") node.className = value;
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

export function stateBadge(state) {
  return el("span", { class: `state state-${state}` }, state);
}

/** "3 s", "5 min", "2 h", "4 d" since `seconds` (a Unix time). */
export function age(seconds, now = Date.now() / 1000) {
  const s = Math.max(0, now - seconds);
  if (s < 60) return `${Math.floor(s)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min`;
  if (s < 86400) return `${Math.floor(s / 3600)} h`;
  return `${Math.floor(s / 86400)} d`;
}

export function when(seconds) {
  return new Date(seconds * 1000).toLocaleString();
}

/** A <time> element with the full date in its title and `text` shown. */
export function timeCell(seconds, text) {
  return el("time", { datetime: new Date(seconds * 1000).toISOString(), title: when(seconds) }, text);
}

export function say(message, isError = false) {
  const status = document.getElementById("status");
  status.textContent = message;
  status.classList.toggle("error", isError);
}
