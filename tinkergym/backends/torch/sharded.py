"""TorchBackend on every rank of a process group: the model sharded with FSDP2, the batch split across ranks.

Each rank runs the same calls with the same arguments (SPMD, as under ``torchrun``): ``forward_backward`` with the
whole request, ``optim_step``, ``save_state``, and so on. What each rank does:

- **Sharding.** Each decoder layer (the model's ``_no_split_modules`` classes) and then the whole model are wrapped with
  :func:`torch.distributed.fsdp.fully_shard`, so each rank holds ``1/world`` of every weight the layers hold. In full
  fine-tuning every weight trains and its gradient is reduce-scattered summed (``set_gradient_divide_factor(1)``: the
  loss of each rank is its share of one sum, not a mean of ranks). With LoRA the frozen base is sharded and the adapter
  is left out of FSDP (``ignored_params``): each rank keeps all of it, small as it is, and its gradients are all-reduced
  summed before the optimizer step, which is the same on every rank. With float32 masters under a lower compute dtype
  (full fine-tuning in bfloat16), FSDP2 casts the weights it gathers to that dtype and reduces gradients in float32
  (``MixedPrecisionPolicy``).
- **The batch.** :func:`split_rows` gives each rank a contiguous run of rows of about equal tokens, cut only where a new
  prompt starts, so a group that shares a prompt stays on one rank. (Its prompt is computed with each row for now: see
  :meth:`ShardedTorchBackend.plan`.) The loss is normalized
  by the whole request's tokens or sequences on every rank, so the summed gradients are the single process's. Every
  rank runs as many micro-batches as the busiest one: a rank short of rows runs a pass of zero weight, because every
  forward and backward of a sharded model gathers weights from all ranks. Gradients are synchronised after the last
  micro-batch only. Metric sums are added over ranks; logprobs come back to every rank.
- **Vision-language models.** A batch's rows with images may all fall on one rank, and only the passes with images run
  the vision tower, so its weights cannot be gathered the way a decoder layer's are (a rank would wait for a gather its
  peers never start). The vision side (every weight outside the language model and its output layer) is left out of
  FSDP like the adapter: whole on every rank; in full fine-tuning its gradients are summed over ranks before the step,
  as the adapter's are. Only the language model's decoder layers are sharded.
- **Sampling** is data-parallel (:mod:`~tinkergym.backends.torch.sharded_rollouts`): each rank decodes its share of
  the request's prompts (whole groups) on a whole copy of the model kept in step with the trained weights, each sample
  from its own seed, and the ranks gather the samples: the same samples at any number of ranks, N ranks decoding at
  once. A model whose copy does not fit beside the shards samples in lockstep instead (``rollouts="lockstep"``): every
  rank decodes the whole request on the sharded model, drawing the same tokens, so the weight gathers line up.
- **Scoring** (``logprobs``) runs on the sharded model with every rank given the same request (SPMD).
- **Export** gathers the weights whole on rank 0's host and writes one ordinary peft or transformers folder.
- **States** are saved with :mod:`torch.distributed.checkpoint` (``get_state_dict``: the weights and the optimizer's
  state, sharded, each rank writing its shards) plus ``state.json``, and load at any number of ranks, one included
  (:func:`load_sharded_state` on a plain :class:`TorchBackend`).

gloo on CPUs, NCCL on GPUs (``init_process_group`` picks by device). A collective that waits past ``timeout`` (the
process group's) raises instead of hanging, so a rank that dies ends its peers.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from datetime import timedelta
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tinkergym.backends.torch import lora_states, losses, multi_lora, sharded_rollouts
from tinkergym.backends.torch.backend import TorchBackend, TorchBackendConfig
from tinkergym.backends.torch.batches import request_normalizers
from tinkergym.backends.torch.sizing import in_language_model
from tinkergym.errors import ConfigError
from tinkergym.backends.torch.sharded_states import (  # noqa: F401 - load_sharded_state, trainable_weights: public here too
    SHARDED_FORMAT, sharded_meta, trainable_only, dcp_folder, keep_index, load_sharded_state, trainable_weights,
)
from tinkergym.plumbing.folders import fresh_tmp_dir, replace_dir
from tinkergym.protocol.seeds import sample_seeds
from tinkergym.protocol.types import Datum, ForwardBackwardRequest, ForwardBackwardResult, SampleRequest, SampleResponse, SampledSequence

#: Seconds a collective waits for its peers before it raises (a dead rank ends the others).
DEFAULT_TIMEOUT_S = 600.0


log = logging.getLogger("tinkergym.sharded")


def init_process_group(device: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the process group the environment describes (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, as
    torchrun sets them): NCCL for CUDA devices, gloo otherwise."""
    if not dist.is_initialized():
        if device.startswith("cuda"):
            # This rank's GPU is the current device before NCCL starts: NCCL, and the mesh fully_shard makes, use the
            # current device (cuda:0 on every rank otherwise, which NCCL refuses as a duplicate GPU).
            torch.cuda.set_device(torch.device(device))
            dist.init_process_group("nccl", timeout=timedelta(seconds=timeout_s), device_id=torch.device(device))
        else:
            dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))


