"""Where the Tinker API's runs and samplers compute: an engine opens them, runs their calls and keeps their checkpoints.

:class:`LocalEngine` (``serve tinker``): one :class:`~tinkergym.backends.torch.shared.SharedBase` in this process;
every run and sampler is a LoRA session on it, and every call goes through the
:class:`~tinkergym.serve.training.shared.SharedWorker`, so the calls of several runs share passes.
:class:`~tinkergym.tinker_api.cluster.ClusterEngine` (the scheduler's front door) runs each one as a scheduler job.

Calls are the Backend protocol's, by name, with their wire results (``sample``, ``logprobs``,
``forward_backward``, ``optim_step``), plus :meth:`save` (a checkpoint under a name) and :meth:`load`. A checkpoint of
kind ``external`` (``save_weights_external``) is a peft adapter folder on this process's disk, whichever engine
computes, so the service can hand out its files.
"""

from __future__ import annotations

import secrets
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinkergym.errors import ConfigError
from tinkergym.plumbing.folders import replace_dir
from tinkergym.serve.training.calls import CallRecord, ParsedCall, named_dir
from tinkergym.serve.training.shared import SharedWorker

#: A checkpoint's kind and the folder its local engine keeps it in.
FOLDERS = {"training": "states", "sampler": "exports", "external": "external"}


def folder_size(folder: Path) -> int:
    """The bytes of the files under ``folder``."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


class EngineError(Exception):
    """A call refused or failed: an HTTP status, and the SDK's error category (user or server)."""

    def __init__(self, status: int, message: str, category: str = "user") -> None:
        super().__init__(message)
        self.status, self.message, self.category = status, message, category


@dataclass
class Saved:
    """Where an engine keeps a checkpoint: ``location`` is the engine's own (a folder, a job's state), ``size`` in bytes."""

    location: Any
    size: int | None = None


@dataclass
class LocalHandle:
    adapter_id: str
    session: Any
    folder: Path
    rank: int


