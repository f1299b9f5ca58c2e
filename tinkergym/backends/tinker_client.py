"""TinkerBackend: the Backend protocol through the ``tinker`` SDK, so tinkergym's trainers train on any Tinker-API endpoint.

``tinkergym train --backend tinker --backend-url URL --model NAME --lora-rank R`` runs GRPO, RLOO, SFT and self-play
through a Tinker training client (``tinkergym serve tinker``, Thinking Machines' service, or another compatible one);
the key is ``TINKER_API_KEY`` or ``--backend-token-file``. No torch is needed on this side.

How our calls map onto Tinker's:

- ``forward_backward``: our losses are means (``aggregation``: over the batch's tokens, or per sequence); Tinker's are
  sums. Each token's aggregation weight (times ``loss_scale``) goes into Tinker's ``weights`` (``cross_entropy``) or
  ``advantages`` (``importance_sampling``, ``ppo`` with thresholds ``1 - clip_low``/``1 + clip_high``), so the
  summed Tinker loss is our loss, gradient and value. ``reinforce`` is ``cross_entropy`` with weights
  ``weight * advantage``. The metrics (``loss``, ``tokens``, ``ratio_mean``, ``clip_fraction``, the sampler/trainer
  ``mismatch/*``) are computed here from the logprobs Tinker returns, as the local backend computes them.
  ``old_logprobs="trainer"`` scores the batch first (a ``forward``) and uses those logprobs as the ratio's base,
  with ``tis_cap``'s truncated weights folded into the advantages. Not expressible, so refused with the reason:
  ``kl_coef > 0`` (Tinker's losses have no reference term: put the KL penalty in the reward) and a loss
  temperature other than 1 (Tinker scores at temperature 1).
- ``sample``: a sampling client of the current weights (``save_weights_and_get_sampling_client`` after each
  optimizer step), one Tinker request per distinct prompt for all its copies' samples (a group's), all in flight at
  once. A seeded request sends each distinct prompt its group's seed (:mod:`tinkergym.protocol.seeds`), so the
  samples are those of the same request on a local backend, wherever the endpoint draws them as tinkergym's do.
- ``sampling_snapshot`` (the optional :class:`~tinkergym.protocol.backend.SnapshotBackend` capability that
  ``async_steps`` needs): that same sampling client as a :class:`TinkerSnapshot` of the current weights and their
  version. A Tinker sampling client of kind ``snapshot`` holds the weights saved when it was asked for (the SDK orders
  the save before any later optimizer step of the training client), and the SDK is thread-safe, so it samples on
  another thread while this backend trains on.
- ``logprobs``: a ``forward`` of the training client (the current weights), at temperature 1 only.
- ``save_state``/``load_state``: Tinker's ``save_state``/``load_state_with_optimizer``; the local checkpoint folder
  holds ``tinker_state.json`` with the ``tinker://`` path. ``export``: ``save_weights_external`` (the adapter in the
  endpoint's external format, a peft folder), whose files are downloaded through ``get_external_weights_urls``'s
  signed URLs: the folder is the adapter, as a local run's export, plus ``tinker_export.json`` with the
  ``tinker://`` path; a merged export is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from tinkergym.backends.remote import server_name
from tinkergym.errors import ConfigError, TinkergymError
from tinkergym.plumbing.folders import fresh_tmp_dir, plain_relative_parts, replace_dir
from tinkergym.protocol.seeds import group_seed, prompt_groups
from tinkergym.protocol.types import ForwardBackwardRequest, ForwardBackwardResult, OptimParams, SampleRequest, SampleResponse, SampledSequence

#: The file a checkpoint folder of a Tinker run holds instead of weights.
TINKER_STATE = "tinker_state.json"
TINKER_EXPORT = "tinker_export.json"
MAX_LOG_RATIO = 20.0


class TinkerBackendError(TinkergymError, RuntimeError):
    """The Tinker endpoint refused or failed a call."""


def aggregation_weights(data: list[Any], aggregation: str, total: float, sequences: int) -> list[np.ndarray]:
    """Each datum's per-token weights (entries 1..T-1, aligned with Tinker's targets) that make a sum our mean."""
    out = []
    for d in data:
        mask = np.asarray(d.loss_mask[1:], dtype=np.float64)
        if aggregation == "sum":
            out.append(mask)
        elif aggregation == "token":
            out.append(mask / max(total, 1e-12))
        else:
            row = mask.sum()
            out.append(mask / row / max(sequences, 1) if row > 0 else np.zeros_like(mask))
    return out


def request_metrics(name: str, data: list[Any], logprobs: list[np.ndarray], base: list[np.ndarray] | None, loss: float,
                    clip_low: float, clip_high: float, tis_cap: float = 0.0, trainer_old: list[np.ndarray] | None = None) -> dict[str, float]:
    """``loss``, ``tokens`` and the ratio, truncated-weight and mismatch means, as the local backend's ``finalize_metrics`` reports them."""
    masks = [np.asarray(d.loss_mask[1:], dtype=np.float64) for d in data]
    mask_sum = max(float(sum(m.sum() for m in masks)), 1e-12)
    metrics = {"loss": loss, "tokens": float(sum((m > 0).sum() for m in masks))}
    sampled = [np.asarray(d.sampling_logprobs[1:], dtype=np.float64) for d in data] if all(d.sampling_logprobs for d in data) else None
    if sampled is not None:
        # the trainer's side: the old policy's logprobs where known (given, or scored first), else this pass's
        trainer = trainer_old if trainer_old is not None else logprobs
        deltas = [np.clip(np.where(m > 0, lp - s, 0.0), -MAX_LOG_RATIO, MAX_LOG_RATIO) for m, lp, s in zip(masks, trainer, sampled)]
        if tis_cap > 0 and name in ("importance_sampling", "ppo", "reinforce"):
            tis = [np.minimum(np.exp(d), tis_cap) for d in deltas]
            metrics["tis/weight_mean"] = float(sum((t * m).sum() for t, m in zip(tis, masks))) / mask_sum
            metrics["tis/capped_fraction"] = float(sum(((t >= tis_cap) * m).sum() for t, m in zip(tis, masks))) / mask_sum
        metrics["mismatch/logp_abs_mean"] = float(sum((np.abs(d) * m).sum() for d, m in zip(deltas, masks))) / mask_sum
        metrics["mismatch/kl"] = float(sum(((np.exp(d) - d - 1.0) * m).sum() for d, m in zip(deltas, masks))) / mask_sum
        metrics["mismatch/logp_abs_max"] = float(max((np.where(m > 0, np.abs(d), 0.0).max(initial=0.0) for d, m in zip(deltas, masks)), default=0.0))
    if name in ("importance_sampling", "ppo") and base is not None:
        ratios = [np.exp(np.clip(np.where(m > 0, lp - b, 0.0), -MAX_LOG_RATIO, MAX_LOG_RATIO)) for m, lp, b in zip(masks, logprobs, base)]
        metrics["ratio_mean"] = float(sum((r * m).sum() for r, m in zip(ratios, masks))) / mask_sum
        if name == "ppo":
            advantages = [np.asarray(d.advantages[1:], dtype=np.float64) for d in data]
            clipped = [(np.clip(r, 1 - clip_low, 1 + clip_high) * a < r * a).astype(np.float64) for r, a in zip(ratios, advantages)]
            metrics["clip_fraction"] = float(sum((c * m).sum() for c, m in zip(clipped, masks))) / mask_sum
    return metrics


