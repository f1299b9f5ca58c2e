"""Frozen policies for self-play: snapshots of the learner and other runs, served for sampling only.

A snapshot is a backend checkpoint (``save_state``) of the learner, taken every ``snapshot_every`` steps into
``<run>/snapshots/step_N``. It never trains: it samples through a
:class:`~tinkergym.backends.torch.inference.TorchInferenceEngine` (no optimizer, no gradients). LoRA
snapshots are adapters on one shared frozen base (one engine for all of them, switched per call); a full
fine-tuning snapshot is a model of its own (one engine each, so keep ``max_snapshots`` small).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tinkergym.protocol.types import SampleRequest, SampleResponse
from tinkergym.errors import ConfigError


class EngineSampler:
    """The Backend's ``sample`` over one served name of an inference engine."""

    def __init__(self, engine: Any, name: str) -> None:
        self.engine, self.name = engine, name

    def sample(self, request: SampleRequest) -> SampleResponse:
        """Sample ``request`` with the weights served as :attr:`name`."""
        return SampleResponse(sequences=self.engine.generate(self.name, request.prompts, request.params, request.num_samples))


class FrozenPolicies:
    """Samplers for frozen snapshots (``add_checkpoint``) and trained runs (``add_run``), loaded on first use.

    Args:
        model: The learner's base model (a name or folder ``resolve_model`` takes).
        dtype: The compute dtype the learner trains in (snapshots sample in the same one).
        device: Where the frozen weights live (``"auto"``: where the learner's would).
    """

    def __init__(self, model: str, dtype: str = "auto", device: str = "auto") -> None:
        self.model, self.dtype, self.device = model, dtype, device
        self._shared: Any = None  # the LoRA engine every snapshot adapter attaches to
        self._engines: dict[str, Any] = {}

    def add_checkpoint(self, name: str, folder: str | Path) -> EngineSampler:
        """A sampler for the backend checkpoint in ``folder`` (a LoRA adapter, or a full model)."""
        import json

        from tinkergym.backends.serving import ServingPlan
        from tinkergym.backends.torch.inference import TorchInferenceEngine
        from tinkergym.backends.models import resolve_model

        if name in self._engines:
            return EngineSampler(self._engines[name], name)
        folder = Path(folder)
        if not (folder / "state.json").is_file():
            raise ConfigError(f"snapshot {name}: {folder} is not a backend checkpoint (no state.json).")
        saved = json.loads((folder / "state.json").read_text(encoding="utf-8")).get("config", {})
        if int(saved.get("lora_rank", 0)) == 0:
            plan = ServingPlan(base_id=name, base_path=resolve_model(self.model), lora=False, state=str(folder), dtype=self.dtype)
            self._engines[name] = TorchInferenceEngine(plan, device=self.device)
        else:
            if self._shared is None:
                plan = ServingPlan(base_id=f"{self.model}@base", base_path=resolve_model(self.model), dtype=self.dtype)
                self._shared = TorchInferenceEngine(plan, device=self.device)
            self._shared.add_checkpoint_adapter(name, str(folder))
            self._engines[name] = self._shared
        return EngineSampler(self._engines[name], name)

    def add_run(self, name: str, run: str | Path) -> EngineSampler:
        """A sampler for the newest weights of the training run in ``run`` (its adapter on its base, or its full model)."""
        from tinkergym.backends.serving import plan_serving
        from tinkergym.backends.torch.inference import TorchInferenceEngine

        if name not in self._engines:
            plan = plan_serving(run=str(run))
            self._engines[name] = TorchInferenceEngine(plan, device=self.device)
        engine = self._engines[name]
        served = engine.models()
        return EngineSampler(engine, served[-1].id)