def prompt_length(datum: Datum) -> int:
    """Tokens before the first masked-in position (the row's prompt)."""
    for i, weight in enumerate(datum.loss_mask):
        if weight:
            return i
    return len(datum.tokens)


def split_rows(data: list[Datum], world: int) -> list[range]:
    """Contiguous runs of rows, one per rank, of about equal tokens; a cut falls only where a row's prompt differs from
    the row before it (rows that share a prompt stay together). A rank may get no rows."""
    starts = [0] + [i for i in range(1, len(data))
                    if data[i].tokens[:prompt_length(data[i])] != data[i - 1].tokens[:prompt_length(data[i - 1])]]
    sizes = [sum(len(d.tokens) for d in data[a:b]) for a, b in zip(starts, [*starts[1:], len(data)])]
    before = [sum(sizes[:j]) for j in range(len(starts))]  # tokens ahead of each group
    total = sum(sizes)
    bounds, last = [0], 0
    for cut in range(1, world):  # each cut at the group start nearest its share of the tokens, after the cut before
        options = range(last + 1, len(starts))
        if not options:
            break
        last = min(options, key=lambda j: abs(before[j] - total * cut / world))
        bounds.append(starts[last])
    bounds += [len(data)] * (world + 1 - len(bounds))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def decoder_layers(model: torch.nn.Module, language_model_only: bool = False) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules of its ``_no_split_modules`` classes (transformers names them); with
    ``language_model_only`` (a vision-language model) those of its language model only."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    layers = [m for n, m in model.named_modules() if type(m).__name__ in names and (not language_model_only or in_language_model(n))]
    if not layers:
        raise ConfigError(f"{type(model).__name__} names no repeated blocks (_no_split_modules): it cannot be sharded layer by layer")
    return layers


