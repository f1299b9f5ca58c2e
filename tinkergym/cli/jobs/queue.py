"""``tinkergym jobs list|show|cancel|logs``: a tenant's jobs in the scheduler's queue, from the command line (through
:mod:`tinkergym.client`)."""

from __future__ import annotations

import datetime
import json
import time
from typing import Any

import click

from tinkergym.cli.common import age
from tinkergym.cli.jobs.connection import call, connect, scheduler_options

STATES = ("queued", "leased", "starting", "running", "cancelling", "succeeded", "failed", "cancelled")
KINDS = ("train", "sft", "eval", "inference")


def job_table(found: list[dict[str, Any]]) -> str:
    """The jobs as an aligned table: id, kind, state, priority, gpus, attempt, age, reason (why a queued job waits), name."""
    header = ("ID", "KIND", "STATE", "PRIORITY", "GPUS", "ATTEMPT", "AGE", "REASON", "NAME")
    now = time.time()
    rows = [header] + [
        (j["id"], j["kind"], j["state"], str(j["priority"]), str(j["gpus"]), str(j["attempt"]), age(j["created_at"], now),
         (j.get("wait_reason") or {}).get("code", "-"), j["name"])
        for j in found
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    return "\n".join("  ".join([c.ljust(w) for c, w in zip(r, widths)] + [r[-1]]).rstrip() for r in rows)


def event_line(event: dict[str, Any]) -> str:
    """``2025-01-02 03:04:05  state  {"state":"queued"}``: an event's local time, type and data (a ``transcript``
    event's data, up to tens of KiB of messages, as a one-line summary: :func:`transcript_summary`; a ``metrics`` event's,
    a step's tens of numbers, as its key ones: :func:`~tinkergym.cli.summaries.metrics_summary`)."""
    from tinkergym.cli.summaries import metrics_summary

    stamp = datetime.datetime.fromtimestamp(float(event["created_at"])).strftime("%Y-%m-%d %H:%M:%S")
    summaries = {"transcript": transcript_summary, "metrics": metrics_summary}
    summary = summaries[event["type"]](event["data"]) if event["type"] in summaries else None
    shown = summary if summary is not None else json.dumps(event["data"], separators=(",", ":"), sort_keys=True)
    return f"{stamp}  {event['type']:<10}  {shown}"


def transcript_summary(data: Any) -> str | None:
    """``step 6: 3 of 64 episodes: first 0.1, best 0.9, worst -0.5 (--json for the messages)``: a ``transcript``
    event's data (:func:`tinkergym.backends.scheduled.transcript_event`) in one line; None for data not of that shape."""
    if not isinstance(data, dict) or not isinstance(data.get("episodes"), list):
        return None
    episodes = [e for e in data["episodes"] if isinstance(e, dict)]
    parts = []
    for e in episodes:
        picked = e.get("picked")
        why = "+".join(str(p) for p in picked) if isinstance(picked, list) and picked else f"episode {e.get('episode')}"
        reward = e.get("total_reward")
        shown = f"{reward:.4g}" if isinstance(reward, (int, float)) and not isinstance(reward, bool) else "-"
        parts.append(f"{why} {shown}" + (" (error)" if e.get("error") else ""))
    of = data.get("of")
    count = f"{len(episodes)} of {of}" if isinstance(of, int) and not isinstance(of, bool) else str(len(episodes))
    return f"step {data.get('step')}: {count} episodes: {', '.join(parts) or 'none'} (--json for the messages)"


@click.command("list")
@scheduler_options
@click.option("--state", help="Only jobs in these states (comma-separated: " + ", ".join(STATES) + ").")
@click.option("--kind", type=click.Choice(KINDS), help="Only jobs of this kind.")
@click.option("--limit", type=click.IntRange(1, 100_000), default=50, show_default=True, help="At most this many jobs, newest first.")
@click.option("--json", "as_json", is_flag=True, help="Print the jobs as one JSON list.")
def list_command(scheduler_url: str | None, api_key: str | None, state: str | None, kind: str | None, limit: int, as_json: bool) -> None:
    """The tenant's jobs, newest first, as a table (id, kind, state, priority, gpus, attempt, age, reason, name).

    REASON says why a queued job waits: no_worker, no_model, too_few_devices, quota, behind, busy or ready
    (`jobs show` gives the whole message)."""
    client = connect(scheduler_url, api_key)
    found = call(lambda: client.list(state=state, kind=kind, limit=limit))
    click.echo(json.dumps(found, indent=2) if as_json else job_table(found))


@click.command("show")
@scheduler_options
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print the job as JSON.")
def show_command(scheduler_url: str | None, api_key: str | None, job_id: str, as_json: bool) -> None:
    """One job: its state, attempt, queue position, why it waits (when queued), server, why it ended (when its client
    said: end_reason) and config."""
    client = connect(scheduler_url, api_key)
    job = call(lambda: client.show(job_id))
    if as_json:
        click.echo(json.dumps(job, indent=2))
        return
    for field in ("id", "name", "kind", "state", "priority", "gpus", "attempt", "max_attempts", "queue_position", "server_url", "error",
                  "end_reason"):
        if job.get(field) not in (None, ""):
            click.echo(f"{field + ':':<16}{job[field]}")
        if field == "queue_position" and job.get("wait_reason"):
            click.echo(f"{'reason:':<16}{job['wait_reason']['code']}: {job['wait_reason']['message']}")
    click.echo(f"{'age:':<16}{age(job['created_at'])}")
    click.echo(f"{'config:':<16}{json.dumps(job.get('config', {}), sort_keys=True)}")


@click.command("cancel")
@scheduler_options
@click.argument("job_id")
def cancel_command(scheduler_url: str | None, api_key: str | None, job_id: str) -> None:
    """Cancel a job: a queued one ends at once, a running one is stopped by its worker (state cancelling)."""
    client = connect(scheduler_url, api_key)
    job = call(lambda: client.cancel(job_id))
    click.echo(f"{job['id']}: {job['state']}")


@click.command("logs")
@scheduler_options
@click.argument("job_id")
@click.option("--follow", "-f", is_flag=True, help="Keep streaming new events until the job ends.")
@click.option("--after", type=click.IntRange(0), default=0, show_default=True, help="Only events after this sequence number.")
@click.option("--json", "as_json", is_flag=True, help="Print each event as a JSON line.")
def logs_command(scheduler_url: str | None, api_key: str | None, job_id: str, follow: bool, after: int, as_json: bool) -> None:
    """The job's events (state changes, logs, metrics, checkpoints, transcripts) as lines: time, type, data.

    A transcript event is summed up in one line (its step, and each episode it carries with why and its total reward), and
    a metrics event in its step's key numbers (reward, loss, eval reward and success); --json prints every event whole."""
    client = connect(scheduler_url, api_key)
    show = (lambda e: json.dumps(e, separators=(",", ":"))) if as_json else event_line

    def run() -> None:
        for event in client.follow(job_id, after) if follow else client.events(job_id, after):
            click.echo(show(event))

    call(run)
