"""The scheduler's typed wire models that more than one route (or the worker) speaks: a job's submission with its typed
config. Models used by one route live beside it; all derive from every server's base,
:class:`~tinkergym.serve.wire.WireModel` (unknown fields refused)."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator
from tinkergym.config import DTYPES, SERVED_NAME
from tinkergym.scheduler.artifacts import JOB_ID
from tinkergym.serve.wire import WireModel


#: Devices a job of each kind can use. A train or sft job's server runs one rank per device of its lease (FSDP2 under
#: torchrun: tinkergym.backends.torch.sharded); an eval or inference job's server runs on the first device only. A job
#: asking for more is refused at submission (:func:`device_refusal`). The leases grant a job its devices all at once or
#: not at all, and count them against the tenant's quota.
USABLE_DEVICES: dict[str, int] = {"train": 64, "sft": 64, "eval": 1, "inference": 1}


def device_refusal(kind: str, gpus: int) -> str | None:
    """Why a ``kind`` job cannot use ``gpus`` devices today, and what to submit instead; None when it can."""
    usable = USABLE_DEVICES[kind]
    if gpus <= usable:
        return None
    if usable == 1:
        return (f"this job asks for {gpus} devices, but {kind} jobs run on one device today (its server would use only the first): "
                "submit it with gpus 1 (the default; --gpus 1 on the command line)")
    return (f"this job asks for {gpus} devices, but {kind} jobs run on at most {usable} today (its server would use only the first {usable}): "
            f"submit it with gpus {usable} or fewer (--gpus {usable} on the command line)")


class JobConfig(WireModel):
    """A job's config: what its worker starts the job's server with, typed and checked here at submission, so a value
    that cannot work is refused now (422) instead of failing the job on a worker. The run's other settings (env,
    trainer, steps, ...) are kept as given, for people reading the job; folders of the client's machine are refused."""

    model_config = ConfigDict(extra="allow")  # the one scheduler body that keeps fields it does not name: see above

    model: str = Field(max_length=200, description="a model the workers offer (tiny, smollm2-135m, org/name), never a path")
    dtype: str = Field("auto", pattern="^(" + "|".join(DTYPES) + ")$", description="the weights' dtype on the server")
    lora_rank: int | None = Field(None, ge=0, le=4096, description="the adapter's rank; 0 trains every weight (default 8)")
    lora_alpha: float | None = Field(None, gt=0, le=1e6, description="the adapter's scale numerator (default 16)")
    lora_dropout: float | None = Field(None, ge=0, lt=1)
    micro_batch_size: int | None = Field(None, ge=1, le=65536, description="sequences per forward/backward pass")
    seed: int | None = Field(None, ge=0, le=2**32 - 1)
    deterministic: bool | None = None
    gradient_checkpointing: bool | None = None
    resume_job: str | None = Field(None, pattern=JOB_ID.pattern, description="the job whose newest checkpoint this one starts from")
    resume_checkpoint: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
                                          description="the checkpoint of resume_job to start from, by name (default: its newest)")
    served_name: str | None = Field(None, pattern=SERVED_NAME.pattern, description="an inference job: the name the run is served under")
    players: int | None = Field(None, ge=1, le=64, description="a league (train job): its players, one adapter each on seats of one shared server")


class JobCreate(WireModel):
    """A job to queue. ``config`` is the job part of the ``TrainConfig`` the CLI builds (``TrainConfig.job_config``)."""

    kind: Literal["train", "sft", "eval", "inference"]
    config: JobConfig
    gpus: int = Field(1, ge=1, le=64, description="devices the job needs, all on one worker; at most its kind's USABLE_DEVICES today")
    priority: int = Field(0, ge=-100, le=100, description="higher runs first; ties by age")
    name: str = Field("", max_length=200, pattern=r"^[^\x00-\x1f\x7f]*$", description="a label; no control characters")
    max_attempts: int | None = Field(None, ge=1, le=20, description="lost leases before the job fails (default: the scheduler's)")

    @model_validator(mode="after")
    def _players_are_a_leagues(self) -> JobCreate:
        """Only a league's train job of one device asks for players (each a seat of one shared server)."""
        if self.config.players is not None and (self.kind != "train" or self.gpus != 1 or (self.config.model_extra or {}).get("trainer") != "league"):
            raise ValueError("players is a league's: a train job of the league trainer (config trainer: league) on one device (gpus 1)")
        return self
