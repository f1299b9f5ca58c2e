"""What a served model is: which weights a name means (a plan made before any weights load), and the protocol of the
engines that sample with them.

:func:`plan_serving` turns ``--model`` / ``--run`` / ``--adapter NAME=PATH`` into a :class:`ServingPlan` before
any weights load, so a bad path fails fast. Served names follow vLLM's ``--lora-modules``: the base model under
its own id, and each LoRA adapter under its name with the base as its ``parent``. A full fine-tuning run is a
model of its own (no adapters on it).

Where an adapter comes from:

- a run folder: its ``final/`` export when that is at least as new as its latest checkpoint, else the latest
  checkpoint (a run still training, or stopped early);
- a checkpoint folder (``checkpoints/step_N``, the backend state with ``state.json``);
- an exported peft adapter folder (``adapter_config.json``), e.g. a run's ``final/``.

:class:`~tinkergym.backends.torch.inference.TorchInferenceEngine` samples with :class:`~tinkergym.backends.torch.backend.TorchBackend`, built the
way ``tinkergym eval`` builds it, so a served model gives the tokens and logprobs of evaluating it locally.
Adapters are attached to one peft model (``load_adapter``) and switched per request under a lock. Served from a
vision-language model's folder, it samples prompts with images too (:meth:`InferenceEngine.image_renderer` renders them).
:class:`~tinkergym.backends.vllm.inference.VLLMInferenceEngine` implements the same
:class:`InferenceEngine` protocol with a ``vllm.LLM`` (``serve model --engine``), images included where vLLM loads the model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tinkergym.protocol.types import ImageData, SampledSequence, SamplingParams
from tinkergym.errors import ConfigError


@dataclass(frozen=True)
class ServedModel:
    """One name a request's ``model`` may take: the base, a LoRA adapter on it (``parent`` = the base id) or a full model."""

    id: str
    root: str
    parent: str | None = None


class InferenceEngine(Protocol):
    """Sampling for the inference server: token prompts in, token ids and their logprobs out."""

    tokenizer: Any
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]

    def models(self) -> list[ServedModel]:
        """The served names: the base first, then each adapter."""

    def image_renderer(self) -> Any:
        """The chat renderer of requests with images (:class:`~tinkergym.chat.ImageChatRenderer` of the served model); a
        :class:`ConfigError` saying why when this engine or its model takes no images."""

    def generate(
        self, model: str, prompts: list[list[int]], params: SamplingParams, n: int, images: list[list[ImageData]] | None = None,
    ) -> list[list[SampledSequence]]:
        """``n`` completions of each prompt with the weights named ``model`` (one of :meth:`models`); ``images``: none, or
        one list per prompt of the images its image tokens show (refused with a :class:`ConfigError` where none are taken)."""


def _reads_no_images(base_id: str) -> ConfigError:
    return ConfigError(f"the served model {base_id} is a text model and reads no images; send text only, or serve a vision-language model")


def image_renderer_of(vision: Any, tokenizer: Any, base_id: str) -> Any:
    """The :class:`~tinkergym.chat.ImageChatRenderer` of a served vision-language model whose image inputs are ``vision``
    (:class:`~tinkergym.backends.torch.vision.VisionInputs`); a :class:`ConfigError` for a text model (``vision`` None)."""
    if vision is None:
        raise _reads_no_images(base_id)
    from tinkergym.chat import ImageChatRenderer

    return ImageChatRenderer(tokenizer, vision.image_processor, image_token=str(tokenizer.convert_ids_to_tokens(vision.image_token_id)))


def check_image_tokens(vision: Any, prompts: list[list[int]], images: list[list[ImageData]], base_id: str) -> None:
    """Images only to a vision-language model (``vision`` not None), and each prompt holding as many image tokens as its
    images make features (none without images): :meth:`VisionInputs.check_rows`; a :class:`ConfigError` says what is wrong."""
    if vision is None:
        if any(images):
            raise _reads_no_images(base_id)
        return
    rows = [images[i] if i < len(images) else [] for i in range(len(prompts))]
    vision.check_rows(prompts, rows, "prompt", advice="send images as chat image_url parts, which are rendered with their image tokens")


