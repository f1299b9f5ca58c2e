"""Publish a finished training run to the Hugging Face Hub: the model, its card, the curve and the metrics.

One push is one commit. At the root of the repo::

    model files             final/ as the run exported it: the peft adapter or the full model, with the
                            tokenizer; with ``merged``, a LoRA run's adapter merged into its base model
    README.md               the model card: base model, envs with their packages and versions, trainer,
                            resolved config, reward curve, final results and how to use the model
    tinkergym_config.json   the run's config.json (renamed: the model's own config.json keeps its name)
    metrics.jsonl           one line per training step
    learning_curve.png      reward against step
    eval_results.json       the last evaluation's numbers, when the run evaluated
    eval_transcripts.jsonl  the last evaluation's episodes, when the run evaluated

``huggingface_hub`` (extra ``hub``) is imported inside the functions; torch, transformers and peft only
when a merged model is built.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable

from tinkergym.backends.models import SMOLLM2_HUB_ID, SMOLLM2_NAME
from tinkergym.errors import ConfigError, TinkergymError, UnknownEnvError
from tinkergym.config import TrainConfig
from tinkergym.trainers.reporting import read_metrics
from tinkergym.plumbing.install import pip_install

#: ORG/NAME as the Hub accepts it: ASCII letters, digits, ``_ . -``; no ``--`` or ``..``; at most 96 a part.
REPO_ID_PATTERN = re.compile(r"^(?!.*(?:--|\.\.))(?!.*\.git$)(\w(?:[\w.-]{0,94}\w)?)/(\w(?:[\w.-]{0,94}\w)?)$", re.ASCII)

#: Short model names of tinkergym -> the Hub id of the same weights.
HUB_MODEL_IDS = {SMOLLM2_NAME: SMOLLM2_HUB_ID}

#: Files of the run folder uploaded beside the model, with their name in the repo.
RUN_FILES = (("config.json", "tinkergym_config.json"), ("metrics.jsonl", "metrics.jsonl"), ("learning_curve.png", "learning_curve.png"))

#: Files of a peft adapter folder (the rest of final/ is the tokenizer).
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")

INSTALL_HUB = f"install it with: {pip_install('hub')}"


class PushError(TinkergymError, RuntimeError):
    """The Hub could not be reached or refused the upload; the message carries the server's answer."""


@dataclass
class PushOptions:
    """What ``tinkergym push`` was asked to do: ids, paths and flags only."""

    run: str
    repo_id: str
    merged: bool = False
    private: bool = False
    token: str | None = None
    revision: str | None = None
    commit_message: str | None = None


@dataclass
class FinishedRun:
    """A run folder read back: its config, metrics and exported model."""

    folder: Path
    config: TrainConfig
    metrics: list[dict[str, Any]]
    is_adapter: bool

    @property
    def final(self) -> Path:
        """The exported model folder."""
        return self.folder / "final"


@dataclass
class EnvPackage:
    """An env id with the distribution that provides it (None when it is not installed here)."""

    env_id: str
    distribution: str | None = None
    version: str | None = None
    summary: str = ""


@dataclass
class Upload:
    """The files of one commit: path in the repo -> a local file or bytes."""

    files: dict[str, Path | bytes] = field(default_factory=dict)

    def add(self, path_in_repo: str, source: Path | bytes) -> None:
        """Add (or replace) one file."""
        self.files[path_in_repo] = source


def check_repo_id(repo_id: str) -> str:
    """Return ``repo_id`` if it is ORG/NAME as the Hub accepts it, else raise :class:`ConfigError`."""
    if not REPO_ID_PATTERN.match(repo_id or ""):
        raise ConfigError(
            f"{repo_id!r} is not a Hub repo id; write ORG/NAME (your user name or an organization, a slash, "
            "then a name of ASCII letters, digits, '_', '.' or '-', at most 96 characters, without '--' or '..'), "
            "e.g. my-name/bandit-grpo."
        )
    return repo_id


def load_run(folder: str | Path) -> FinishedRun:
    """Read a finished run folder; raise :class:`ConfigError` when it is not one, has no final/ export, or a file is malformed."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{folder} is not a run folder (no config.json); pass the --out folder of a tinkergym train run.")
    config = TrainConfig.load(folder / "config.json")  # a malformed one is a ConfigError that names the file
    final = folder / "final"
    is_adapter = (final / "adapter_config.json").is_file()
    if not is_adapter and not (final / "config.json").is_file():
        raise ConfigError(
            f"{folder} has no exported model in final/ (the run has not finished); "
            f"finish it with: tinkergym train --resume {folder}"
        )
    return FinishedRun(folder=folder, config=config, metrics=read_metrics(folder / "metrics.jsonl"), is_adapter=is_adapter)


def base_model_id(model: str) -> str:
    """The Hub id of a run's base model: known short names are mapped, anything else is kept as given."""
    return HUB_MODEL_IDS.get(model, model)


