"""The dashboard (``/ui/``) in headless Chromium against a live scheduler on 127.0.0.1 (SQLite).

A tenant enters its key and sees its jobs, filters them and opens one; the job's metrics chart gains a point for each
``metrics`` event a worker reports while the page is open (the event stream, read with ``fetch``), its checkpoint's
file downloads with the key, and Cancel moves it through ``cancelling`` to ``cancelled`` as the worker reports it.
Another tenant's key sees none of it. The files are served without a key and with a content security policy; nothing
else becomes public. axe-core (vendored beside this file, MPL-2.0) checks each view for accessibility violations.

Screenshots go to ``$TINKERGYM_SCREENSHOTS`` (a folder) when set, else to the test's ``tmp_path``. Where Chromium or the
``playwright`` package is missing the test is skipped, saying why, except in CI (``CI`` set), where it fails: ``make
install`` installs both (``make browser``, the ``dev`` extra).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tinkergym.client import SchedulerClient
from tinkergym.scheduler import states
from tinkergym.scheduler.app import SchedulerSettings, create_app
from tinkergym.serve.asgi import ThreadServer
from workerkit import auth, register  # registered by conftest.py

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--no-first-run"]
AXE = Path(__file__).with_name("axe") / "axe.min.js"
TIMEOUT_MS = 15_000


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _unavailable(problem: str) -> None:
    if in_ci():
        pytest.fail(f"{problem}; CI runs the dashboard's browser test", pytrace=False)
    pytest.skip(problem)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's chromium driven by playwright (never a downloaded browser)."""
    executable = shutil.which("chromium")
    if executable is None:
        _unavailable("chromium is not installed: run `make browser` (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("the playwright package is not installed: run `make install` (the dev extra has it)")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("TINKERGYM_SCREENSHOTS") or tmp_path / "screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def server(db_url: str, tmp_path: Path) -> Iterator[ThreadServer]:
    served = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", sse_poll_s=0.05)))
    try:
        yield served
    finally:
        served.stop()


def check_accessible(page: Any, view: str) -> None:
    """axe-core's WCAG 2 A/AA rules over the page as shown: no violations."""
    if not page.evaluate("() => typeof window.axe === 'object'"):
        page.evaluate(AXE.read_text(encoding="utf-8"))  # through the debugging protocol: the page's policy refuses inline scripts
    found = page.evaluate("""async () => {
        const result = await axe.run(document, {runOnly: {type: "tag", values: ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa"]}});
        return result.violations.map(v => ({id: v.id, impact: v.impact, help: v.help, nodes: v.nodes.map(n => n.target.join(" ")).slice(0, 5)}));
    }""")
    assert found == [], f"accessibility violations in the {view}: {found}"


def sign_in(page: Any, url: str, key: str) -> None:
    page.goto(f"{url}/ui/")
    page.get_by_label("API key", exact=True).fill(key)
    page.get_by_role("button", name="Use this key").click()
    page.locator("#jobs-view").wait_for(state="visible")


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_dashboard_in_a_browser(browser: Any, server: ThreadServer, keys: Any, shots: Path) -> None:
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    owner, stranger, worker_key = keys.new("acme"), keys.new("globex"), keys.worker(4)
    with SchedulerClient(server.url, owner) as client:
        running = client.submit("train", {"model": "tiny"}, name="reward-run")
        queued = client.submit("train", {"model": "tiny"}, name="waiting-run", gpus=1, priority=-1)
    http = httpx.Client(base_url=server.url, timeout=30)
    worker = register(http, worker_key, devices=1)
    lease = worker.lease()
    assert lease is not None and lease["job_id"] == running["id"]
    epoch = lease["epoch"]
    assert worker.state(running["id"], epoch, "starting").status_code == 200
    assert worker.state(running["id"], epoch, "running", server_url="http://127.0.0.1:9").status_code == 200

    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    page.on("response", lambda r: problems.append(f"{r.status} {r.request.method} {r.url}") if r.status >= 400 else None)
    page.on("console", lambda message: problems.append(f"console {message.type}: {message.text}") if message.type == "error" else None)
    try:
        # The key form first; a refused key says so and is not kept.
        page.goto(f"{server.url}/ui/")
        expect(page.get_by_role("heading", name="Sign in with an API key")).to_be_visible()
        check_accessible(page, "sign-in form")
        page.get_by_label("API key", exact=True).fill("tgk_000000000000_" + "A" * 43)
        page.get_by_role("button", name="Use this key").click()
        expect(page.locator("#key-error")).to_contain_text("refused")
        assert page.evaluate("() => sessionStorage.length") == 0
        problems.clear()  # the browser logs the refused call (401) as an error

        # The tenant's jobs, newest first, and the state filter.
        sign_in(page, server.url, owner)
        assert page.evaluate("() => Object.keys(sessionStorage)") == ["tinkergym.apiKey"]
        assert page.evaluate("() => localStorage.length") == 0
        rows = page.locator("#jobs-table tbody tr")
        expect(rows).to_have_count(2)
        expect(rows.nth(0)).to_contain_text("waiting-run")
        expect(page.locator(f'tr[data-job="{running["id"]}"]')).to_contain_text("running")
        expect(page.locator(f'tr[data-job="{running["id"]}"]')).to_contain_text("tiny")
        options = page.locator("#state-filter option").evaluate_all("options => options.map(o => o.value)")
        assert options == ["", *states.STATES], "the page's states are the scheduler's"
        page.get_by_label("State", exact=True).select_option("queued")
        expect(rows).to_have_count(1)
        expect(rows.nth(0)).to_contain_text("waiting-run")
        assert page.url.endswith("#/jobs?state=queued")
        page.get_by_label("State", exact=True).select_option("")
        expect(rows).to_have_count(2)
        expect(page.locator("#who")).to_contain_text(f"Key {owner.split('_')[1]}")

        # Pages, by the API's cursors: 11 jobs at 10 a page. The list reads itself again when its stream says so.
        expect(page.locator("#jobs-live")).to_have_text("Live")
        with SchedulerClient(server.url, owner) as client:
            extra = [client.submit("eval", {"model": "tiny"}, name=f"batch-{i}")["id"] for i in range(9)]
        expect(rows).to_have_count(11)
        page.get_by_label("Per page", exact=True).select_option("10")
        expect(rows).to_have_count(10)
        expect(rows.nth(0)).to_contain_text("batch-8")
        page.get_by_role("button", name="Next page").click()
        expect(rows).to_have_count(1)
        expect(rows.nth(0)).to_contain_text("reward-run")
        expect(page.get_by_role("button", name="Next page")).to_be_disabled()
        page.get_by_role("button", name="Previous page").click()
        expect(rows).to_have_count(10)
        # A reread keeps the nodes of what did not change: a click begun on a link is not lost to a row replaced under it.
        link = f'tr[data-job="{queued["id"]}"] a'
        page.evaluate("css => { document.querySelector(css).kept = true; }", link)  # a property of the node, not of its HTML
        with SchedulerClient(server.url, owner) as client:
            for job_id in extra:
                client.cancel(job_id)
        expect(page.locator(f'tr[data-job="{extra[0]}"] .state-cancelled')).to_be_visible()  # told by the list's stream
        expect(page.locator(f'tr[data-job="{extra[-1]}"] .state-cancelled')).to_be_visible()
        assert page.evaluate("css => document.querySelector(css).kept === true", link), "the list replaced a row that did not change"
        page.get_by_label("State", exact=True).select_option("cancelled")
        expect(rows).to_have_count(9)
        page.get_by_label("State", exact=True).select_option("")
        page.get_by_label("Per page", exact=True).select_option("50")
        page.screenshot(path=str(shots / "jobs.png"), full_page=True)
        check_accessible(page, "jobs view")

        # The running job's page: a chart per metric, gaining points as the worker reports them.
        page.get_by_role("link", name="reward-run").click()  # the page's own events stream from here
        expect(page.locator("#job-title")).to_have_text("Job reward-run")
        expect(page.locator("#stream-state")).to_contain_text("Live")
        expect(page.locator('#job-facts dd[data-fact="devices"]')).to_have_text("1")  # whole devices: a seat shows only for a shared one
        reward = page.locator('figure[data-metric="reward/mean"]')
        for step in range(1, 4):
            answer = worker.post(f"/jobs/{running['id']}/events",
                                 {"epoch": epoch, "type": "metrics", "data": {"step": step, "reward/mean": 0.2 * step, "loss": 3.0 / step}})
            assert answer.status_code == 200, answer.text
            expect(reward).to_have_attribute("data-points", str(step))
        expect(page.locator('figure[data-metric="loss"]')).to_have_attribute("data-points", "3")
        expect(reward.locator("canvas")).to_have_count(1)
        expect(page.locator('#metrics-table tr[data-metric="reward/mean"]')).to_contain_text("0.6")
        # The client's own report, the other way metrics reach the stream; with a step's phase times, the stacked bars of
        # where its time went.
        step_time = page.locator('figure[data-metric="step-time"]')
        expect(step_time).to_have_count(0)  # no step reported its time yet
        with SchedulerClient(server.url, owner) as client:
            client.report(running["id"], "metrics", {"step": 4, "reward/mean": 0.9, "time/step_s": 2.0, "time/rollout_s": 1.25,
                                                     "time/update_s": 0.5})
        expect(reward).to_have_attribute("data-points", "4")
        expect(step_time).to_have_attribute("data-points", "1")
        expect(step_time).to_have_attribute("aria-label", re.compile(r"step 4: rollout 1\.25 s, update 0\.5 s, other 0\.25 s of 2 s"))
        step_time.screenshot(path=str(shots / "step-time.png"))

        # A checkpoint the worker uploads and records appears, and its file downloads with the key.
        content = b'{"step": 4}'
        upload = http.put(f"/v1/workers/{worker.id}/jobs/{running['id']}/artifacts/step_000004/state.json", content=content,
                          params={"epoch": epoch, "sha256": hashlib.sha256(content).hexdigest()}, headers=auth(worker_key))
        assert upload.status_code == 200, upload.text
        assert worker.post(f"/jobs/{running['id']}/checkpoints", {"epoch": epoch, "step": 4, "name": "step_000004"}).status_code == 200
        page.get_by_role("button", name="List files of step_000004").click()
        with page.expect_download() as download:
            page.get_by_role("button", name="Download state.json").click()
        assert Path(download.value.path()).read_bytes() == content
        expect(page.locator("#events-table tbody tr").first).to_contain_text("checkpoint")
        page.screenshot(path=str(shots / "job-running.png"), full_page=True)
        check_accessible(page, "job page")

        # Cancel: cancelling at once, cancelled when the worker has stopped it (the stream shows it, then ends).
        page.get_by_role("button", name="Cancel job").click()
        page.get_by_role("button", name="Yes, cancel it").click()
        expect(page.locator('#job-facts dd[data-fact="state"]')).to_have_text("cancelling")
        assert worker.heartbeat(running["id"], epoch).json()["cancelling"] is True
        assert worker.state(running["id"], epoch, "cancelled").status_code == 200
        expect(page.locator('#job-facts dd[data-fact="state"]')).to_have_text("cancelled")
        expect(page.locator("#stream-state")).to_have_text("The job has ended.")
        expect(page.get_by_role("button", name="Cancel job")).to_be_disabled()
        page.screenshot(path=str(shots / "job-cancelled.png"), full_page=True)

        # A queued job cancels at once.
        page.get_by_role("link", name="All jobs").click()
        page.get_by_role("link", name="waiting-run").click()
        expect(page.locator('#job-facts dd[data-fact="state"]')).to_have_text("queued")
        page.get_by_role("button", name="Cancel job").click()
        page.get_by_role("button", name="Yes, cancel it").click()
        expect(page.locator('#job-facts dd[data-fact="state"]')).to_have_text("cancelled")
        with SchedulerClient(server.url, owner) as client:
            assert client.show(queued["id"])["state"] == "cancelled"
        page.get_by_role("link", name="All jobs").click()
        expect(page.locator("#jobs-table tbody .state-cancelled")).to_have_count(11)
        assert problems == [], "\n".join(problems)

        # Another tenant: no jobs, and the first tenant's job is not found.
        page.get_by_role("button", name="Forget key").click()
        expect(page.get_by_role("heading", name="Sign in with an API key")).to_be_visible()
        assert page.evaluate("() => sessionStorage.length") == 0
        sign_in(page, server.url, stranger)
        expect(page.locator("#jobs-empty")).to_be_visible()
        expect(page.locator("#jobs-table tbody tr")).to_have_count(0)
        page.goto(f"{server.url}/ui/#/jobs/{running['id']}")
        expect(page.locator("#status")).to_contain_text(f"There is no job {running['id']}")
        expect(page.locator("#job-facts dt")).to_have_count(0)
        page.screenshot(path=str(shots / "other-tenant.png"), full_page=True)
    finally:
        context.close()
        http.close()


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_job_its_client_ended_says_why(browser: Any, server: ThreadServer, keys: Any) -> None:
    """The reason a client gave when it completed its job (the Tinker front door: its session ended, and why) is a fact of
    the job's page."""
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    owner, worker_key = keys.new("acme"), keys.worker(1)
    why = "its Tinker session ended: no heartbeat from the client for 180 s"
    with SchedulerClient(server.url, owner) as client, httpx.Client(base_url=server.url, timeout=30) as http:
        job = client.submit("train", {"model": "tiny"}, name="tinker run")
        worker = register(http, worker_key, devices=1)
        epoch = worker.lease()["epoch"]
        assert worker.state(job["id"], epoch, "starting").status_code == 200
        assert worker.state(job["id"], epoch, "running", server_url="http://127.0.0.1:9").status_code == 200
        client.complete(job["id"], epoch, reason=why)
    page = browser.new_page()
    try:
        sign_in(page, server.url, owner)
        page.get_by_role("link", name="tinker run").click()
        expect(page.locator('#job-facts dd[data-fact="state"]')).to_have_text("succeeded")
        expect(page.locator('#job-facts dd[data-fact="ended because"]')).to_have_text(why)
    finally:
        page.close()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_only_the_dashboard_files_are_public(server: ThreadServer) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        page = http.get("/ui/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert page.headers["x-content-type-options"] == "nosniff"
        assert http.get("/ui/", headers={"If-None-Match": page.headers["etag"]}).status_code == 304
        redirect = http.get("/ui")
        assert redirect.status_code == 307 and redirect.headers["location"] == "/ui/"
        for method in ("GET", "HEAD"):  # the scheduler's own address leads to the dashboard, which asks for a key itself
            root = http.request(method, "/")
            assert root.status_code == 307 and root.headers["location"] == "/ui/" and root.content == b"", method
        assert http.post("/", json={}).status_code == 405  # the root is a redirect and nothing else
        assert http.get("/", follow_redirects=True).headers["content-type"].startswith("text/html")
        for name, media_type in (("app.js", "text/javascript"), ("style.css", "text/css"), ("vendor/uPlot.esm.js", "text/javascript"),
                                 ("vendor/uPlot.LICENSE", "text/plain")):
            answer = http.get(f"/ui/{name}")
            assert answer.status_code == 200 and answer.headers["content-type"].startswith(media_type), name
        assert http.head("/ui/app.js").status_code == 200
        assert http.get("/ui/nothing.js").status_code == 404
        assert http.get("/ui/%2e%2e/v1/jobs").status_code == 404  # answered by the files alone, never routed on
        for hostile in ("/ui/%2e%2e/metrics", "/ui/app.js%00", "/ui/%ED%A0%80", "/ui/" + "a" * 5000, "/ui/vendor/../app.js%2f.."):
            assert http.get(hostile).status_code in (400, 404, 414), hostile  # a NUL, a lone surrogate, a huge name: no file, no route
        assert http.post("/ui/", json={}).status_code == 405
        for path in ("/v1/jobs", "/uix", "/metrics", "/v1/workers"):
            assert http.get(path).status_code == 401, path


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_event_stream_parser(browser: Any, server: ThreadServer) -> None:
    """The page's SSE parser: fields split across chunks, CRLF, comments, multi-line data, ids kept across events."""
    page = browser.new_page()
    try:
        page.goto(f"{server.url}/ui/")
        events = page.evaluate("""async () => {
            const { SseParser } = await import("./sse.js");
            const parser = new SseParser();
            const out = [];
            for (const chunk of ["retry: 1000\\n\\n: keep-alive\\n\\nid: 7\\nevent: met", "rics\\r", "\\ndata: {\\"a\\":", "1}\\r\\n\\r\\n",
                                 "data: x\\ndata: y\\n\\n"]) {
                out.push(...parser.feed(chunk));
            }
            return { out, retry: parser.retry };
        }""")
        assert events == {"out": [{"id": "7", "type": "metrics", "data": '{"a":1}'}, {"id": "7", "type": "message", "data": "x\ny"}],
                          "retry": 1000}
    finally:
        page.close()


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_cluster_view_names_each_device_once(browser: Any, server: ThreadServer) -> None:
    """A device's name is shown beside its place unless it already says it: "slot 0", not "slot 0 slot 0"."""
    page = browser.new_page()
    try:
        page.goto(f"{server.url}/ui/")
        shown = page.evaluate("""async () => {
            const { describe } = await import("./cluster.js");
            const device = (extra) => ({ index: 0, kind: "slot", name: "", active: true, seat_of: null, shared: null, ...extra });
            return [device({ name: "slot 0" }), device({ name: "ray cpu slot 0" }), device({ kind: "gpu", name: "cuda:0" }), device({}),
                    device({ index: 1024, name: "slot 1 seat 0", seat_of: 1, shared: { model: "tiny" } }),
                    device({ index: 1025, seat_of: 1, active: false })].map(describe);
        }""")
        assert shown == ["slot 0", "ray cpu slot 0", "gpu 0 cuda:0", "slot 0", "slot 1 seat 0 (tiny)", "seat on device 1, inactive"]
    finally:
        page.close()


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_event_stream_resumes_after_a_drop(browser: Any, server: ThreadServer, keys: Any) -> None:
    """The page's stream follower, its first connection cut after two events: it reconnects with Last-Event-ID and
    gets every event once, then stops when the stream ends after the job's terminal event."""
    owner = keys.new("acme")
    with SchedulerClient(server.url, owner) as client:
        job = client.submit("train", {"model": "tiny"}, name="cut")
        for i in range(3):
            client.report(job["id"], "log", {"message": f"line {i}"})
        client.cancel(job["id"])
        expected = [e["seq"] for e in client.events(job["id"])]
    page = browser.new_page()
    try:
        page.goto(f"{server.url}/ui/")
        page.evaluate("key => sessionStorage.setItem('tinkergym.apiKey', key)", owner)
        got = page.evaluate("""async (jobId) => {
            const { EventFollower } = await import("./sse.js");
            const { apiUrl, request } = await import("./api.js");
            const sent = [], seqs = [];
            const cut = async (url, init) => {
                sent.push(init.headers["Last-Event-ID"]);
                const response = await request(url, init);
                if (sent.length > 1) return response;
                const reader = response.body.getReader();
                let ids = 0;
                const body = new ReadableStream({ async pull(controller) {  // the real bytes, then a dropped link
                    if (ids >= 2) { reader.cancel(); controller.error(new TypeError("connection reset")); return; }
                    const { value, done } = await reader.read();
                    if (done) { controller.close(); return; }
                    ids += (new TextDecoder().decode(value).match(/^id: /gm) || []).length;
                    controller.enqueue(value);
                } });
                return new Response(body, { headers: response.headers });
            };
            await new Promise((resolve) => new EventFollower({
                url: apiUrl(`v1/jobs/${encodeURIComponent(jobId)}/events/stream`), request: cut,
                onEvent: (event) => seqs.push(event.seq), onEnd: async () => { resolve(); return false; },
            }).start());
            return { sent, seqs };
        }""", job["id"])
    finally:
        page.close()
    assert got["seqs"] == expected
    assert len(got["sent"]) == 2 and got["sent"][0] == "0" and 2 <= int(got["sent"][1]) <= expected[-1], got


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_the_jobs_list_is_live_and_right_after_its_stream_drops(browser: Any, db_url: str, keys: Any, tmp_path: Path) -> None:
    """No timer reads the list: a job submitted while the list's stream is down does not show until the stream is back,
    and then it does (each connection starts by telling the page to read its list afresh)."""
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    served = ThreadServer(create_app(SchedulerSettings(db_url=db_url, data_dir=tmp_path / "data", sse_poll_s=0.05, changes_max_s=2.0)))
    owner = keys.new("acme")
    page = browser.new_page()
    connections: list[str] = []
    page.on("request", lambda r: connections.append(r.url) if r.url.endswith("/v1/jobs/changes") else None)
    try:
        with SchedulerClient(served.url, owner) as client:
            first = client.submit("train", {"model": "tiny"}, name="first")["id"]
            sign_in(page, served.url, owner)
            rows = page.locator("#jobs-table tbody tr")
            expect(rows).to_have_count(1)
            expect(page.locator("#jobs-live")).to_have_text("Live")
            client.cancel(first)
            expect(page.locator(f'tr[data-job="{first}"]')).to_have_attribute("data-state", "cancelled")

            page.route("**/v1/jobs/changes", lambda route: route.abort())  # the next connection fails, and the ones after
            expect(page.locator("#jobs-live")).to_contain_text("Reconnecting", timeout=10_000)  # the stream ended (changes_max_s)
            hidden = client.submit("train", {"model": "tiny"}, name="while-down")["id"]
            page.wait_for_timeout(1500)
            expect(rows).to_have_count(1)  # nothing polls: the page does not know yet
            before = len(connections)
            page.unroute("**/v1/jobs/changes")
            expect(page.locator(f'tr[data-job="{hidden}"]')).to_contain_text("while-down", timeout=40_000)
            expect(page.locator("#jobs-live")).to_have_text("Live")
            assert len(connections) > before
    finally:
        page.close()
        served.stop()


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_an_operator_sees_the_cluster_and_a_tenant_does_not(browser: Any, server: ThreadServer, keys: Any, shots: Path) -> None:
    """An operator key lists every tenant's jobs with their owner and opens the cluster view: the worker, what its device
    holds and until when, and each tenant's usage beside its quotas. A tenant's key has no cluster view."""
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    acme, globex, operator = keys.new("acme"), keys.new("globex"), keys.new("ops", "read,operator")
    with SchedulerClient(server.url, acme) as client:
        held = client.submit("train", {"model": "tiny"}, name="acme-run")["id"]
    with SchedulerClient(server.url, globex) as client:
        waiting = client.submit("train", {"model": "tiny"}, name="globex-run")["id"]
    http = httpx.Client(base_url=server.url, timeout=30)
    worker = register(http, keys.worker(4), devices=1)
    lease = worker.lease()
    assert lease is not None and lease["job_id"] == held
    assert worker.heartbeat(held, lease["epoch"]).status_code == 200
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    page.on("response", lambda r: problems.append(f"{r.status} {r.request.method} {r.url}") if r.status >= 400 else None)
    try:
        sign_in(page, server.url, operator)
        expect(page.locator("#who")).to_contain_text("tenant ops, operator")
        rows = page.locator("#jobs-table tbody tr")
        expect(rows).to_have_count(2)
        expect(page.locator(f'tr[data-job="{held}"] td[data-owner]')).to_have_text("acme")
        expect(page.locator(f'tr[data-job="{waiting}"] td[data-position]')).to_have_text("1")
        page.get_by_label("Tenant", exact=True).fill("globex")
        page.get_by_label("Tenant", exact=True).dispatch_event("change")
        expect(rows).to_have_count(1)
        assert page.url.endswith("#/jobs?tenant=globex")
        check_accessible(page, "operator's jobs view")

        page.get_by_role("link", name="Cluster").click()
        expect(page.locator("#cluster-title")).to_be_visible()
        device = page.locator('#workers-table tr[data-worker="w1"]')
        expect(device).to_contain_text(held)
        expect(device).to_contain_text("acme")
        expect(device).to_contain_text(re.compile(r"\d+ s"))  # when its lease ends
        expect(page.locator(f'#ending-table tr[data-job="{held}"]')).to_be_visible()
        expect(page.locator('#usage-table tr[data-tenant="acme"]')).to_contain_text("1 / 8")  # devices held / quota
        expect(page.locator('#usage-table tr[data-tenant="globex"]')).to_contain_text("1 / 100")  # queued / quota
        expect(page.locator("#queue-figure")).to_have_attribute("data-points", re.compile(r"[1-9]\d*"))
        expect(page.locator("#cluster-summary")).to_contain_text("1 jobs queued, 1 holding devices")
        page.screenshot(path=str(shots / "cluster.png"), full_page=True)
        check_accessible(page, "cluster view")
        assert problems == [], "\n".join(problems)

        # A tenant's key: its own usage above its jobs, no cluster link, and the view refuses it.
        page.get_by_role("button", name="Forget key").click()
        sign_in(page, server.url, acme)
        expect(page.locator("#usage-line")).to_contain_text("Tenant acme: 0 of 100 queued jobs, 1 of 8 devices held")
        expect(page.locator("#cluster-link")).to_be_hidden()
        page.goto(f"{server.url}/ui/#/cluster")
        expect(page.locator("#status")).to_contain_text("not an operator's")
        expect(page.locator("#workers-table tbody tr")).to_have_count(0)
    finally:
        page.close()
        http.close()
