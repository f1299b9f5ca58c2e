"""Serving a model through a scheduler: ``tinkergym serve model --scheduler URL`` and ``tinkergym eval --scheduler URL``.

An inference (or eval) job asks a worker for devices and runs ``tinkergym serve model`` there, serving a base
model, or a run the scheduler trained: its config names the training job (``resume_job``), whose newest
checkpoint the worker restores from the artifact store and serves under the run's name (a LoRA run as an
adapter on its base, a full fine-tuning run as a model of its own). Weights never pass through this machine.

The job has a stable endpoint on the scheduler (:func:`gateway_url`: an OpenAI client's ``base_url``, called with
the owner's API key), which forwards each call to wherever the job runs now. The worker's server can also be
reached directly with the lease's token, which changes when the job moves to another worker (a new lease epoch):
:class:`InferenceJob` follows the job and says so. Standard library and :mod:`tinkergym.client` only: no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

from tinkergym.client import TERMINAL_STATES, JobEnded, SchedulerError, print_stderr, wait_running
from tinkergym.errors import ConfigError
from tinkergym.plumbing.folders import cache_root

#: The job ended (failed, cancelled, succeeded) while it was still wanted, or did not start in time.
InferenceJobEnded = JobEnded


@dataclass
class Endpoint:
    """Where the job's inference server answers: ``url`` (ends in ``/v1``), its bearer ``key`` for lease ``epoch``."""

    url: str
    key: str
    epoch: int
    models: list[str]


def gateway_url(scheduler_url: str, job_id: str) -> str:
    """The job's stable OpenAI-compatible base URL on the scheduler (``.../v1/jobs/JOB/openai/v1``): it follows the job
    across workers; call it with the owner's API key (a key with the ``write`` scope)."""
    return f"{scheduler_url.rstrip('/')}/v1/jobs/{job_id}/openai/v1"


