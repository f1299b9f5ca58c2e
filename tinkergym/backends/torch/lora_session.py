"""One session of a :class:`~tinkergym.backends.torch.shared.SharedBase`: a LoRA adapter of its own with its own
AdamW state, random generator, step counter, saved states and export.

A :class:`LoraSession` implements the :class:`~tinkergym.protocol.backend.Backend` protocol on its own; its calls go
through the base's ``*_many`` methods (each alone), so a session's call and a pass of many sessions run one code path.
What reads or writes the adapter outside a pass (saving, loading, exporting, the optimizer's step) holds the base's lock.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch

from tinkergym.backends.torch import lora_states, multi_lora
from tinkergym.backends.torch.batches import adamw_step, check_weights_finite
from tinkergym.backends.torch.prefix_cache import PrefixCache
from tinkergym.backends.torch.sharded_states import is_sharded_state
from tinkergym.backends.torch.lora_states import BACKEND_STATE_FORMAT, SESSION_KIND, SESSION_STATE_FORMAT
from tinkergym.backends.torch.state_files import check_state_format, read_optimizer_state, write_optimizer_state
from tinkergym.backends.torch.vision import VisionInputs
from tinkergym.errors import ConfigError
from tinkergym.plumbing.folders import fresh_tmp_dir, replace_dir
from tinkergym.protocol.types import ForwardBackwardRequest, ForwardBackwardResult, ImageData, LoraSessionConfig, OptimParams, SampleRequest, SampleResponse


T = TypeVar("T")
Outcome = Any  # a result, or the exception its request raised


class _Named(Protocol):
    model: str


class SessionBase(Protocol):
    """What a session uses of its base (:class:`~tinkergym.backends.torch.shared.SharedBase`): the model and its files, the
    layers its adapter sits in, the lock over passes, the prefix cache, and the ``*_many`` methods its calls go through."""

    device: torch.device
    model: torch.nn.Module
    model_path: str
    tokenizer: Any
    vision: VisionInputs | None
    layers: dict[str, multi_lora.MultiLoraLinear]
    prefix_cache: PrefixCache
    _lock: threading.RLock

    @property
    def config(self) -> _Named: ...

    def info(self) -> dict[str, Any]: ...
    def session_bytes(self, rank: int) -> int: ...
    def close_session(self, session: LoraSession) -> None: ...
    def forward_backward_many(self, calls: Sequence[tuple[LoraSession, ForwardBackwardRequest]]) -> list[Outcome]: ...
    def sample_many(self, calls: Sequence[tuple[LoraSession, SampleRequest]]) -> list[Outcome]: ...
    def logprobs_many(self, calls: Sequence[tuple[LoraSession, tuple]]) -> list[Outcome]: ...




def _holding_base(method: Callable[..., T]) -> Callable[..., T]:
    """Run a session method while holding its base's lock (no pass runs while it reads or writes the adapter)."""

    @functools.wraps(method)
    def locked(self: LoraSession, *args: Any, **kwargs: Any) -> T:
        with self.base._lock:
            return method(self, *args, **kwargs)

    return locked


