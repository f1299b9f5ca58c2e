"""The torch engine of the inference server and of frozen self-play opponents: a :class:`ServingPlan` served by one
:class:`~tinkergym.backends.torch.backend.TorchBackend`, built the way ``tinkergym eval`` builds it, so a served model
gives the tokens and logprobs of evaluating it locally. Adapters are attached to one peft model (``load_adapter``)
and switched per request under a lock.

Served from a vision-language model's folder (:func:`~tinkergym.backends.models.is_vision_folder`), prompts may carry
images (:class:`~tinkergym.protocol.types.ImageData`), sampled as ``TorchBackend.sample`` samples them;
:meth:`TorchInferenceEngine.image_renderer` is the chat renderer that writes their image tokens (an
:class:`~tinkergym.chat.ImageChatRenderer` of the model's tokenizer and image processor). A prompt whose image tokens do
not match its images is refused, and so are images sent to a text model."""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path
from typing import Any

from tinkergym.backends.serving import ServedModel, ServingPlan, eos_token_ids, check_image_tokens, image_renderer_of
from tinkergym.errors import ConfigError
from tinkergym.protocol.types import ImageData, SampledSequence, SampleRequest, SamplingParams


def _load_checkpoint_adapter(peft_model: Any, internal: str, folder: str) -> None:
    """Attach a backend checkpoint's adapter under ``internal``: its LoRA settings from state.json, its weights renamed."""
    from peft import LoraConfig

    from tinkergym.backends.torch.sharded_states import trainable_weights

    saved = json.loads(Path(folder, "state.json").read_text(encoding="utf-8"))["config"]
    lora = LoraConfig(
        r=saved["lora_rank"], lora_alpha=saved["lora_alpha"], lora_dropout=saved.get("lora_dropout", 0.0),
        target_modules=saved.get("lora_target_modules", "all-linear"), task_type="CAUSAL_LM",
    )
    peft_model.add_adapter(internal, lora)
    weights = trainable_weights(folder)  # a plain state's file, or a sharded state's shards read together
    params = dict(peft_model.named_parameters())
    import torch

    with torch.no_grad():
        for name, value in weights.items():
            target = name.replace(".default.", f".{internal}.")
            if target not in params:
                raise ConfigError(f"{folder}: weight {name} has no place in the model; is it a checkpoint of this base model?")
            params[target].copy_(value)


def _compute_under_autocast(model: Any) -> None:
    """As TorchBackend sets its own adapter: every LoRA adapter computes under autocast (no cast of its inputs)."""
    for module in model.modules():
        if hasattr(module, "lora_A"):
            module.cast_input_dtype_enabled = False


class TorchInferenceEngine:
    """Serves a :class:`ServingPlan` with one :class:`TorchBackend`; requests take turns on it (a lock).

    Args:
        plan: What to serve (see :func:`plan_serving`).
        device: ``"auto"`` or a torch device string.
        max_model_len: Longest prompt plus completion accepted; default the model's position limit.
    """

    def __init__(self, plan: ServingPlan, device: str = "auto", max_model_len: int | None = None) -> None:
        from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig

        self.plan = plan
        config = TorchBackendConfig(model=plan.base_path, dtype=plan.dtype, device=device)
        if not plan.lora:
            config.lora_rank = 0
        self.backend = TorchBackend(config)
        if plan.state is not None:
            self.backend.load_state(plan.state)
        self.tokenizer = self.backend.tokenizer
        model = self.backend.model
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)  # type: ignore[operator]  # an HF/peft method via nn.Module.__getattr__
        text_config = getattr(model.config, "text_config", None) or model.config  # a vision-language model's language model
        limit = getattr(text_config, "max_position_embeddings", None) or 4096
        self.max_model_len = int(max_model_len or limit)
        self.eos_token_ids = eos_token_ids(self.tokenizer, model)
        self._served = [ServedModel(plan.base_id, plan.base_path)]
        self._internal: dict[str, str] = {}  # served adapter name -> peft adapter name (any served name is safe)
        for i, adapter in enumerate(plan.adapters):
            internal = f"served_{i}"
            if adapter.kind == "peft":
                model.load_adapter(adapter.path, adapter_name=internal)  # type: ignore[operator]  # an HF/peft method via nn.Module.__getattr__
            else:
                _load_checkpoint_adapter(model, internal, adapter.path)
            self._internal[adapter.name] = internal
            self._served.append(ServedModel(adapter.name, adapter.path, parent=plan.base_id))
        _compute_under_autocast(model)
        self._lock = threading.Lock()
        self._image_renderer: Any = None

    def add_checkpoint_adapter(self, name: str, folder: str) -> None:
        """Serve one more LoRA adapter, a backend checkpoint's (``state.json``), as ``name`` (e.g. a self-play snapshot)."""
        if not self.plan.lora:
            raise ConfigError(f"{name}: a full fine-tuning model serves no adapters; serve the checkpoint as a model of its own.")
        if name in {m.id for m in self._served}:
            raise ConfigError(f"{name!r} is already served; give each adapter its own name.")
        internal = f"served_{len(self._internal)}"
        with self._lock:
            model = self.backend.model
            _load_checkpoint_adapter(model, internal, folder)
            _compute_under_autocast(model)
        self._internal[name] = internal
        self._served.append(ServedModel(name, folder, parent=self.plan.base_id))

    def models(self) -> list[ServedModel]:
        """The base first, then each adapter in the order given."""
        return list(self._served)

    def _weights(self, name: str) -> contextlib.AbstractContextManager:
        """Make ``name``'s weights the ones the model computes with (call under the lock)."""
        model = self.backend.model
        if name in self._internal:
            model.set_adapter(self._internal[name])  # type: ignore[operator]  # an HF/peft method via nn.Module.__getattr__
            return contextlib.nullcontext()
        if self.plan.lora:
            return model.disable_adapter()  # type: ignore[operator]  # an HF/peft method via nn.Module.__getattr__
        return contextlib.nullcontext()

    def image_renderer(self) -> Any:
        """The :class:`~tinkergym.chat.ImageChatRenderer` of the served vision-language model (made once); a
        :class:`ConfigError` for a text model."""
        if self._image_renderer is None:
            self._image_renderer = image_renderer_of(self.backend.vision, self.tokenizer, self.plan.base_id)
        return self._image_renderer

    def generate(
        self, model: str, prompts: list[list[int]], params: SamplingParams, n: int, images: list[list[ImageData]] | None = None,
    ) -> list[list[SampledSequence]]:
        """``n`` completions of each prompt, all in one ``TorchBackend.sample`` call (``images``: one list per prompt, or none)."""
        if model not in {m.id for m in self._served}:
            raise ConfigError(f"unknown model {model!r}")
        images = images if images and any(images) else []
        check_image_tokens(self.backend.vision, prompts, images, self.plan.base_id)
        request = SampleRequest(prompts=prompts, params=params, num_samples=n, images=images)
        with self._lock, self._weights(model):
            return self.backend.sample(request).sequences
