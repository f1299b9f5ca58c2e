"""``tinkergym scheduler keys``: make, list and revoke the tenants' API keys.

Keys are made here, on the scheduler's machine, and nowhere else: the service has no registration route.
"""

from __future__ import annotations

from pathlib import Path

import click

from tinkergym.cli.common import InputError, shorten, table, when
from tinkergym.cli.scheduler.database import data_dir_option, db_option, open_database
from tinkergym.cli.scheduler.tenants import check_tenant


@click.group("keys")
def keys_group() -> None:
    """Make, list and revoke API keys (the only way to get one: there is no registration).

    \b
    Examples:
      tinkergym scheduler keys create --tenant acme --scopes read,write --name laptop
      tinkergym scheduler keys list --tenant acme
      tinkergym scheduler keys revoke 0123456789ab
    """


@keys_group.command("create")
@click.option("--tenant", required=True, help="The key's owner; created with default quotas if new.")
@click.option("--scopes", required=True, help="Comma-separated: read, write, metrics (GET /metrics, for a Prometheus scraper), admin "
              "(admin implies those), operator (reads every tenant's jobs and GET /v1/cluster: the operator's dashboard; give it "
              "with read, e.g. read,operator; admin does not imply it). Workers get a worker credential instead: "
              "tinkergym scheduler workers create.")
@click.option("--name", default="", help="A label for `keys list` (who or what holds the key).")
@db_option
@data_dir_option
def keys_create(tenant: str, scopes: str, name: str, db: str | None, data_dir: Path) -> None:
    """Make a key and print it once; only its SHA-256 digest is stored.

    The key alone goes to stdout (so it can be redirected to a file); its id and the notice go to stderr.

    \b
    Example:
      tinkergym scheduler keys create --tenant acme --scopes read,write --name laptop > key.txt && chmod 600 key.txt
    """
    from tinkergym.scheduler.auth import TENANT_SCOPES, create_key, parse_scopes

    check_tenant(tenant)
    try:
        scope_list = parse_scopes(scopes)
    except ValueError as exc:
        given = {s.strip() for s in scopes.split(",") if s.strip()}
        if "worker" in given:
            raise click.BadParameter(str(exc), param_hint="--scopes") from exc
        unknown = sorted(given - set(TENANT_SCOPES))
        what = f"unknown scope {', '.join(repr(shorten(s, 40)) for s in unknown[:5])}" if unknown else "no scope given"
        raise click.BadParameter(f"{what}: give a comma-separated list of {', '.join(TENANT_SCOPES)}", param_hint="--scopes") from exc
    if len(name) > 200:
        raise click.BadParameter("at most 200 characters", param_hint="--name")
    engine = open_database(db, data_dir)
    try:
        key_id, key = create_key(engine, tenant, scope_list, name=name)
    finally:
        engine.dispose()
    click.echo(f"created key {key_id} for tenant {tenant} (scopes {','.join(scope_list)})", err=True)
    click.echo(key)
    click.echo("this key is shown once and never again (the scheduler keeps only its digest): store it now.", err=True)


@keys_group.command("list")
@click.option("--tenant", default=None, help="Only this tenant's keys.")
@db_option
@data_dir_option
def keys_list(tenant: str | None, db: str | None, data_dir: Path) -> None:
    """List keys: id, tenant, scopes, name, created, revoked (never the key nor its digest).

    \b
    Example:
      tinkergym scheduler keys list --tenant acme
    """
    from tinkergym.scheduler.auth import list_keys

    if tenant is not None:
        check_tenant(tenant)
    engine = open_database(db, data_dir)
    try:
        found = list_keys(engine, tenant)
    finally:
        engine.dispose()
    if not found:
        click.echo("no keys" + (f" for tenant {tenant}" if tenant else "") + "; make one with: tinkergym scheduler keys create", err=True)
        return
    rows = [(k["id"], k["tenant_id"], k["scopes"], k["name"] or "-", when(k["created_at"]), when(k["revoked_at"])) for k in found]
    click.echo(table(("ID", "TENANT", "SCOPES", "NAME", "CREATED", "REVOKED"), rows))


@keys_group.command("revoke")
@click.argument("key_id", metavar="ID")
@db_option
@data_dir_option
def keys_revoke(key_id: str, db: str | None, data_dir: Path) -> None:
    """Revoke a key by its id: its next request is refused (401), on a running scheduler too.

    \b
    Example:
      tinkergym scheduler keys revoke 0123456789ab
    """
    from tinkergym.scheduler.auth import list_keys, revoke_key

    engine = open_database(db, data_dir)
    try:
        if revoke_key(engine, key_id):
            click.echo(f"revoked key {key_id}")
            return
        known = {k["id"]: k for k in list_keys(engine)}
    finally:
        engine.dispose()
    if key_id in known:
        click.echo(f"key {key_id} was already revoked ({when(known[key_id]['revoked_at'])})")
        return
    raise InputError(f"no key with id {shorten(key_id, 80)!r}; see the ids with: tinkergym scheduler keys list")
