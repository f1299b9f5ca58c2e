"""Workers: register devices, take leases, heartbeat, report events and checkpoints. (Being written.)"""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(prefix="/v1/workers", tags=["workers"])