def env_packages(env_ids: list[str]) -> list[EnvPackage]:
    """Each env id with the package and version that provide it here (read from package metadata)."""
    import tinkergym

    found = []
    for env_id in env_ids:
        try:
            spec = tinkergym.spec(env_id)
        except UnknownEnvError:
            found.append(EnvPackage(env_id))
            continue
        found.append(EnvPackage(env_id, spec.distribution, spec.version, spec.summary))
    return found


def final_results(records: list[dict[str, Any]]) -> dict[str, tuple[int, float]]:
    """The last training reward and the last value of every ``eval/*`` metric, each with its step."""
    results: dict[str, tuple[int, float]] = {}
    for record in records:
        step = int(record.get("step", 0))
        for key, value in record.items():
            if isinstance(value, (int, float)) and (key == "reward/mean" or key.startswith("eval/")):
                results[key] = (step, float(value))
    return results


def eval_results(run: FinishedRun) -> dict[str, Any] | None:
    """The last evaluation of the run as a JSON-ready dict (None when the run never evaluated)."""
    last = next((r for r in reversed(run.metrics) if any(k.startswith("eval/") for k in r)), None)
    if last is None:
        return None
    metrics = {k.removeprefix("eval/"): v for k, v in last.items() if k.startswith("eval/")}
    return {"env": run.config.env, "env_kwargs": {**run.config.env_kwargs, **run.config.eval_env_kwargs}, "step": int(last.get("step", 0)), "metrics": metrics}


def latest_eval_transcripts(folder: Path) -> Path | None:
    """The newest ``transcripts/eval_step_*.jsonl`` of a run, if any."""
    found = sorted((folder / "transcripts").glob("eval_step_*.jsonl"))
    return found[-1] if found else None


def merge_adapter(run: FinishedRun, dest: Path) -> Path:
    """Write the run's adapter merged into its base model, with the tokenizer, as a plain transformers folder."""
    from peft import PeftModel

    from tinkergym.backends.models import resolve_model
    from tinkergym.backends.torch.runtime import load_causal_lm

    base = load_causal_lm(resolve_model(run.config.model), "auto")  # an adapter folder it started from comes merged
    merged = PeftModel.from_pretrained(base, str(run.final)).merge_and_unload()
    merged.save_pretrained(str(dest))
    for path in run.final.iterdir():  # the tokenizer, exactly as the run exported it
        if path.is_file() and path.name not in (*ADAPTER_FILES, "README.md"):
            shutil.copy2(path, dest / path.name)
    return dest


def _adapter_config(run: FinishedRun) -> Path | bytes:
    """adapter_config.json, pointing at the base model's Hub id when the run named it by a short name."""
    path = run.final / "adapter_config.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    hub_id = base_model_id(run.config.model)
    if hub_id == run.config.model or data.get("base_model_name_or_path") == hub_id:
        return path
    data["base_model_name_or_path"] = hub_id  # a local cache path means nothing to whoever downloads the adapter
    return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()


def collect_files(run: FinishedRun, card: str, merged_folder: Path | None = None) -> Upload:
    """Everything one push commits (see the module docstring)."""
    upload = Upload()
    model_folder = merged_folder or run.final
    for path in sorted(model_folder.rglob("*")):
        relative = path.relative_to(model_folder).as_posix()
        if path.is_file() and relative != "README.md":  # peft writes a placeholder card; ours replaces it
            upload.add(relative, path)
    if merged_folder is None and run.is_adapter:
        upload.add("adapter_config.json", _adapter_config(run))
    for name, path_in_repo in RUN_FILES:
        if (run.folder / name).is_file():
            upload.add(path_in_repo, run.folder / name)
    results = eval_results(run)
    if results is not None:
        upload.add("eval_results.json", (json.dumps(results, indent=2) + "\n").encode())
    transcripts = latest_eval_transcripts(run.folder)
    if transcripts is not None:
        upload.add("eval_transcripts.jsonl", transcripts)
    upload.add("README.md", card.encode())
    return upload


def model_card(run: FinishedRun, envs: list[EnvPackage], repo_id: str, adapter: bool) -> str:
    """The README.md of the repo: Hub metadata (base model, library, tags) and a body a person reads."""
    hub = _import_hub()
    tags = ["tinkergym", *(["reinforcement-learning"] if run.config.trainer != "sft" else []), run.config.trainer]
    tags += ["lora"] if adapter else []
    tags += [env.env_id for env in envs]
    data = hub.ModelCardData(
        base_model=base_model_id(run.config.model),
        library_name="peft" if adapter else "transformers",
        pipeline_tag="text-generation",
        tags=list(dict.fromkeys(tags)),
    )
    sections = [_card_intro(run, envs, repo_id, adapter), _card_envs(run, envs), _card_training(run), _card_results(run), _card_usage(run, repo_id, adapter)]
    content = f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(s for s in sections if s) + "\n"
    return str(hub.ModelCard(content))  # parses the metadata back: a card that does not parse is never pushed


