// The dashboard: asks for a key, then shows the jobs (#/jobs), one job (#/jobs/<id>) or, for an operator key, the
// cluster (#/cluster), by the address's fragment.

import { ApiError, forgetKey, getJson, getKey, setKey } from "./api.js";
import { ClusterView } from "./cluster.js";
import { say } from "./dom.js";
import { JobView } from "./job.js";
import { JobsView } from "./jobs.js";

const keyView = document.getElementById("key-view");
const jobs = new JobsView(unauthorized);
const job = new JobView(unauthorized);
const cluster = new ClusterView(unauthorized);
let me = null; // GET /v1/me of the key in use: its tenant, and whether it is an operator's

/** What the key is (read once per key); null when it cannot be read. */
async function whoAmI() {
  if (me && me.forKey === getKey()) return me;
  try {
    me = { ...(await getJson("v1/me")), forKey: getKey() };
  } catch (error) {
    if (error.status === 401) { unauthorized(error.message); return null; }
    me = null;
  }
  return me;
}

/** The key was refused (revoked, mistyped): forget it and ask again. */
function unauthorized(message) {
  forgetKey();
  route();
  document.getElementById("key-error").textContent = `The scheduler refused the key: ${message}`;
}

function showKeyLabel() {
  const key = getKey();
  const id = key.match(/^tgk_([A-Za-z0-9]+)_/); // tgk_<id>_<secret>: the id alone is shown
  const who = me && me.forKey === key ? ` (tenant ${me.tenant}${me.operator ? ", operator" : ""})` : "";
  document.getElementById("key-label").textContent = (id ? `Key ${id[1]}` : "Key set") + who;
  document.getElementById("who").hidden = !key;
  document.getElementById("cluster-link").hidden = !(me && me.operator && me.forKey === key);
}

async function route() {
  jobs.hide();
  job.hide();
  cluster.hide();
  showKeyLabel();
  if (!getKey()) {
    keyView.hidden = false;
    document.title = "Sign in - tinkergym scheduler";
    document.getElementById("key-input").focus();
    return;
  }
  keyView.hidden = true;
  const ticket = route.ticket = (route.ticket || 0) + 1;
  const known = await whoAmI();
  if (ticket !== route.ticket || !getKey()) return; // another route ran meanwhile
  showKeyLabel();
  const hash = location.hash.replace(/^#/, "") || "/jobs";
  const [path, query] = hash.split("?");
  const one = path.match(/^\/jobs\/([^/]+)$/);
  if (one) {
    const id = decodeURIComponent(one[1]);
    document.title = `Job ${id} - tinkergym scheduler`;
    job.show(id);
  } else if (path === "/cluster") {
    document.title = "Cluster - tinkergym scheduler";
    cluster.show();
  } else {
    document.title = "Jobs - tinkergym scheduler";
    const params = new URLSearchParams(query || "");
    jobs.show(params.get("state") || "", params.get("tenant") || "", known);
  }
}

document.getElementById("key-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const input = document.getElementById("key-input");
  const error = document.getElementById("key-error");
  error.textContent = "";
  setKey(input.value);
  try {
    await getJson("v1/jobs", { limit: 1 }); // the key works and may read jobs
  } catch (problem) {
    forgetKey();
    error.textContent = problem instanceof ApiError && problem.status === 403
      ? `This key may not read jobs: ${problem.message}`
      : `The scheduler refused the key: ${problem.message}`;
    input.focus();
    return;
  }
  input.value = "";
  say("Signed in.");
  route();
  document.getElementById("main").focus();
});

document.getElementById("forget-key").addEventListener("click", () => {
  forgetKey();
  say("The key is forgotten in this tab.");
  route();
});

window.addEventListener("hashchange", route);
route();