@dataclass
class AdapterSource:
    """A LoRA adapter to serve: an exported peft folder (``kind="peft"``) or a backend checkpoint (``kind="checkpoint"``)."""

    name: str
    path: str
    kind: str
    dtype: str | None = None  # the compute dtype it was trained in, when its run or checkpoint says


@dataclass
class ServingPlan:
    """Resolved paths and settings of what to serve; nothing is loaded yet.

    ``lora``: the base is built with a peft wrapper that adapters attach to (as ``tinkergym eval --model``
    builds it); False for a full fine-tuning run's model, built as ``tinkergym eval --run`` builds it, with
    ``state`` the checkpoint to load into it when the run has no up-to-date ``final/``.
    """

    base_id: str
    base_path: str
    lora: bool = True
    state: str | None = None
    adapters: list[AdapterSource] = field(default_factory=list)
    dtype: str = "auto"


def _run_config(folder: Path) -> Any:
    from tinkergym.config import TrainConfig

    if not (folder / "config.json").is_file():
        raise ConfigError(f"{folder} is not a run folder (no config.json); pass the --out folder of a training run.")
    return TrainConfig.load(folder / "config.json").validate()


def _is_run(folder: Path) -> bool:
    return (folder / "config.json").is_file() and ((folder / "checkpoints").is_dir() or (folder / "metrics.jsonl").is_file())


def run_weights(folder: Path) -> tuple[Path, str]:
    """The newest weights of a run: ``(final/, "export")`` when it is up to date, else ``(checkpoint, "checkpoint")``."""
    from tinkergym.plumbing.folders import latest_checkpoint

    checkpoint = latest_checkpoint(folder)
    final = folder / "final"
    if final.is_dir() and (checkpoint is None or final.stat().st_mtime_ns >= checkpoint[1].stat().st_mtime_ns):
        return final, "export"
    if checkpoint is None:
        raise ConfigError(f"{folder} has no checkpoint and no final/ yet; train it first (tinkergym train --out {folder}).")
    return checkpoint[1], "checkpoint"


def _same_folder(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def adapter_source(name: str, path: str, base_path: str) -> AdapterSource:
    """Check one ``--adapter NAME=PATH`` against the base and say where its weights are."""
    from tinkergym.backends.models import resolve_model

    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"--adapter {name}={path}: no such folder; give a run folder, a checkpoint or an exported adapter.")
    trained_on: str | None = None
    dtype: str | None = None
    if _is_run(folder):
        config = _run_config(folder)
        dtype = config.dtype
        if config.lora_rank == 0:
            raise ConfigError(f"--adapter {name}={path}: a full fine-tuning run is a model, not an adapter; serve it with --run {path}.")
        trained_on = resolve_model(config.model)
        folder, _ = run_weights(folder)
    if (folder / "state.json").is_file():
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
        if int(state.get("config", {}).get("lora_rank", 0)) == 0:
            raise ConfigError(f"--adapter {name}={path}: a full fine-tuning checkpoint is a model, not an adapter.")
        trained_on = trained_on or state.get("model_path")
        dtype = dtype or state.get("config", {}).get("dtype")
        kind = "checkpoint"
    elif (folder / "adapter_config.json").is_file():
        adapter_config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
        trained_on = trained_on or adapter_config.get("base_model_name_or_path")
        kind = "peft"
    else:
        raise ConfigError(f"--adapter {name}={path}: not a run, a checkpoint (state.json) or an adapter folder (adapter_config.json).")
    if trained_on and os.path.isdir(trained_on) and not _same_folder(trained_on, base_path):
        raise ConfigError(f"--adapter {name}={path} was trained on {trained_on}, not on the served base {base_path}; serve it with --model {trained_on}.")
    return AdapterSource(name=name, path=str(folder), kind=kind, dtype=dtype)