def _looks_like_hub_id(model: str) -> bool:
    return bool(REPO_ID_PATTERN.match(model)) and not Path(model).expanduser().exists()


def _card_intro(run: FinishedRun, envs: list[EnvPackage], repo_id: str, adapter: bool) -> str:
    c = run.config
    base = base_model_id(c.model)
    base_text = f"[`{base}`](https://huggingface.co/{base})" if _looks_like_hub_id(base) else f"`{base}`"
    if adapter:
        what = f"A LoRA adapter (rank {c.lora_rank}) for {base_text}"
    elif c.lora_rank > 0:
        what = f"{base_text} with a LoRA adapter (rank {c.lora_rank}) merged into its weights"
    else:
        what = f"A full fine-tune (every parameter) of {base_text}"
    where = ", ".join(f"`{env.env_id}`" for env in envs) or "chat transcripts"
    method = "supervised fine-tuning" if c.trainer == "sft" else "reinforcement learning"
    return f"# {repo_id.split('/')[-1]}\n\n{what}, trained with {method} (the `{c.trainer}` trainer of tinkergym) on {where} for {_steps(c.steps)}."


def _steps(count: int) -> str:
    return f"{count} step" + ("" if count == 1 else "s")


def _card_envs(run: FinishedRun, envs: list[EnvPackage]) -> str:
    if not envs:
        return ""
    lines = ["## Environments", "", "| env id | package | version | summary |", "|---|---|---|---|"]
    for env in envs:
        package = f"`{env.distribution}`" if env.distribution else "not installed where this card was written"
        lines.append(f"| `{env.env_id}` | {package} | {env.version or '?'} | {env.summary.replace('|', '/')} |")
    installable = [f"{env.distribution}=={env.version}" for env in envs if env.distribution]
    if installable:
        lines += ["", f"Install the envs with: `pip install {' '.join(installable)}`"]
    if run.config.env_kwargs:
        lines += ["", f"Env keyword arguments: `{json.dumps(run.config.env_kwargs)}`"]
    return "\n".join(lines)


def _card_training(run: FinishedRun) -> str:
    import yaml

    c = run.config
    weights = f"LoRA rank {c.lora_rank}, alpha {c.lora_alpha}" if c.lora_rank > 0 else "full fine-tuning"
    config = {k: v for k, v in c.to_dict().items() if k != "out"}  # the run folder is a local path
    return "\n".join([
        "## Training",
        "",
        f"- trainer: `{c.trainer}`; base model: `{c.model}`; {weights}",
        f"- {c.steps} steps of {c.batch_size} prompts x {c.group_size} samples, learning rate {c.lr:g}, "
        f"up to {c.max_turns} turns of {c.max_new_tokens} new tokens",
        "",
        "The resolved config (also in `tinkergym_config.json`):",
        "",
        "```yaml",
        yaml.safe_dump(config, sort_keys=False).rstrip(),
        "```",
    ])


def _card_results(run: FinishedRun) -> str:
    lines = ["## Results", ""]
    if (run.folder / "learning_curve.png").is_file():
        lines += ["![Reward against training step](learning_curve.png)", ""]
    results = final_results(run.metrics)
    if not results:
        return "\n".join(lines + ["The run logged no rewards."])
    lines += ["| metric | value | step |", "|---|---|---|"]
    for key, (step, value) in results.items():
        name = "training reward (mean over the batch)" if key == "reward/mean" else f"eval {key.removeprefix('eval/')}"
        lines.append(f"| {name} | {value:.4g} | {step} |")
    if any(key.startswith("eval/") for key in results):
        lines += ["", "Evaluation decodes greedily on held-out env seeds; the numbers are in `eval_results.json` and the episodes in `eval_transcripts.jsonl`."]
    return "\n".join(lines)


