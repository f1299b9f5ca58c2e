"""The scheduler's background loop: every pass expires leases, reports silent workers, notes why queued jobs wait and
applies the retention rules. It imports the modules it drives; none of them imports it."""

from __future__ import annotations

import asyncio
from typing import Any

from tinkergym.scheduler import leases, placement, retention, usage
from tinkergym.scheduler.artifacts import retention_due, sweep_artifacts


async def sweep_forever(app: Any) -> None:
    """Every ``sweep_interval_s`` seconds (sooner when woken), for the app's lifetime, never dying of an error: expire
    leases (:func:`tinkergym.scheduler.leases.sweep`), report and forget silent workers (:func:`tinkergym.scheduler.leases.sweep_workers`), and, at most every
    ``retention_interval_s`` of the app's clock, delete ended jobs' old artifacts
    (:func:`tinkergym.scheduler.artifacts.sweep_artifacts`) and old ended jobs and idempotency records
    (:func:`tinkergym.scheduler.retention.sweep_if_due`), and sample the queue (:func:`tinkergym.scheduler.usage.sample_queue`)."""
    event = asyncio.Event()
    app.state.sweep_event = event
    app.state.sweep_loop = asyncio.get_running_loop()
    try:
        while True:
            try:
                await asyncio.to_thread(leases.sweep, app)
            except Exception:  # noqa: BLE001 - log and go on: the sweeper is the only thing that frees a dead worker's devices
                app.state.logger.exception("lease sweep failed; retrying in %ss", app.state.settings.sweep_interval_s)
            try:
                await asyncio.to_thread(leases.sweep_workers, app)
            except Exception:  # noqa: BLE001 - the lease sweep above must go on whatever happens here
                app.state.logger.exception("worker sweep failed")
            try:
                if retention_due(app):
                    await asyncio.to_thread(sweep_artifacts, app)
            except Exception:  # noqa: BLE001 - as above
                app.state.logger.exception("artifact retention pass failed")
            try:
                if placement.wait_pass_due(app):  # a `waiting` event when a queued job's reason changes; at most DUTY of the time
                    await asyncio.to_thread(placement.note_wait_reasons, app)
            except Exception:  # noqa: BLE001 - as above
                app.state.logger.exception("wait reason pass failed")
            try:
                await asyncio.to_thread(usage.sample_queue, app)  # the queue's history the dashboard's cluster view draws
            except Exception:  # noqa: BLE001 - as above
                app.state.logger.exception("queue sample failed")
            try:
                await asyncio.to_thread(retention.sweep_if_due, app)  # ended jobs and old idempotency records
            except Exception:  # noqa: BLE001 - as above
                app.state.logger.exception("job retention pass failed")
            try:
                await asyncio.wait_for(event.wait(), timeout=app.state.settings.sweep_interval_s)
            except asyncio.TimeoutError:  # noqa: UP041 - Python 3.10: not the builtin TimeoutError
                pass
            event.clear()
    finally:
        app.state.sweep_event = app.state.sweep_loop = None