class TinkerBackend:
    """Compute for one policy through a Tinker training client (see the module docstring)."""

    def __init__(self, url: str, api_key: str | None, base_model: str, lora_rank: int, seed: int | None = None,
                 cache_dir: str | os.PathLike[str] | None = None) -> None:
        try:
            import tinker
        except ImportError as exc:
            raise ConfigError("the tinker backend needs the tinker SDK: pip install 'tinker>=0.38,<0.39'") from exc
        key = api_key or os.environ.get("TINKER_API_KEY")
        if not key:
            raise ConfigError("the tinker backend needs an API key: set TINKER_API_KEY or pass --backend-token-file with the key")
        self.url, self.base_model, self.lora_rank = url, base_model, lora_rank
        self._tinker = tinker
        self.service = tinker.ServiceClient(base_url=url, api_key=key)
        self._rest = tinker.RestClient(base_url=url, api_key=key)
        models = [m.model_name for m in self._rest.get_server_capabilities().result().supported_models]
        if base_model not in models:
            raise ConfigError(f"{url} does not offer the model {base_model!r}; it offers: {', '.join(str(m) for m in models) or 'none'}")
        self.training = self.service.create_lora_training_client(base_model=base_model, rank=lora_rank, seed=seed).result()
        self.step = 0
        self._sampler_future: Any = None  # a future of the sampling client of the current weights (None: none asked for yet)
        self._cache_dir = Path(cache_dir) if cache_dir else Path(os.environ.get("TINKERGYM_CACHE", Path.home() / ".cache" / "tinkergym")) / "tinker"
        self._tokenizer_dir: str | None = None

    # ----- facts ------------------------------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        if self._tokenizer_dir is None:  # saved privately, then kept once per content: clients of one cache never see half a folder
            import tempfile

            from tinkergym.backends.tokenizer_files import cache_tokenizer_files, read_tokenizer_files

            with tempfile.TemporaryDirectory() as saved:
                self.training.get_tokenizer().save_pretrained(saved)
                files = {"files": read_tokenizer_files(saved)}
            self._tokenizer_dir = cache_tokenizer_files(files, self._cache_dir / "tokenizers", f"the tokenizer of {self.base_model!r} at {self.url}")
        return {"model": self.base_model, "tokenizer": self._tokenizer_dir, "lora_rank": self.lora_rank, "step": self.step,
                "backend": "tinker", "url": self.url, "model_id": self.training.model_id}

    def _fail(self, exc: Exception, what: str) -> TinkerBackendError:
        return TinkerBackendError(f"the Tinker endpoint {self.url} failed {what}: {str(exc)[:1000]}")

    # ----- sampling and scoring ---------------------------------------------------------------------------
    def _sampler_of_current_weights(self) -> Any:
        """The future of a sampling client of the current weights, asked for once per version of them."""
        if self._sampler_future is None:
            self._sampler_future = self.training.save_weights_and_get_sampling_client()
        return self._sampler_future

    def _current_sampler(self) -> Any:
        try:
            return self._sampler_of_current_weights().result()
        except BaseException:
            self._sampler_future = None  # a failed save is asked for again by the next call
            raise

    def sampling_snapshot(self) -> TinkerSnapshot:
        """A sampler of the current weights that keeps them while this backend trains on, tagged with their version (``step``).

        Costs nothing new where a sampling client of these weights exists (the one :meth:`sample` uses); otherwise the
        save is asked for now and waited for on the snapshot's first ``sample``, so the caller can go on training.
        """
        return TinkerSnapshot(self, self._sampler_of_current_weights(), self.step)

    def sample(self, request: SampleRequest) -> SampleResponse:
        return self.sample_with(self._current_sampler(), request)

    def sample_with(self, sampler: Any, request: SampleRequest) -> SampleResponse:
        """``request`` through the Tinker sampling client ``sampler``: one request per distinct prompt, all in flight at once.

        The copies of a prompt (a GRPO group) are one request for all their samples, seeded with the group's seed
        (:func:`~tinkergym.protocol.seeds.group_seed`): copies sent apart with one seed would all draw the same completion.
        """
        types = self._tinker.types
        p = request.params

        def params(group: int) -> Any:  # a seeded request's group seeds (tinkergym.protocol.seeds): the draws of a local batch
            seed = None if p.seed is None else group_seed(p.seed, group)
            return types.SamplingParams(max_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k or -1,
                                        stop=list(p.stop_token_ids) or None, seed=seed)

        groups = prompt_groups(request.prompts)
        n = request.num_samples
        try:
            futures = [(rows, sampler.sample(types.ModelInput.from_ints(list(request.prompts[rows[0]])), n * len(rows), params(g)))
                       for g, rows in enumerate(groups)]
            answered = [(rows, f.result()) for rows, f in futures]
        except Exception as exc:  # noqa: BLE001 - the endpoint's error, said as ours
            raise self._fail(exc, "a sample request") from exc
        sequences: list[list[SampledSequence]] = [[] for _ in request.prompts]
        for rows, response in answered:
            drawn = [SampledSequence(tokens=list(s.tokens), logprobs=list(s.logprobs or []), finish_reason="stop" if s.stop_reason == "stop" else "length")
                     for s in response.sequences]
            for j, row in enumerate(rows):
                sequences[row] = drawn[j * n : (j + 1) * n]
        return SampleResponse(sequences=sequences)

    def _forward_logprobs(self, sequences: list[list[int]]) -> list[np.ndarray]:
        types = self._tinker.types
        data = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]), loss_fn_inputs={"target_tokens": s[1:], "weights": [0.0] * (len(s) - 1)})
                for s in sequences]
        try:
            out = self.training.forward(data, "cross_entropy").result()
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc, "a forward pass") from exc
        return [np.asarray(o["logprobs"].to_numpy(), dtype=np.float64) for o in out.loss_fn_outputs]

    def logprobs(self, sequences: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
        if temperature != 1.0:
            raise ConfigError(f"a Tinker endpoint scores at temperature 1, not {temperature}: sample and train at temperature 1 through it")
        scored = [[0.0] * len(s) for s in sequences]
        long_enough = [i for i, s in enumerate(sequences) if len(s) > 1]
        for i, lp in zip(long_enough, self._forward_logprobs([sequences[i] for i in long_enough]) if long_enough else []):
            scored[i] = [0.0, *lp.tolist()]
        return scored

    # ----- training -------------------------------------------------------------------------------------------
    def forward_backward(self, request: ForwardBackwardRequest) -> ForwardBackwardResult:
        types = self._tinker.types
        spec, data = request.loss, request.data
        if spec.name not in ("cross_entropy", "reinforce", "importance_sampling", "ppo"):
            raise ConfigError(f"loss {spec.name!r} goes to a Tinker endpoint as itself: use TinkerBackend with cross_entropy, reinforce, "
                              "importance_sampling or ppo (our trainers' losses), or the tinker SDK directly")
        if spec.kl_coef > 0:
            raise ConfigError("kl_coef > 0: Tinker's losses have no reference-policy term; put the KL penalty into the reward, or train locally")
        if spec.temperature != 1.0:
            raise ConfigError(f"loss temperature {spec.temperature}: a Tinker endpoint scores at temperature 1; sample at temperature 1 through it")
        if spec.loss_scale <= 0:
            raise ConfigError("loss_scale must be > 0 through a Tinker endpoint (the clipped losses take its sign into the min)")
        if any(len(d.tokens) < 2 for d in data):
            raise ConfigError("every datum needs at least two tokens (one to read, one to predict)")
        total = sum(sum(d.loss_mask[1:]) for d in data) if request.num_tokens is None else request.num_tokens
        sequences = request.num_sequences if request.num_sequences is not None else sum(1 for d in data if any(m != 0 for m in d.loss_mask[1:]))
        weights = [w * spec.loss_scale for w in aggregation_weights(data, spec.aggregation, total, sequences)]
        base: list[np.ndarray] | None = None  # the importance ratio's old policy (and the truncated weights' trainer side)
        trainer_old: list[np.ndarray] | None = None
        if all(d.old_logprobs for d in data):
            trainer_old = [np.asarray(d.old_logprobs[1:], dtype=np.float64) for d in data]
        if spec.name == "reinforce" and spec.tis_cap > 0:  # the truncated weights read the trainer's logprobs before the pass
            base = trainer_old = trainer_old or self._forward_logprobs([d.tokens for d in data])
        # On policy (the trainer's own logprobs of this pass as the old policy, no truncated weights): the ratio is 1 with the
        # gradient of the logprob, so the loss's gradient is a cross-entropy's with weights w * A, and no forward is needed first.
        on_policy = spec.name in ("importance_sampling", "ppo") and spec.old_logprobs == "trainer" and trainer_old is None and spec.tis_cap == 0
        if spec.name in ("importance_sampling", "ppo") and not on_policy:
            if spec.old_logprobs == "trainer" or trainer_old is not None:
                base = trainer_old = trainer_old or self._forward_logprobs([d.tokens for d in data])
            else:
                if not all(d.sampling_logprobs for d in data):
                    raise ConfigError(f"the {spec.name!r} loss needs sampling_logprobs for every datum")
                base = [np.asarray(d.sampling_logprobs[1:], dtype=np.float64) for d in data]
        tinker_data = []
        summed = 0.0  # an on-policy loss's value: -sum(w * A), its ratio being 1
        for i, d in enumerate(data):
            inputs: dict[str, Any] = {"target_tokens": list(d.tokens[1:])}
            if spec.name == "cross_entropy":
                inputs["weights"] = weights[i].astype(np.float32)
            else:
                if not d.advantages:
                    raise ConfigError(f"the {spec.name!r} loss needs advantages for every datum")
                scaled = weights[i] * np.asarray(d.advantages[1:], dtype=np.float64)
                if spec.tis_cap > 0 and d.sampling_logprobs and base is not None:
                    mask = np.asarray(d.loss_mask[1:]) > 0
                    gap = np.clip(np.where(mask, base[i] - np.asarray(d.sampling_logprobs[1:], dtype=np.float64), 0.0), -MAX_LOG_RATIO, MAX_LOG_RATIO)
                    scaled = scaled * np.minimum(np.exp(gap), spec.tis_cap)
                summed -= float((scaled * (np.asarray(d.loss_mask[1:]) > 0)).sum())
                if spec.name == "reinforce" or on_policy:
                    inputs["weights"] = scaled.astype(np.float32)
                else:
                    inputs["advantages"] = scaled.astype(np.float32)
                    inputs["logprobs"] = base[i].astype(np.float32)  # type: ignore[index]
            tinker_data.append(types.Datum(model_input=types.ModelInput.from_ints(list(d.tokens[:-1])), loss_fn_inputs=inputs))
        name = "cross_entropy" if spec.name == "reinforce" or on_policy else spec.name
        config = {"clip_low_threshold": 1.0 - spec.clip_low, "clip_high_threshold": 1.0 + spec.clip_high} if name == "ppo" else None
        try:
            out = self.training.forward_backward(tinker_data, name, loss_fn_config=config).result()  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc, f"a forward_backward ({name})") from exc
        logprobs = [np.asarray(o["logprobs"].to_numpy(), dtype=np.float64) for o in out.loss_fn_outputs]
        loss = summed if on_policy else float(out.metrics.get("loss:sum", 0.0))
        if on_policy:
            base = logprobs  # the ratio's base is this pass's own logprobs: 1 everywhere
        metrics = request_metrics(spec.name, data, logprobs, base, loss, spec.clip_low, spec.clip_high, spec.tis_cap, trainer_old)
        return ForwardBackwardResult(metrics=metrics, logprobs=[[0.0, *lp.tolist()] for lp in logprobs] if request.return_logprobs else None)

    def optim_step(self, params: OptimParams) -> dict[str, float]:
        adam = self._tinker.types.AdamParams(learning_rate=params.learning_rate, beta1=params.beta1, beta2=params.beta2, eps=params.eps,
                                             weight_decay=params.weight_decay, grad_clip_norm=params.max_grad_norm)
        try:
            out = self.training.optim_step(adam).result()
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc, "an optimizer step") from exc
        self.step += 1
        self._sampler_future = None  # the next sample needs the new weights (snapshots taken before keep theirs)
        return {key.split(":")[0]: float(value) for key, value in (out.metrics or {}).items()}

    # ----- states and export ------------------------------------------------------------------------------------
    def save_state(self, path: str) -> None:
        name = server_name(path)
        try:
            saved = self.training.save_state(name).result().path
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc, "save_state") from exc
        tmp = fresh_tmp_dir(path)
        Path(tmp, TINKER_STATE).write_text(json.dumps({"url": self.url, "path": saved, "step": self.step, "model": self.base_model}) + "\n")
        replace_dir(tmp, os.fspath(path).rstrip("/"))

    def load_state(self, path: str) -> None:
        file = Path(path, TINKER_STATE)
        if not file.is_file():
            raise ConfigError(f"{path} holds no {TINKER_STATE}: it is not a checkpoint of a run through a Tinker endpoint")
        saved = json.loads(file.read_text())
        try:
            # Into this client's run: a new client from the state would hold a second adapter for the session (the SDK has no
            # call that frees a run). SDKs without the (deprecated) method get a new client.
            load = getattr(self.training, "load_state_with_optimizer", None)
            if load is None:
                self.training = self.service.create_training_client_from_state_with_optimizer(saved["path"]).result()
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    load(saved["path"]).result()
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc, f"load_state of {saved['path']}") from exc
        self.step = int(saved.get("step", 0))
        self._sampler_future = None

    def export(self, path: str, merged: bool = False) -> None:
        if merged:
            raise ConfigError("a Tinker endpoint keeps the base model: export the adapter (leave out --merged) and merge it where the base is loaded")
        try:
            saved = self.training.save_weights_external(server_name(path)).result().path
            urls = self._rest.get_external_weights_urls(saved).result().urls
        except Exception as exc:  # noqa: BLE001
            raise self._fail(exc, "an export") from exc
        tmp = fresh_tmp_dir(path)
        try:
            for relative, url in sorted(urls.items()):
                parts = plain_relative_parts(relative)
                if parts is None:
                    raise TinkerBackendError(f"the Tinker endpoint {self.url} listed an exported file with an unusable path {relative!r}")
                dest = Path(tmp, *parts)
                dest.parent.mkdir(parents=True, exist_ok=True)
                _download(url, dest)
            Path(tmp, TINKER_EXPORT).write_text(json.dumps({"url": self.url, "path": saved, "model": self.base_model, "lora_rank": self.lora_rank}) + "\n")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        replace_dir(tmp, os.fspath(path).rstrip("/"))

    def close(self) -> None:
        self.service.close("success").result()