class LoraSession:
    """One adapter on a :class:`~tinkergym.backends.torch.shared.SharedBase`, with its own optimizer, generator, step, states and export.

    Implements the :class:`~tinkergym.protocol.backend.Backend` protocol; each call runs alone (the base's
    ``*_many`` methods run several sessions' calls together).
    """

    def __init__(self, base: SessionBase, session_id: int, config: LoraSessionConfig) -> None:
        self.base, self.id, self.config = base, session_id, config
        init = torch.Generator().manual_seed(config.seed)
        self.params = multi_lora.add_adapter(base.layers, session_id, config.lora_rank, config.lora_alpha, base.device, init)
        self.optimizer: torch.optim.Optimizer = torch.optim.AdamW(list(self.params.values()), lr=0.0, fused=base.device.type in ("cpu", "cuda"))
        self.generator = torch.Generator(device=base.device).manual_seed(config.seed)
        self.step = 0
        self.closed = False

    @property
    def model(self) -> torch.nn.Module:
        """The shared base's model (a server reads its vocabulary size to refuse token ids past it before any pass)."""
        return self.base.model

    @property
    def joint(self) -> SessionBase:
        """The base whose ``sample_many`` and ``forward_backward_many`` run this session's calls with its other sessions' in
        one pass (:func:`tinkergym.games.sample_calls`: both seats of a game between two adapters in one decode loop)."""
        return self.base

    def close(self) -> None:
        """Free this session's adapter and optimizer state on its base (its other sessions go on); safe to call twice."""
        if not self.closed:
            self.base.close_session(self)

    def _check_open(self) -> None:
        if self.closed:
            raise ConfigError(f"session {self.id} is closed; open a new one")

    def _close(self) -> None:
        self.closed = True
        self.params = {}
        self.optimizer = torch.optim.AdamW([torch.zeros(1)], lr=0.0)

    def _weights_changed(self) -> None:
        """The adapter changed (or a state was saved, which a resumed run starts from with no cache): its cached prefixes go."""
        self.base.prefix_cache.drop_scope(self.id)

    def _saved(self, grads: bool) -> tuple[torch.Tensor, list[torch.Tensor | None] | None]:
        """What a failed joint call must put back: the generator's state, and with ``grads`` the accumulated gradients."""
        kept = [None if p.grad is None else p.grad.clone() for p in self.params.values()] if grads else None
        return self.generator.get_state(), kept

    def _restore(self, generator_state: torch.Tensor, grads: list[torch.Tensor | None] | None) -> None:
        self.generator.set_state(generator_state)
        if grads is not None:
            for p, g in zip(self.params.values(), grads):
                p.grad = g

    @staticmethod
    def _one(outcome: Outcome) -> Any:
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def info(self) -> dict[str, Any]:
        """The base's :meth:`~tinkergym.backends.torch.shared.SharedBase.info`, and this session's adapter, step and memory."""
        return {
            **self.base.info(), "lora_rank": self.config.lora_rank, "lora_alpha": self.config.lora_alpha, "lora_dropout": 0.0,
            "step": self.step, "trainable_params": sum(p.numel() for p in self.params.values()), "session": self.id,
            "session_bytes": self.base.session_bytes(self.config.lora_rank),
        }

    def sample(self, request: SampleRequest) -> SampleResponse:
        return self._one(self.base.sample_many([(self, request)])[0])

    def logprobs(self, sequences: list[list[int]], temperature: float = 1.0, images: list[list[ImageData]] | None = None) -> list[list[float]]:
        """Per-token logprobs of ``sequences`` (entry 0 is 0.0); ``images``: one list per sequence of the images its image tokens
        show (a vision-language base)."""
        return self._one(self.base.logprobs_many([(self, (sequences, temperature) if images is None else (sequences, temperature, images))])[0])

    def forward_backward(self, request: ForwardBackwardRequest) -> ForwardBackwardResult:
        return self._one(self.base.forward_backward_many([(self, request)])[0])

    def optim_step(self, params: OptimParams) -> dict[str, float]:
        """One AdamW step of this session's adapter (see :func:`~tinkergym.backends.torch.batches.adamw_step`)."""
        self._check_open()
        trainable = list(self.params.values())
        with self.base._lock:
            metrics, stepped = adamw_step(self.optimizer, trainable, params, self.step)
            if stepped:
                self.step += 1
                self._weights_changed()
                check_weights_finite(trainable, self.step, params.learning_rate)
        return metrics

    @_holding_base
    def save_state(self, path: str) -> None:
        """The adapter, AdamW state, step and generator into the folder ``path``, atomically (safetensors and JSON)."""
        from safetensors.torch import save_file

        self._check_open()
        self._weights_changed()  # a run resumed from here starts with no cached prefixes: so does this one
        tmp = fresh_tmp_dir(path)
        save_file({n: p.detach().cpu().contiguous() for n, p in self.params.items()}, os.path.join(tmp, "trainable.safetensors"))
        write_optimizer_state(tmp, self.optimizer.state_dict())
        save_file({"generator": self.generator.get_state()}, os.path.join(tmp, "rng.safetensors"))
        meta = {"format": SESSION_STATE_FORMAT, "kind": SESSION_KIND, "step": self.step, "config": self.config.to_dict(), "model_path": self.base.model_path}
        Path(tmp, "state.json").write_text(json.dumps(meta, indent=2) + "\n")
        replace_dir(tmp, os.fspath(path).rstrip("/"))

    @_holding_base
    def load_state(self, path: str) -> None:
        """Restore what :meth:`save_state` wrote (same rank), or what a whole backend's ``save_state`` wrote of a LoRA job of
        the same rank and alpha (:mod:`~tinkergym.backends.torch.lora_states`); everything is read before anything changes.
        Gradients accumulated since the last step are dropped (a state holds none)."""
        from safetensors.torch import load_file

        self._check_open()
        meta = lora_states.read_meta(path)
        if is_sharded_state(path):
            raise ConfigError(f"{path} is a sharded state (saved by a job on several devices); a seat holds a job of one device: "
                              "load it on a whole server (serve backend, or a sharded one), which reads its shards together")
        saved = load_file(os.path.join(path, "trainable.safetensors"), device=str(self.base.device))
        generator_state: torch.Tensor | None
        if lora_states.is_session_state(meta):
            check_state_format(path, meta.get("format"), SESSION_STATE_FORMAT)
            weights = saved
            generator_state = load_file(os.path.join(path, "rng.safetensors"))["generator"]
        else:  # a whole backend's state: the job trained on a server of its own and goes on here
            check_state_format(path, meta.get("format"), BACKEND_STATE_FORMAT)
            lora_states.check_adapter(path, meta, self.config.lora_rank, self.config.lora_alpha)
            weights = lora_states.named_for(saved, session=True)
            generator_state = lora_states.sampler_state(load_file(os.path.join(path, "rng.safetensors")), self.base.device)
        self._check_weights(weights, path)
        optimizer_state = read_optimizer_state(path)
        lora_states.check_optimizer_shapes(path, optimizer_state, list(self.params.values()))
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(weights[name])
                param.grad = None
        self.optimizer.load_state_dict(optimizer_state)
        if generator_state is not None:
            self.generator.set_state(generator_state)
        self.step = int(meta["step"])
        self._weights_changed()

    @_holding_base
    def load_adapter(self, path: str) -> None:
        """Start from the weights of a peft LoRA folder of this session's rank (an export, a published adapter)."""
        self._check_open()
        weights, rank, alpha = multi_lora.read_adapter(path)
        if rank != self.config.lora_rank or alpha != self.config.lora_alpha:
            raise ConfigError(f"{path} is a rank-{rank} adapter with alpha {alpha:g}; this session has rank {self.config.lora_rank}, "
                              f"alpha {self.config.lora_alpha:g}: open a session with the adapter's settings")
        self._check_weights(weights, path)
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(weights[name])
        self._weights_changed()

    def _check_weights(self, weights: dict[str, torch.Tensor], path: str) -> None:
        mismatched = [n for n, p in self.params.items() if n not in weights or weights[n].shape != p.shape]
        if mismatched or len(weights) != len(self.params):
            raise ConfigError(f"{path} holds other adapter weights than this session (rank {self.config.lora_rank} on "
                              f"{len(self.params) // 2} layers of {self.base.config.model}); open a session with the settings it was saved with")

    @_holding_base
    def export(self, path: str, merged: bool = False) -> None:
        """The session's peft adapter folder with the tokenizer; a merged model needs a server of its own (refused)."""
        self._check_open()
        if merged:
            raise ConfigError("a session on a shared base exports its adapter; merge it where the base is loaded alone (tinkergym export --merged)")
        tmp = fresh_tmp_dir(path)
        multi_lora.save_adapter(tmp, self.params, self.config.lora_rank, self.config.lora_alpha, self.base.model_path, multi_lora.target_names(self.base.layers))
        self.base.tokenizer.save_pretrained(tmp)
        if self.base.vision is not None:
            self.base.vision.image_processor.save_pretrained(tmp)
        replace_dir(tmp, os.fspath(path).rstrip("/"))
