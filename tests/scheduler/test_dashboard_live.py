"""The dashboard (``/ui/``) in headless Chromium watching a real training run: a scheduler on 127.0.0.1 (SQLite), a real
``tinkergym worker`` process and ``tinkergym train --scheduler`` on the tiny model, transcripts every step.

The tenant signs in and opens the job while it trains: the reward chart gains points, the Transcripts section fills with
the episodes the run reports (``transcript`` events on the same event stream) and one opens to its conversation, each
turn labelled with its role. axe-core checks the page with it open. Cancel ends the job (cancelled) and the training
run with the error it gives for a cancelled job; another tenant's key sees none of it. A second test feeds the page a
transcript of a tool-using episode whose text is hostile markup: tool calls and results are told apart, and the text
stays text. The browser, server and helpers are test_dashboard.py's (the same skips: no Chromium or playwright).

Screenshots go to ``$TINKERGYM_SCREENSHOTS`` (a folder) when set, else to the test's ``tmp_path``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tinkergym.backends.scheduled import TRANSCRIPT_EVENT_BYTES, transcript_event
from tinkergym.client import SchedulerClient
from tinkergym.serve.asgi import ThreadServer


def _dashboard_tests() -> ModuleType:
    """test_dashboard.py beside this file, loaded by path once (with ``--import-mode=importlib`` no test folder is on
    ``sys.path``): its browser, server and shots fixtures and its helpers serve here too."""
    name = "tinkergym_test_dashboard"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("test_dashboard.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


dashboard = _dashboard_tests()
browser, server, shots = dashboard.browser, dashboard.server, dashboard.shots  # fixtures, used by name below
check_accessible, sign_in, TIMEOUT_MS = dashboard.check_accessible, dashboard.sign_in, dashboard.TIMEOUT_MS

#: The run: the tiny model, tiny batches, a few tokens; many steps, so it still trains while the page watches (it is cancelled).
RUN = ("--env", "tinker/Bandit-v0", "--model", "tiny", "--dtype", "float32", "--steps", "100000", "--batch-size", "2", "--group-size", "2",
       "--max-new-tokens", "4", "--checkpoint-every", "100000", "--quiet")
#: Seconds for the worker to start the job's server and the run's first steps to arrive (about 8 s on 2 cores).
START_S = 90


def _worker(url: str, key: str, work_dir: Path, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "TINKERGYM_API_KEY": key, "TINKERGYM_CACHE": str(cache)}
    command = [sys.executable, "-m", "tinkergym", "worker", "--scheduler", url, "--slots", "1", "--models", "tiny", "--name", "w1",
               "--work-dir", str(work_dir), "--heartbeat", "0.5", "--poll", "0.2"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(work_dir.parent / "worker.log", "w"), env=env)


def _stop(process: subprocess.Popen | None) -> None:
    if process is not None and process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _watch(page: Any) -> list[str]:
    """The page's errors, failed responses and console errors, as they happen."""
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    page.on("response", lambda r: problems.append(f"{r.status} {r.request.method} {r.url}") if r.status >= 400 else None)
    page.on("console", lambda message: problems.append(f"console {message.type}: {message.text}") if message.type == "error" else None)
    return problems