def plan_serving(
    model: str | None = None, run: str | None = None, adapters: Sequence[tuple[str, str]] = (), dtype: str | None = None,
    checkpoint: tuple[str, str] | None = None,
) -> ServingPlan:
    """What ``serve model`` serves: ``model`` (a base for ``adapters``) or a ``run`` (its adapter on its base, or its full model).

    ``checkpoint`` (NAME, PATH), with ``model``: a backend checkpoint folder (``state.json``) served as NAME: a LoRA
    checkpoint as an adapter on ``model``, a full fine-tuning one as a model of its own in place of ``model``.
    """
    from tinkergym.backends.models import resolve_model

    if (model is None) == (run is None):
        raise ConfigError("give --model or --run (exactly one).")
    if checkpoint is not None:
        if run is not None:
            raise ConfigError("--checkpoint serves a checkpoint of --model's architecture: give --model, not --run.")
        assert model is not None  # exactly one of model and run is given
        name, path = checkpoint
        folder = Path(path)
        if not (folder / "state.json").is_file():
            raise ConfigError(f"--checkpoint {name}={path}: not a checkpoint folder (no state.json); pass checkpoints/step_N of a run.")
        if not name or name == model:
            raise ConfigError(f"--checkpoint {name}={path}: give it a name of its own, other than the base model's.")
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
        if int(state.get("config", {}).get("lora_rank", 0)) == 0:
            if adapters:
                raise ConfigError(f"--checkpoint {name}={path} is a full fine-tuning checkpoint: it is served as a model of its own, without adapters.")
            return ServingPlan(base_id=name, base_path=resolve_model(model), lora=False, state=str(folder),
                               dtype=dtype or state.get("config", {}).get("dtype") or "auto")
        adapters = [(name, path), *adapters]
    if run is None:
        assert model is not None  # exactly one of model and run is given
        plan = ServingPlan(base_id=model, base_path=resolve_model(model), dtype=dtype or "auto")
    else:
        folder = Path(run)
        config = _run_config(folder)
        plan = ServingPlan(base_id=config.model, base_path=resolve_model(config.model), dtype=dtype or config.dtype)
        if config.lora_rank == 0:
            if adapters:
                raise ConfigError(f"{run} is a full fine-tuning run: it is served as a model of its own, without adapters.")
            weights, kind = run_weights(folder)
            name = folder.resolve().name
            plan = ServingPlan(base_id=name, base_path=plan.base_path, lora=False, dtype=plan.dtype)
            if kind == "export":
                plan.base_path = str(weights)
            else:
                plan.state = str(weights)
            return plan
        adapters = [(folder.resolve().name, run), *adapters]
    names = [plan.base_id]
    for name, path in adapters:
        if not name or name in names:
            raise ConfigError(f"--adapter {name}={path}: the name {name!r} is {'empty' if not name else 'already served'}; give each adapter its own name.")
        names.append(name)
        plan.adapters.append(adapter_source(name, path, plan.base_path))
    if dtype is None and plan.adapters:
        # Evaluated locally, an adapter computes in the dtype it was trained in: serve it in the same one.
        plan.dtype = plan.adapters[0].dtype or plan.dtype
    return plan


def eos_token_ids(tokenizer: Any, model: Any) -> list[int]:
    """End-of-sequence ids a completion stops at unless ``ignore_eos``: the tokenizer's and the generation config's (as vLLM)."""
    ids = {tokenizer.eos_token_id}
    generation = getattr(model, "generation_config", None)
    extra = getattr(generation, "eos_token_id", None)
    ids.update(extra if isinstance(extra, (list, tuple)) else [extra])
    return sorted(i for i in ids if isinstance(i, int))