def _card_usage(run: FinishedRun, repo_id: str, adapter: bool) -> str:
    c = run.config
    model_class = "AutoPeftModelForCausalLM" if adapter else "AutoModelForCausalLM"
    lines = [
        "## Usage",
        "",
        "```python",
        "from peft import AutoPeftModelForCausalLM" if adapter else "from transformers import AutoModelForCausalLM",
        "from transformers import AutoTokenizer",
        "",
        f'model = {model_class}.from_pretrained("{repo_id}")' + ("  # fetches the base model too" if adapter else ""),
        f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")',
    ]
    if not c.env:
        return "\n".join(lines + ["```"])
    kwargs = "".join(f", {k}={v!r}" for k, v in c.env_kwargs.items())
    lines += [
        "",
        "# Play one episode of the env it was trained on (pip install the env package above).",
        "import gymnasium as gym",
        "import tinkergym  # registers the installed env ids",
        "",
        f'env = gym.make("{c.env}"{kwargs})',
        "obs, info = env.reset(seed=0)",
        'messages = [{"role": "system", "content": info.get("system_prompt", "")}, {"role": "user", "content": obs}]',
        f"for turn in range({c.max_turns}):",
        "    inputs = tokenizer.apply_chat_template(",
        '        messages, tools=info.get("tools"), add_generation_prompt=True, return_tensors="pt", return_dict=True',
        "    )",
        f"    output = model.generate(**inputs, max_new_tokens={c.max_new_tokens})",
        '    action = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)',
        "    obs, reward, terminated, truncated, info = env.step(action)",
        '    print(f"{action!r} -> reward {reward}")',
        "    if terminated or truncated:",
        "        break",
        '    messages += [{"role": "assistant", "content": action}, {"role": "user", "content": obs}]',
        "```",
    ]
    if not adapter:
        lines += ["", "Or evaluate it with the tinkergym command line:", "", "```bash", f"tinkergym eval --env {c.env} --model {repo_id}", "```"]
    return "\n".join(lines)


def _import_hub() -> Any:
    try:
        import huggingface_hub
    except ImportError as exc:
        raise PushError(f"pushing to the Hub needs huggingface_hub; {INSTALL_HUB}") from exc
    return huggingface_hub


def resolve_token(token: str | None) -> str:
    """The token to push with: ``token``, else ``HF_TOKEN`` or the cached login; :class:`ConfigError` if none."""
    found = token or _import_hub().get_token()
    if not found:
        raise ConfigError(
            "no Hugging Face token: pass --token, set HF_TOKEN, or log in once with: hf auth login "
            "(a token with write access, from https://huggingface.co/settings/tokens)."
        )
    return found


def commit_files(files: Upload, options: PushOptions, token: str, message: str) -> dict[str, str]:
    """Create the repo (and branch) if needed and commit ``files``; server errors become :class:`PushError`."""
    hub = _import_hub()
    api = hub.HfApi(token=token)
    operations = [hub.CommitOperationAdd(path_in_repo=p, path_or_fileobj=s if isinstance(s, bytes) else str(s)) for p, s in files.files.items()]
    try:
        repo_url = api.create_repo(options.repo_id, private=True if options.private else None, exist_ok=True)
        if options.revision and options.revision != "main":
            api.create_branch(options.repo_id, branch=options.revision, exist_ok=True)
        commit = api.create_commit(options.repo_id, operations, commit_message=message, revision=options.revision)
    except Exception as exc:  # HTTP errors, refused metadata, unreachable endpoint: all are a failed upload
        raise PushError(f"the upload to {api.endpoint} failed: {_server_message(exc)}") from exc
    return {"repo": str(repo_url), "commit": commit.commit_url, "revision": options.revision or "main"}


def _server_message(exc: Exception) -> str:
    """The error as huggingface_hub words it, with the server's own message in it (kept on HTTP errors)."""
    if not hasattr(exc, "server_message"):  # not an HTTP answer: a refused connection, bad metadata, ...
        return f"{type(exc).__name__}: {exc}"
    server, text = exc.server_message, str(exc).strip()
    return text if not server or server in text else f"{server} ({text})"


def push_run(options: PushOptions, log: Callable[[str], None] = lambda line: print(line, file=sys.stderr)) -> dict[str, Any]:
    """Push a finished run to the Hub (see the module docstring); returns the repo and commit URLs and the files."""
    check_repo_id(options.repo_id)
    run = load_run(options.run)
    token = resolve_token(options.token)
    merge = options.merged and run.is_adapter
    if options.merged and not run.is_adapter:
        log(f"{run.final} is already a full model (a full fine-tuning run); pushing it as is.")
    envs = env_packages([run.config.env] if run.config.env else [])
    card = model_card(run, envs, options.repo_id, adapter=run.is_adapter and not merge)
    message = options.commit_message or f"tinkergym: {run.config.trainer} on {run.config.env or 'chat data'}, {_steps(run.config.steps)}"
    with tempfile.TemporaryDirectory(prefix="tinkergym-push-") as tmp:
        merged_folder = None
        if merge:
            log(f"merging the adapter into {base_model_id(run.config.model)} ...")
            merged_folder = merge_adapter(run, Path(tmp) / "merged")
        files = collect_files(run, card, merged_folder)
        log(f"uploading {len(files.files)} files to {options.repo_id} ...")
        result = commit_files(files, options, token, message)
    return {**result, "files": sorted(files.files)}
