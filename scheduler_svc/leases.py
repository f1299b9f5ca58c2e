"""Leases: grant queued jobs to workers' devices, renew by heartbeat, expire, fence by epoch. (Being written.)"""

from __future__ import annotations

import asyncio
from typing import Any


def wake(app: Any) -> None:
    """Ask the sweeper to run soon (a job was queued or devices were freed)."""


async def sweep_forever(app: Any) -> None:
    """Expire leases and grant queued jobs every ``sweep_interval_s`` seconds, for the app's lifetime."""
    while True:
        await asyncio.sleep(app.state.settings.sweep_interval_s)