class ShardedTorchBackend(TorchBackend):
    """:class:`TorchBackend` on one rank of the process group (see the module's notes)."""

    #: No snapshots to sample from while training (``async_steps``): a rank holds a shard of the weights only.
    sampling_snapshot = None

    def __init__(self, config: TorchBackendConfig | None = None, rollouts: str = "auto", engine: Callable[[Any], Any] | None = None) -> None:
        """``rollouts``: how sample requests run (:data:`~tinkergym.backends.torch.sharded_rollouts.ROLLOUT_MODES`):
        ``auto`` splits them across the ranks when a whole copy of the model fits on every device, else runs them in
        lockstep; ``split`` and ``lockstep`` choose; ``vllm`` splits them across engines beside the ranks, each built by
        ``engine(backend)`` at the first sample (:func:`tinkergym.backends.vllm.ranks.sharded_with_vllm` passes it)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if not dist.is_initialized():
            raise ConfigError("ShardedTorchBackend needs a process group: call init_process_group() first (torchrun sets its environment)")
        if rollouts not in sharded_rollouts.ROLLOUT_MODES:
            raise ConfigError(f"rollouts must be one of {', '.join(sharded_rollouts.ROLLOUT_MODES)}, not {rollouts!r}")
        if (engine is not None) != (rollouts == "vllm"):
            raise ConfigError("rollouts='vllm' and an engine go together: build the backend with tinkergym.backends.vllm.ranks.sharded_with_vllm")
        super().__init__(config)
        self.rollouts, self._build_engine = rollouts, engine
        self._engine: Any = None
        self._replica: torch.nn.Module | None = None
        self._replica_stale = True  # the trained weights changed since the replica took them
        #: The prompts (indices) of the last sample request this rank decoded (all of them in lockstep).
        self.last_share: list[int] = []
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        lora = [p for _, p in self._trainable] if self.is_lora else []
        # A vision-language model's vision side runs only in the passes whose rows carry images, which differ by rank: it is
        # kept whole on every rank, out of FSDP, so that no rank waits for a weight gather its peers never start.
        vision = [p for n, p in self.model.named_parameters() if not in_language_model(n) and ".lm_head." not in f".{n}"] if self.reads_images else []
        cast = self.param_dtype != self.dtype  # float32 masters, a lower compute dtype
        policy = MixedPrecisionPolicy(param_dtype=self.dtype if cast else None, reduce_dtype=torch.float32 if cast else None)
        ignored = set(lora) | set(vision) or None
        # The model was loaded on the host (_load_base): each fully_shard moves the weights it wraps to this rank's device
        # and keeps its shard there, so a device holds one whole layer at most while loading, never the whole model.
        self.fsdp_modules = [fully_shard(layer, mp_policy=policy, ignored_params=ignored)
                             for layer in decoder_layers(self.model, language_model_only=self.reads_images)]
        self.fsdp_modules.append(fully_shard(self.model, mp_policy=policy, ignored_params=ignored))
        with torch.no_grad():
            for param in [*lora, *vision]:  # left out of FSDP, so not moved by it: whole on every rank's device
                param.data = param.data.to(self.device)
        #: Trained weights every rank keeps whole (the adapter; the vision side in full fine-tuning): their gradients are
        #: summed over ranks before each step.
        self._replicated = [p for p in [*lora, *vision] if p.requires_grad]
        for module in self.fsdp_modules:
            module.set_gradient_divide_factor(1.0)  # each rank's loss is its share of one sum
            module.set_force_sum_reduction_for_comms(True)  # plain sums (gloo has no pre-multiplied sum)
        self._trainable = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        # DTensor parameters: the plain per-parameter AdamW (the fused kernel takes plain tensors).
        self.optimizer = torch.optim.AdamW([p for _, p in self._trainable], lr=0.0, foreach=False)

    def _load_base(self, dtype: torch.dtype, device: torch.device | None = None) -> torch.nn.Module:
        """The whole model on the host (unless ``device`` says otherwise): fully_shard moves it to the device shard by shard."""
        return super()._load_base(dtype, torch.device("cpu") if device is None else device)

    def info(self) -> dict[str, Any]:
        return {**super().info(), "ranks": self.world, "rank": self.rank, "rollouts": self.rollouts}

    def plan(self, data: list[Datum], share_prefixes: bool | None = None) -> list[Any]:
        """Micro-batches without shared-prompt passes: a prompt computed once and reused by its completions runs each
        layer twice in one graph, and FSDP2 reshards a layer's weights after its first backward (the second then finds
        them freed). A group still stays on one rank (:func:`split_rows`), ready for that sharing."""
        return super().plan(data, share_prefixes=False)

    # ----- training ---------------------------------------------------------------------------------
    def forward_backward(self, request: ForwardBackwardRequest) -> ForwardBackwardResult:
        spec, data = request.loss, request.data
        self._check_data(data, spec)
        if self._engine is not None:
            self._engine.sleep()  # its memory to the training pass, where vLLM has sleep mode
        self.prefix_cache.clear()
        total_mask, num_sequences = request_normalizers(request)  # the whole request's, on every rank
        mine = list(split_rows(data, self.world)[self.rank])
        rows = [data[i] for i in mine]
        plan = self.plan(rows) if rows else []
        passes = torch.tensor([len(plan)], dtype=torch.int64, device=self.device)  # NCCL reduces device tensors only
        dist.all_reduce(passes, op=dist.ReduceOp.MAX)
        filler = self.plan([data[0]])[0]  # a pass of zero weight for a rank with fewer micro-batches
        self.model.train()
        micro_sums: list[dict[str, torch.Tensor]] = []
        scored: dict[int, list[float]] = {}
        with self._compute():
            for k in range(int(passes.item())):
                last = k == int(passes.item()) - 1
                for module in self.fsdp_modules:
                    module.set_requires_gradient_sync(last, recurse=False)
                if k < len(plan):
                    sums, logprobs = self._train_micro(rows, plan[k], spec, total_mask, num_sequences)
                    micro_sums.append(sums)
                    if request.return_logprobs:
                        for i, row in zip(plan[k].indices, logprobs.detach().float().cpu().tolist()):
                            scored[mine[i]] = row[: len(rows[i].tokens)]
                else:
                    self._train_micro(data, filler, spec, total_mask, num_sequences, scale=0.0)
        if self._replicated:
            self._all_reduce_grads()
        totals: dict[str, float] = {}
        for floats in losses.sums_to_floats(micro_sums):
            totals = losses.add_sums(totals, floats)
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, (totals, scored))
        summed: dict[str, float] = {}
        merged: dict[int, list[float]] = {}
        for rank_totals, rank_scored in everyone:  # added in rank order, in float64
            summed = losses.add_sums(summed, rank_totals)
            merged.update(rank_scored)
        scored_rows = [merged[i] for i in range(len(data))] if request.return_logprobs else None
        return ForwardBackwardResult(metrics=losses.finalize_metrics(summed), logprobs=scored_rows)

    def logprobs(self, sequences: list[list[int]], temperature: float = 1.0, images: list[list[Any]] | None = None) -> list[list[float]]:
        if self._engine is not None:
            self._engine.sleep()  # scoring runs on the sharded model: a training-sized pass
        return super().logprobs(sequences, temperature, images)

    def _all_reduce_grads(self) -> None:
        """Sum the gradients of the weights every rank keeps whole over ranks (a rank that trained nothing adds zeros)."""
        for param in self._replicated:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)

    # ----- sampling, scoring and export -------------------------------------------------------------
    def _weights_changed(self) -> None:
        self._replica_stale = True
        if self._engine is not None:
            self._engine.stale = True
        super()._weights_changed()

    def _sample_current(self, request: SampleRequest) -> SampleResponse:
        """Each rank samples its share of the prompts on its replica, and every rank returns all the samples (see
        :mod:`~tinkergym.backends.torch.sharded_rollouts`); in lockstep, the whole request on the sharded model."""
        self._check_sample(request)  # on every rank, on the whole request: no rank goes on to wait for one that refused it
        decode = self._share_decoder()
        if decode is None:
            self.last_share = list(range(len(request.prompts)))
            return super()._sample_current(request)
        seed = request.params.seed
        if seed is None:  # rank 0's draw, for every rank: the samples are then seeded, whatever the ranks
            drawn: list[Any] = [int(torch.randint(0, 2**62, (1,)).item())]  # every rank draws, so their generators stay alike
            dist.broadcast_object_list(drawn, src=0)
            seed = drawn[0]
        seeds = sample_seeds(request.prompts, request.num_samples, seed, request.images)
        mine = sharded_rollouts.split_prompts(request.prompts, request.images, request.num_samples, request.params.max_new_tokens,
                                              self.world)[self.rank]
        self.last_share = mine
        outcome: tuple[list[int], list[list[SampledSequence]] | None, str | None] = (mine, [], None)
        if mine:
            share = SampleRequest([request.prompts[i] for i in mine], request.params, request.num_samples,
                                  [request.images[i] for i in mine] if request.images else [])
            try:
                outcome = (mine, decode(share, [seeds[i] for i in mine]), None)
            except Exception as exc:  # noqa: BLE001 - every rank hears of it (below) rather than wait for this one
                outcome = (mine, None, f"{type(exc).__name__}: {exc}")
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, outcome)
        failed = [f"rank {r}: {error}" for r, (_, _, error) in enumerate(everyone) if error is not None]
        if failed:
            raise RuntimeError("sampling failed on " + "; ".join(failed))
        sequences: dict[int, list[SampledSequence]] = {}
        for indices, rows, _ in everyone:
            sequences.update(zip(indices, rows))
        return SampleResponse(sequences=[sequences[i] for i in range(len(request.prompts))])

    def _share_decoder(self) -> Callable[[SampleRequest, list[list[int]]], list[list[SampledSequence]]] | None:
        """What decodes this rank's share of a request (its engine, or its replica), ready for the current weights; None in
        lockstep. Every rank calls it at the same point: building or syncing may gather."""
        if self._build_engine is not None:
            if self._engine is None:
                self._engine = self._build_engine(self)
            self._engine.prepare()
            return self._engine.sample
        replica = self._rollout_replica()
        if replica is None:
            return None
        return lambda share, seeds: self._sample(share, replica, ("replica",), seeds).sequences

    def close(self) -> None:
        """Shut the engine beside this rank down, if any (the process group stays)."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def export_adapter_here(self, folder: str) -> None:
        """This rank's adapter (whole on every rank) as a peft folder in ``folder``, written by this rank alone."""
        params = lora_states.named_for(dict(self._trainable), session=True)  # peft's saved names, without the adapter's
        targets = sorted({name.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for name in params})
        multi_lora.save_adapter(folder, params, self.config.lora_rank, self.config.lora_alpha, self.model_path, targets)

    def export_here(self, folder: str) -> None:
        """The whole model as a transformers folder in ``folder`` on every rank (a collective: the weights are gathered on
        every rank, and each writes its own folder)."""
        model = self._whole_model(self.full_state(rank0_only=False))
        # transformers writes a model's files on rank 0 alone when a process group exists; this copy is this rank's own.
        model.should_save_on_this_rank = lambda is_main_process: True  # type: ignore[assignment]  # an instance attribute over transformers method
        self._write_export(model, folder, merged=False)

    def _whole_model(self, state: dict[str, torch.Tensor]) -> torch.nn.Module:
        """A plain model on the host holding ``state``, the weights gathered whole (:meth:`full_state`)."""
        model = self._load_base(self.param_dtype, torch.device("cpu"))
        if self.is_lora:
            model = self._add_lora(model)
        model.load_state_dict({name: tensor.cpu() for name, tensor in state.items()})
        return model

    def _rollout_replica(self) -> torch.nn.Module | None:
        """This rank's whole copy of the model with the current weights (built at the first sample, refreshed after an
        update); None where requests run in lockstep. Every rank calls it at the same point: refreshing gathers."""
        if self.rollouts == "lockstep":
            return None
        if self._replica is None:
            fits = torch.tensor([int(self.rollouts == "split" or sharded_rollouts.replica_fits(self.model, self.dtype, self.device))],
                                device=self.device)  # NCCL reduces device tensors only
            dist.all_reduce(fits, op=dist.ReduceOp.MIN)  # one answer for all ranks, or they would wait on each other
            if not fits.item():
                need = sharded_rollouts.replica_bytes(self.model, self.dtype) / 2**30
                log.warning("a whole copy of the model (%.1f GiB) does not fit on every rank's device beside its shards: every rank "
                            "samples the whole request in lockstep (one device's speed)", need)
                self.rollouts = "lockstep"
                return None
            # peft's own draws for the adapter it adds leave the run's generator alone
            with torch.random.fork_rng(devices=[self.device.index or 0] if self.device.type == "cuda" else []):
                base = self._load_base(self.dtype, self.device)
                self._replica = (self._add_lora(base) if self.is_lora else base).requires_grad_(False).eval()
            self._replica_stale = True
        if self._replica_stale:
            sharded_rollouts.copy_weights(self.model, self._replica, trained_only=self.is_lora)  # LoRA: the base never changes
            self._replica_stale = False
        return self._replica
    def _sampling_model(self) -> torch.nn.Module:
        """The sharded model itself: FSDP2 gathers each layer in the compute dtype as it runs (no cast copy needed, and a
        merged copy cannot be made of shards). Every rank samples the same request in step (SPMD), so their passes, and
        the gathers they need, line up."""
        return self.model.eval()

    def full_state(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """Every weight of the model gathered whole, on the host (a collective: every rank calls it); with ``rank0_only``
        the other ranks get an empty dict."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return dict(get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)))  # type: ignore[arg-type]

    def export(self, path: str, merged: bool = False) -> None:
        """One ordinary peft or transformers folder (as :meth:`TorchBackend.export`), written by rank 0 from the weights
        gathered whole on the host; every rank calls it."""
        state = self.full_state()
        if self.rank == 0:
            self._write_export(self._whole_model(state), path, merged)
        dist.barrier()

    # ----- states -----------------------------------------------------------------------------------
    def save_state(self, path: str) -> None:
        """Write the sharded weights and optimizer state (every rank its shards) and ``state.json`` (rank 0)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.prefix_cache.clear()
        target = os.fspath(path).rstrip("/")
        tmp = fresh_tmp_dir(target) if self.rank == 0 else None
        shared: list[Any] = [tmp]
        dist.broadcast_object_list(shared, src=0)
        tmp = shared[0]
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": trainable_only(model_state, self._trainable), "optim": optim_state}, checkpoint_id=os.path.join(tmp, "dcp"))
        dist.barrier()
        if self.rank == 0:
            keep_index(os.path.join(tmp, "dcp"))
            meta = {"format": SHARDED_FORMAT, "step": self.step, "ranks": self.world, "config": self.config.to_dict(), "model_path": self.model_path}
            Path(tmp, "state.json").write_text(json.dumps(meta, indent=2) + "\n")
            replace_dir(tmp, target)
        dist.barrier()

    def load_state(self, path: str) -> None:
        """Load a sharded state saved at any number of ranks; gradients accumulated since the last step are dropped."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        meta = sharded_meta(path)
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": trainable_only(model_state, self._trainable), "optim": optim_state}
        if self.rank == 0:
            dcp_folder(path)  # the index back in place, once, before any rank reads it
        dist.barrier()
        dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=False))
        self._weights_changed()
        self.optimizer.zero_grad(set_to_none=True)  # a state holds no pending gradients (see TorchBackend.load_state)
        self.step = int(meta["step"])


# ----- one server, many ranks ---------------------------------------------------------------------------
#: Seconds an idle server's rank 0 lets pass before it tells the other ranks it is alive (their wait for the next call
#: is a collective, which times out).
PING_S = 30.0
#: Calls run on rank 0 alone: they read nothing the ranks share.
LOCAL_CALLS = frozenset({"info", "tokenizer_files"})


class Lockstep:
    """Rank 0's backend when other ranks follow it (:func:`follow`): every method call is sent to every rank first
    (``broadcast_object_list``) and then run here, so all ranks run it with the same arguments, in the same order.

    A server's calls come one at a time (its call worker's thread); a ping every ``PING_S`` seconds of quiet keeps the
    followers' wait under the process group's timeout. :meth:`close` ends the followers. An error a call raises here is
    raised on every rank from the same arguments; the followers drop theirs (the client gets rank 0's).
    """

    def __init__(self, backend: ShardedTorchBackend, ping_s: float = PING_S) -> None:
        self.backend, self.ping_s = backend, ping_s
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._closed = threading.Event()
        self._pinger = threading.Thread(target=self._ping, name="tinkergym-rank-ping", daemon=True)
        self._pinger.start()

    def _send(self, message: list[Any]) -> None:
        dist.broadcast_object_list([message], src=0)
        self._last = time.monotonic()

    def _ping(self) -> None:
        while not self._closed.wait(max(0.1, self.ping_s - (time.monotonic() - self._last))):
            with self._lock:
                if not self._closed.is_set() and time.monotonic() - self._last >= self.ping_s:
                    self._send(["ping", (), {}])

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.backend, name)
        if not callable(attribute) or name in LOCAL_CALLS or name.startswith("_"):
            return attribute

        def everywhere(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self._send([name, args, kwargs])
                return attribute(*args, **kwargs)

        return everywhere

    def close(self) -> None:
        """End the followers (once; the server is stopping)."""
        with self._lock:
            if not self._closed.is_set():
                self._closed.set()
                self._send(["stop", (), {}])


def follow(backend: ShardedTorchBackend) -> None:
    """Run on a rank other than 0: each call rank 0's :class:`Lockstep` sends, until it says stop."""
    log = logging.getLogger("tinkergym.sharded")
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0)
        name, args, kwargs = message[0]
        if name == "stop":
            return
        if name == "ping":
            continue
        try:
            getattr(backend, name)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - rank 0 raised the same from the same arguments: its client hears of it
            log.info("rank %s: %s failed as on rank 0: %s", backend.rank, name, exc)