def _points(page: Any) -> int:
    return int(page.locator('figure[data-metric="reward/mean"]').get_attribute("data-points") or 0)


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_live_training_run_in_a_browser(browser: Any, server: ThreadServer, keys: Any, shots: Path, tmp_path: Path) -> None:
    pytest.importorskip("torch")  # the worker's training server
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    owner, stranger, worker_key = keys.new("acme"), keys.new("globex"), keys.new("ops", "worker")
    (tmp_path / "w1").mkdir()
    worker = _worker(server.url, worker_key, tmp_path / "w1" / "work", tmp_path / "cache")
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"transcripts_every": 1}))  # a setting with no flag of its own
    train = subprocess.Popen([sys.executable, "-m", "tinkergym", "train", *RUN, "--config", str(config), "--out", str(tmp_path / "run"),
                              "--scheduler", server.url], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "TINKERGYM_API_KEY": owner, "TINKERGYM_CACHE": str(tmp_path / "client-cache")})
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    problems = _watch(page)
    client = SchedulerClient(server.url, owner)
    try:
        deadline = time.monotonic() + START_S
        while not (found := client.list()):
            assert train.poll() is None, train.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the training run submitted no job"
            time.sleep(0.1)
        job_id = found[0]["id"]

        # The job's page while it trains: the reward chart gains points, the transcripts arrive.
        sign_in(page, server.url, owner)
        page.locator(f'tr[data-job="{job_id}"] a').click()
        expect(page.locator("#stream-state")).to_contain_text("Live")
        expect(page.locator('#job-facts dd[data-fact="state"]')).to_have_text("running", timeout=START_S * 1000)
        page.wait_for_function("() => Number(document.querySelector('figure[data-metric=\"reward/mean\"]')?.dataset.points) >= 2",
                               timeout=START_S * 1000)
        before = _points(page)
        page.wait_for_function(f"() => Number(document.querySelector('figure[data-metric=\"reward/mean\"]').dataset.points) > {before}")
        transcripts = page.locator("#transcripts details.transcript")
        expect(transcripts.first).to_be_visible()
        expect(page.get_by_role("heading", name="Transcripts")).to_be_visible()
        page.screenshot(path=str(shots / "live-job-running.png"), full_page=True)

        # A transcript opens to its conversation, each turn's role in text; the text is the reported one, as text.
        step, episode = transcripts.first.evaluate("d => [d.dataset.step, d.dataset.episode]")  # at once: new ones arrive on top
        opened = page.locator(f'#transcripts details.transcript[data-step="{step}"][data-episode="{episode}"]')
        expect(opened.locator("summary")).to_contain_text(f"Step {step}, episode {episode}")
        expect(opened.locator("summary")).to_contain_text("reward")
        # By the keyboard, as a reader may: a click's point is taken before it lands, and episodes arriving on top
        # move the list under it between the two.
        opened.locator("summary").press("Enter")
        expect(opened).to_have_attribute("open", "")
        turns = opened.locator("li.turn")
        expect(turns).to_have_count(3)  # Bandit: the system prompt, the arms, the model's answer
        assert turns.evaluate_all("turns => turns.map(t => t.dataset.role)") == ["system", "observation", "assistant"]
        assert turns.locator(".turn-role").all_text_contents() == ["System", "User / env", "Assistant"]
        sent = next(e["data"] for e in client.events(job_id) if e["type"] == "transcript" and str(e["data"]["step"]) == step)
        messages = next(e for e in sent["episodes"] if str(e["episode"]) == episode)["messages"]
        shown = turns.locator(".turn-text").evaluate_all("texts => texts.map(t => t.textContent)")
        assert [t.strip() for t in shown] == [m["content"].strip() for m in messages]  # a turn's edge whitespace is not shown
        expect(opened.locator("summary")).to_contain_text(next(e for e in sent["episodes"] if str(e["episode"]) == episode)["finish_reason"])
        page.wait_for_function(f"() => Number(document.querySelector('figure[data-metric=\"reward/mean\"]').dataset.points) > {before + 20}",
                               timeout=START_S * 1000)  # 20 more steps: older closed transcripts leave the list, the open one stays
        expect(opened).to_have_attribute("open", "")
        assert transcripts.count() <= 3 * 20 + 1
        # The tenant's usage counts what the worker's server trained and sampled, and the device it holds.
        deadline = time.monotonic() + 30
        while not ((used := client.usage()[0])["tokens_trained"] > 0 and used["tokens_sampled"] > 0 and used["device_seconds"] > 0):
            assert time.monotonic() < deadline, used
            time.sleep(0.2)
        assert used["tenant"] == "acme" and used["devices_held"] == 1
        expect(page.locator('#events-table tr:has(td:text-is("transcript"))').first).to_contain_text("(shown under Transcripts)")  # one line
        opened.scroll_into_view_if_needed()
        page.screenshot(path=str(shots / "live-transcript.png"), full_page=True)
        check_accessible(page, "job page with a transcript open")

        # Cancel: the job ends cancelled, and so does the training run, saying why.
        page.get_by_role("button", name="Cancel job").click()
        page.get_by_role("button", name="Yes, cancel it").click()
        expect(page.locator('#job-facts dd[data-fact="state"]')).to_have_text("cancelled")
        expect(page.locator("#stream-state")).to_have_text("The job has ended.")
        _, stderr = train.communicate(timeout=60)
        assert train.returncode == 1, stderr[-3000:]
        assert f"Error: job {job_id} is cancelled: it was cancelled while this client used it" in stderr, stderr[-3000:]
        assert "did not answer" not in stderr and f"go on with: tinkergym train --resume {tmp_path / 'run'}" in stderr, stderr[-3000:]
        assert client.show(job_id)["state"] == "cancelled"
        page.screenshot(path=str(shots / "live-job-cancelled.png"), full_page=True)
        assert problems == [], "\n".join(problems)

        # Another tenant: no rows, and the job's address is not found.
        page.get_by_role("button", name="Forget key").click()
        sign_in(page, server.url, stranger)
        expect(page.locator("#jobs-empty")).to_be_visible()
        expect(page.locator("#jobs-table tbody tr")).to_have_count(0)
        page.goto(f"{server.url}/ui/#/jobs/{job_id}")
        expect(page.locator("#status")).to_contain_text(f"There is no job {job_id}")
        expect(page.locator("#transcripts details")).to_have_count(0)
        with SchedulerClient(server.url, stranger) as other:
            assert other.list() == []
        page.screenshot(path=str(shots / "live-other-tenant.png"), full_page=True)
    finally:
        client.close()
        context.close()
        _stop(train)
        _stop(worker)


