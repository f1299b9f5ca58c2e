// The scheduler's API as the page calls it: every call an ordinary one, with the key the user gave.

const KEY_ITEM = "tinkergym.apiKey";

/** The key of this tab (sessionStorage: it goes when the tab closes), or "". */
export function getKey() {
  return sessionStorage.getItem(KEY_ITEM) || "";
}

export function setKey(key) {
  sessionStorage.setItem(KEY_ITEM, key.trim());
}

export function forgetKey() {
  sessionStorage.removeItem(KEY_ITEM);
}

/** A refused call: its HTTP status and the scheduler's error message. */
export class ApiError extends Error {
  constructor(status, kind, message) {
    super(message);
    this.status = status;
    this.kind = kind;
  }
}

/** The API's URL for `path` ("v1/jobs"), relative to the page, so that a scheduler behind a path prefix works. */
export function apiUrl(path, query = {}) {
  const url = new URL("../" + path, document.baseURI);
  for (const [name, value] of Object.entries(query)) {
    if (value !== undefined && value !== null && value !== "") url.searchParams.set(name, String(value));
  }
  return url.toString();
}

/** fetch() with the key; answers the Response when it is 2xx, else throws an ApiError. */
export async function request(url, init = {}) {
  const headers = { ...(init.headers || {}), Authorization: `Bearer ${getKey()}` };
  const response = await fetch(url, { ...init, headers, cache: "no-store", credentials: "omit" });
  if (response.ok) return response;
  let kind = "http", message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error) ({ type: kind, message } = body.error);
  } catch { /* not JSON: keep the status line */ }
  throw new ApiError(response.status, kind, message);
}

export async function getJson(path, query) {
  return (await request(apiUrl(path, query))).json();
}

export async function postJson(path, body) {
  const response = await request(apiUrl(path), {
    method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
  });
  return response.json();
}

/** A job's id as one path segment. */
export function seg(part) {
  return encodeURIComponent(part);
}