class LocalEngine:
    """Runs and samplers as LoRA sessions of one shared base in this process (see the module docstring)."""

    def __init__(self, base: Any, worker: SharedWorker, root: Path, model_name: str, tokenizer_id: str, max_lora_rank: int = 64) -> None:
        self.base, self.worker, self.root = base, worker, root
        self.model_name, self.tokenizer_id, self.max_lora_rank = model_name, tokenizer_id, max_lora_rank
        config = base.model.config
        self.vocab_size = int(getattr(config, "vocab_size", 0)) or None
        self.max_context = int(getattr(config, "max_position_embeddings", 0)) or None
        self.arch = str(getattr(config, "model_type", ""))

    # ----- what is offered ----------------------------------------------------------------------------
    def models(self) -> list[dict[str, Any]]:
        return [{"model_name": self.model_name, "max_context_length": self.max_context, "trainable": True, "sampleable": True}]

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise EngineError(400, f"base model {name[:200]!r} is not offered by this server; it serves {self.model_name!r} "
                                   "(get_server_capabilities lists it)")

    def model_info(self, name: str) -> dict[str, Any]:
        return {"arch": self.arch, "tokenizer_id": self.tokenizer_id, "vocab_size": self.vocab_size, "max_context": self.max_context}

    def tokenizer(self, name: str) -> Any:
        return self.base.tokenizer

    def vision(self, name: str) -> Any:
        """The served model's image inputs (:class:`~tinkergym.backends.torch.vision.VisionInputs`), or None for a text model."""
        return getattr(self.base, "vision", None)

    # ----- runs and samplers -----------------------------------------------------------------------------
    def _session(self, rank: int, seed: int | None) -> Any:
        from tinkergym.backends.torch.shared import LoraSessionConfig

        if not 1 <= rank <= self.max_lora_rank:
            raise EngineError(400, f"LoRA rank {rank} is not offered: this server takes ranks 1 to {self.max_lora_rank}")
        try:
            # alpha = 32 as Tinker's LoRA: the update is scaled by 32 / rank.
            return self.base.open_session(LoraSessionConfig(lora_rank=rank, lora_alpha=32.0, seed=0 if seed is None else int(seed) % 2**32))
        except ConfigError as exc:
            raise EngineError(429, str(exc)) from exc

    def open_run(self, run_id: str, model: str, rank: int, seed: int | None, credential: str, source: Saved | None = None) -> LocalHandle:
        """A new run's adapter (``source``, a state it is about to load, is the load's to read)."""
        session = self._session(rank, seed)
        folder = (self.root / "runs" / run_id).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        self.worker.add(run_id, session, folder)
        return LocalHandle(run_id, session, folder, rank)

    def open_sampler(self, sampler_id: str, model: str, rank: int, source: Saved | None, credential: str) -> LocalHandle:
        session = self._session(rank, 0)
        try:
            if source is not None:
                folder = source.location
                session.load_state(str(folder)) if (folder / "state.json").is_file() else session.load_adapter(str(folder))
        except Exception:
            self.base.close_session(session)
            raise
        self.worker.add(sampler_id, session, self.root / "samplers")
        return LocalHandle(sampler_id, session, self.root / "samplers", rank)

    def close(self, handle: LocalHandle, forget: bool = False, reason: str | None = None) -> None:
        """Free the handle's adapter; with ``forget``, its checkpoints too. ``reason`` (why it closes) is a cluster job's to keep."""
        self.worker.remove(handle.adapter_id)
        self.base.close_session(handle.session)
        if forget and handle.folder.name == handle.adapter_id:
            shutil.rmtree(handle.folder, ignore_errors=True)

    # ----- calls ---------------------------------------------------------------------------------------------
    def call(self, handle: LocalHandle, method: str, args: dict[str, Any]) -> dict[str, Any]:
        """One call of the Backend protocol on the shared worker, waited for; a failure raises :class:`EngineError`."""
        record = CallRecord(request_id="call-" + secrets.token_hex(8), session_id=handle.adapter_id, seq=0, method=method, fingerprint="",
                            call=ParsedCall(method, args))
        done = threading.Event()
        record.on_done(done.set)
        self.worker.submit(handle.adapter_id, record)
        done.wait()
        if record.error is not None:
            raise EngineError(record.error.status, record.error.message, "user" if record.error.status < 500 else "server")
        return record.result or {}

    def check_name(self, handle: LocalHandle, kind: str, name: str) -> Path:
        """The folder a checkpoint of ``kind`` named ``name`` is kept in, after checking the name (a 400 if it is refused)."""
        try:
            return named_dir(handle.folder, FOLDERS[kind], name)
        except ConfigError as exc:
            raise EngineError(400, str(exc)) from exc

    def save(self, handle: LocalHandle, kind: str, name: str) -> Saved:
        """``training``: the whole state (``save_state``); ``sampler``: the adapter alone (a peft folder); ``external``: the
        adapter alone, kept apart from the sampler checkpoints (a sampler checkpoint of the same name stays as it was)."""
        folder = self.check_name(handle, kind, name)
        if kind == "training":
            self.call(handle, "save_state", {"name": name})
        elif kind == "sampler":
            self.call(handle, "export", {"name": name, "merged": False})
        else:
            staging = "external-" + secrets.token_hex(8)
            self.call(handle, "export", {"name": staging, "merged": False})
            folder.parent.mkdir(parents=True, exist_ok=True)
            replace_dir(str(named_dir(handle.folder, FOLDERS["sampler"], staging)), str(folder))
        return Saved(folder, folder_size(folder))

    def load(self, handle: LocalHandle, saved: Saved, optimizer: bool) -> None:
        """Load a training checkpoint: the weights, and with ``optimizer`` the Adam moments, step and generator too."""
        session = handle.session
        with self.base._lock:
            kept = None if optimizer else (session.optimizer.state_dict(), session.step, session.generator.get_state())
        session.load_state(str(saved.location))
        if kept is not None:  # weights only: the optimizer, step and generator stay the run's
            with self.base._lock:
                session.optimizer.load_state_dict(kept[0])
                session.step = kept[1]
                session.generator.set_state(kept[2])

    def delete(self, saved: Saved) -> None:
        shutil.rmtree(saved.location, ignore_errors=True)