HOSTILE = '<img src=x onerror="window.pwned=1"><script>window.pwned=2</script>'


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_a_tool_using_transcript_with_hostile_text(browser: Any, server: ThreadServer, keys: Any, shots: Path) -> None:
    """A tool-using episode (``<tool_call>`` blocks in the model's message, ``<tool_response>`` blocks in the env's, an
    OpenAI-style ``tool`` message) as the run reports it, at the largest size it sends: each turn's role told apart, and
    markup in the text shown as text."""
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    owner = keys.new("acme")
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
    record = {"episode": 3, "total_reward": 1.0, "finish_reason": "terminated", "error": None, "sampled_tokens": 40, "rewards": [0.0, 1.0],
              "messages": [{"role": "system", "content": "Use the calculator. " + HOSTILE},
                           {"role": "user", "content": "What is 6 * 7?"},
                           {"role": "assistant", "content": f"Let me compute. {HOSTILE}\n{call}"},
                           {"role": "user", "content": "<tool_response>\n42\n</tool_response>"},
                           {"role": "tool", "name": "calculator", "content": HOSTILE},
                           {"role": "assistant", "content": "42 " + "\u00e9" * 100_000}]}
    records = [{**record, "episode": i, "total_reward": 0.0} for i in range(8)]
    records[3] = record
    data = transcript_event(5, records)
    assert len(json.dumps(data)) <= TRANSCRIPT_EVENT_BYTES  # and so within the tenant's default quota (64 KiB): the report is taken
    with SchedulerClient(server.url, owner) as client:
        job = client.submit("train", {"model": "tiny"}, name="tools")
        client.report(job["id"], "transcript", data)
    page = browser.new_page()
    problems = _watch(page)
    try:
        sign_in(page, server.url, owner)
        page.goto(f"{server.url}/ui/#/jobs/{job['id']}")
        opened = page.locator('#transcripts details[data-step="5"][data-episode="3"]')
        expect(opened.locator("summary")).to_have_text("Step 5, episode 3 (best): reward 1, terminated")
        expect(page.locator("#transcripts details")).to_have_count(2)  # the first (and worst), the best
        expect(page.locator('#transcripts details[data-episode="0"] summary')).to_have_text("Step 5, episode 0 (first, worst): reward 0, terminated")
        # By the keyboard, as a reader may: a click's point is taken before it lands, and episodes arriving on top
        # move the list under it between the two.
        opened.locator("summary").press("Enter")
        turns = opened.locator("li.turn")
        assert turns.evaluate_all("turns => turns.map(t => t.dataset.role)") == [
            "system", "observation", "assistant", "tool-call", "tool-result", "tool-result", "assistant"]
        assert turns.locator(".turn-role").all_text_contents() == [
            "System", "User / env", "Assistant", "Tool call", "Tool result", "Tool result (calculator)", "Assistant"]
        texts = turns.locator(".turn-text").all_text_contents()
        assert texts[2] == f"Let me compute. {HOSTILE}" and texts[3] == '{"name": "calculator", "arguments": {"expression": "6 * 7"}}'
        assert texts[4] == "42" and texts[5] == HOSTILE and "characters cut ...]" in texts[6]
        assert page.evaluate("() => window.pwned") is None
        assert page.locator("#transcripts img, #transcripts script").count() == 0
        page.screenshot(path=str(shots / "tool-transcript.png"), full_page=True)
        check_accessible(page, "job page with a tool-using transcript open")
        assert problems == [], "\n".join(problems)
    finally:
        page.close()
