"""``tinkergym jobs download JOB [--checkpoint STEP|NAME] --out DIR``: a job's checkpoint from the scheduler's artifact
store, file by file, each checked against the size and SHA-256 the store lists (no raw HTTP needed)."""

from __future__ import annotations

import urllib.parse
from pathlib import Path
from typing import Any

import click

from tinkergym.cli.common import InputError, SafePath
from tinkergym.cli.jobs.connection import call, connect, scheduler_options
from tinkergym.plumbing.downloads import DownloadMismatchError, save_checked
from tinkergym.scheduler.artifact_paths import ArtifactPathError, check_relpath

def _quote(part: str) -> str:
    return urllib.parse.quote(part, safe="")


def pick_checkpoint(found: list[dict[str, Any]], wanted: str | None, job_id: str) -> dict[str, Any]:
    """The checkpoint named or numbered ``wanted`` (its step, or its name), or the newest; :class:`InputError` when none fits."""
    if not found:
        raise InputError(f"job {job_id} has no checkpoint yet; see its events with: tinkergym jobs logs {job_id}")
    if wanted is None:
        return max(found, key=lambda c: (c["step"], c.get("created_at", 0)))
    for checkpoint in sorted(found, key=lambda c: -c["step"]):
        if checkpoint["name"] == wanted or (wanted.isdigit() and checkpoint["step"] == int(wanted)):
            return checkpoint
    have = ", ".join(f"{c['name']} (step {c['step']})" for c in sorted(found, key=lambda c: c["step"])[-5:])
    raise InputError(f"job {job_id} has no checkpoint {wanted!r}; it has: {have}")


def download_file(client: Any, job_id: str, name: str, entry: dict[str, Any], dest: Path) -> None:
    """One listed file into ``dest`` (a ``.part`` file renamed once its size and SHA-256 match the listing)."""
    quoted = f"{_quote(job_id)}/artifacts/{_quote(name)}/" + "/".join(_quote(p) for p in entry["path"].split("/"))
    connection = client._connection(client.stream_timeout)
    try:
        connection.request("GET", f"{client._base}/v1/jobs/{quoted}", headers={**client._headers(), "Accept": "*/*"})
        response = connection.getresponse()
        if response.status != 200:
            raise click.ClickException(f"downloading {entry['path']}: the scheduler answered {response.status}: {response.read(300)!r}")
        try:
            save_checked(response, dest, entry["size"], entry["sha256"])
        except DownloadMismatchError as exc:
            raise click.ClickException(f"downloading {entry['path']}: got {exc.written} bytes with SHA-256 {exc.sha256}, the store "
                                       f"lists {entry['size']} bytes with {entry['sha256']}; download again") from None
    finally:
        connection.close()


@click.command("download")
@click.argument("job_id")
@click.option("--checkpoint", "wanted", default=None, metavar="STEP|NAME", help="Which checkpoint: its step or its name (default: the newest).")
@click.option("--out", type=SafePath(file_okay=False, path_type=Path), required=True, help="The folder to write it into (made if needed).")
@scheduler_options
def download_command(job_id: str, wanted: str | None, out: Path, scheduler_url: str | None, api_key: str | None) -> None:
    """Download one of a job's checkpoints into --out (a state `tinkergym train --resume` and peft load).

    Every file is checked against the size and SHA-256 the scheduler lists before it is kept.

    \b
    Examples:
      tinkergym jobs download job_0123 --out checkpoints/latest
      tinkergym jobs download job_0123 --checkpoint 9 --out checkpoints/step_9
    """
    client = connect(scheduler_url, api_key)
    try:
        checkpoint = pick_checkpoint(call(lambda: client.checkpoints(job_id)), wanted, job_id)
        name = checkpoint["name"]
        listing = call(lambda: client._request("GET", f"/v1/jobs/{_quote(job_id)}/artifacts/{_quote(name)}"))["files"]
        out.mkdir(parents=True, exist_ok=True)
        total = 0
        for entry in listing:
            try:
                parts = check_relpath(entry["path"])
            except ArtifactPathError as exc:
                raise click.ClickException(f"the scheduler listed a file outside the checkpoint ({exc}); nothing more is written") from exc
            dest = out.joinpath(*parts)
            dest.parent.mkdir(parents=True, exist_ok=True)
            download_file(client, job_id, name, entry, dest)
            total += entry["size"]
    finally:
        client.close()
    click.echo(f"job {job_id}: checkpoint {name} (step {checkpoint['step']}), {len(listing)} file(s), {total} bytes -> {out}")