def _download(url: str, dest: Path, timeout: float = 300.0) -> None:
    """Stream the file at a signed ``url`` into ``dest`` (a refusal or a dropped connection is a :class:`TinkerBackendError`)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(dest, "wb") as out:  # noqa: S310 - the endpoint's own https/http URL
            shutil.copyfileobj(response, out, 1 << 20)
    except (OSError, urllib.error.URLError) as exc:
        raise TinkerBackendError(f"downloading an exported file from {url.split('?')[0][:200]} failed: {exc}") from exc


class TinkerSnapshot:
    """A Tinker sampling client of the weights as they were when :meth:`TinkerBackend.sampling_snapshot` was called.

    ``version`` is the backend's ``step`` then. The client is waited for on the first :meth:`sample` (from any thread:
    the tinker SDK is thread-safe), so the save of the weights runs while the trainer goes on.
    """

    def __init__(self, backend: TinkerBackend, client_future: Any, version: int) -> None:
        self._backend, self._client_future, self.version = backend, client_future, version

    def sample(self, request: SampleRequest) -> SampleResponse:
        """Sample ``request`` with the snapshot's weights."""
        try:
            client = self._client_future.result()
        except Exception as exc:  # noqa: BLE001 - the endpoint's error, said as ours
            raise self._backend._fail(exc, f"saving the weights of step {self.version} for sampling") from exc
        return self._backend.sample_with(client, request)


def build(request: Any) -> TinkerBackend:
    """The ``tinker`` backend plugin: a Tinker training client at ``backend_url`` for the run's model and LoRA rank."""
    config = request.config
    if not config.backend_url:
        raise ConfigError("the tinker backend needs the endpoint: --backend-url URL (a Tinker API base URL)")
    if config.lora_rank < 1:
        raise ConfigError("full fine-tuning is not offered through the Tinker API: give --lora-rank R (R >= 1)")
    return TinkerBackend(config.backend_url, request.backend_token, config.model, config.lora_rank, seed=config.seed)