def served_name(folder: str | Path) -> str:
    """The name a run folder is served under: the folder's name, with characters a model name cannot have replaced."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", Path(folder).resolve().name)[:96].lstrip("._-")
    return name or "model"


def job_config(model: str | None = None, run_dir: str | Path | None = None, dtype: str | None = None) -> dict[str, Any]:
    """The config of an inference job serving ``model`` (a name the workers offer) or the run in ``run_dir``.

    A run must have been trained through the scheduler (its config names the job whose checkpoints the worker
    restores); a run trained on this machine is served here (``tinkergym serve model --run DIR``).
    """
    if (model is None) == (run_dir is None):
        raise ConfigError("give --model or --run (exactly one).")
    if run_dir is None:
        return {"model": model, "dtype": dtype or "auto"}
    from tinkergym.config import TrainConfig

    folder = Path(run_dir)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{folder} is not a run folder (no config.json); pass the --out folder of a training run.")
    config = TrainConfig.load(folder / "config.json")
    if not config.scheduler_job:
        raise ConfigError(
            f"{folder} was trained on this machine, not through a scheduler, so no worker has its weights: serve it here with "
            f"tinkergym serve model --run {folder} --api-key-file KEY, or train it with --scheduler URL first."
        )
    return {"model": config.model, "dtype": dtype or config.dtype, "lora_rank": config.lora_rank, "resume_job": config.scheduler_job,
            "served_name": served_name(folder)}


def default_key_file(job_id: str) -> Path:
    """Where the endpoint key of ``job_id`` is written unless told: ``$TINKERGYM_CACHE/jobs/`` or ``~/.cache/tinkergym/jobs/``."""
    return cache_root() / "jobs" / f"{job_id}.key"


class InferenceJob:
    """An inference job of a scheduler: wait for its server, follow it across leases, end it.

    Args:
        client: a :class:`tinkergym.client.SchedulerClient`.
        job_id: the job.
        poll: seconds between looks at the job while it is not running.
        say: where progress lines go (queue position, the endpoint); default stderr.
    """

    def __init__(self, client: Any, job_id: str, *, poll: float = 1.0, say: Callable[[str], None] = print_stderr) -> None:
        self.client, self.job_id, self.poll, self.say = client, job_id, poll, say
        self.endpoint: Endpoint | None = None

    @classmethod
    def submit(cls, client: Any, config: dict[str, Any], *, kind: str = "inference", gpus: int = 1, name: str = "",
               idempotency_key: str | None = None, **options: Any) -> InferenceJob:
        """Queue an inference (or eval) job for ``config`` (see :func:`job_config`) after checking the run it serves has a checkpoint."""
        trained = config.get("resume_job")
        if trained:
            try:
                recorded = client.checkpoints(trained)
            except SchedulerError as exc:
                if exc.status == 404:
                    raise ConfigError(f"the scheduler has no job {trained} (the run's training job) for this key's tenant") from exc
                raise
            if not recorded:
                raise ConfigError(f"job {trained} (the run's training job) has no checkpoint in the scheduler's store yet: "
                                  "serve it once it has saved one (tinkergym jobs show shows its checkpoints)")
        job = client.submit(kind, config, gpus=gpus, name=name, idempotency_key=idempotency_key)
        return cls(client, job["id"], **options)

    def wait(self, after_epoch: int | None = None, timeout: float | None = None) -> Endpoint:
        """Wait until the job's server runs (at a lease epoch above ``after_epoch``) and answers; its :class:`Endpoint`."""
        connection = wait_running(self.client, self.job_id, after_epoch=after_epoch, timeout=timeout, poll=self.poll, say=self.say,
                                  still_queued=f"it stays queued: tinkergym jobs cancel {self.job_id} to drop it")
        self.endpoint = self._endpoint(connection)
        return self.endpoint

    def _endpoint(self, connection: dict[str, Any]) -> Endpoint:
        from tinkergym.backends.endpoint_sampler import EndpointSampler

        url = connection["url"].rstrip("/") + "/v1"
        models = EndpointSampler(url, "", api_key=connection["token"], timeout=30).served_models()
        return Endpoint(url=url, key=connection["token"], epoch=int(connection["epoch"]), models=models)

    def keep_alive(self) -> None:
        """One request to the server (``GET /v1/models``), so its idle timeout does not end a job its client still wants."""
        from tinkergym.backends.endpoint_sampler import EndpointSampler

        if self.endpoint is not None:
            EndpointSampler(self.endpoint.url, "", api_key=self.endpoint.key, timeout=30).served_models()

    def changed(self) -> bool | None:
        """Look at the job once: True when it runs at a new epoch (now :attr:`endpoint`), None while it waits for a new lease,
        False when nothing changed. An ended job raises :class:`InferenceJobEnded`."""
        job = self.client.show(self.job_id)
        if job["state"] in TERMINAL_STATES:
            raise InferenceJobEnded(f"job {self.job_id} is {job['state']}{': ' + job['error'] if job.get('error') else ''}")
        if job["state"] != "running":
            return None
        if self.endpoint is not None and job["lease_epoch"] == self.endpoint.epoch:
            return False
        self.wait(after_epoch=None if self.endpoint is None else self.endpoint.epoch, timeout=60)
        return True

    def end(self) -> str:
        """End the job: complete it when its server ran, else cancel it; the state it is left in."""
        try:
            job = self.client.show(self.job_id)
            if job["state"] in TERMINAL_STATES:
                return job["state"]
            if job["state"] == "running":
                try:
                    return self.client.complete(self.job_id, job["lease_epoch"])["state"]
                except SchedulerError as exc:
                    if exc.status != 409:
                        raise
            return self.client.cancel(self.job_id)["state"]
        except SchedulerError as exc:
            self.say(f"job {self.job_id}: could not end it ({exc}); end it with: tinkergym jobs cancel {self.job_id}")
            return "unknown"
