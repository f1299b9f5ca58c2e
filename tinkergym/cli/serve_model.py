"""``tinkergym serve-model``: the OpenAI-compatible inference server."""

from __future__ import annotations

import click

from tinkergym.cli.common import SafePath

ENGINES = ("auto", "torch", "vllm")


def _adapter(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name.strip() or not path:
        raise click.BadParameter(f"{value!r}: expected NAME=PATH, e.g. bandit=runs/bandit", param_hint="--adapter")
    return name.strip(), path


def _pick_engine(choice: str) -> str:
    """``torch`` or ``vllm`` for ``--engine`` (``auto``: vllm when it imports); ``vllm`` without vllm is a ConfigError."""
    if choice == "torch":
        return "torch"
    from tinkergym.backends.vllm_sampler import INSTALL_HINT
    from tinkergym.errors import ConfigError

    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        if choice == "vllm":
            raise ConfigError(f"--engine vllm needs the vllm package, which does not import here ({exc}); {INSTALL_HINT}; or serve with --engine torch") from exc
        return "torch"
    return "vllm"


def read_api_key(path: str) -> str:
    """The server's API key from its file (0600, at least 32 characters), errors naming ``--api-key-file``."""
    from tinkergym.backends.service_auth import read_token_file
    from tinkergym.errors import ConfigError

    try:
        return read_token_file(path)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("--token-file", "--api-key-file")) from exc


@click.command("serve-model")
@click.option("--model", help="Base model to serve (tiny, smollm2-135m, a local HF folder, a hub id); adapters attach to it.")
@click.option("--run", "run_dir", type=SafePath(exists=True, file_okay=False),
              help="A training run folder: its adapter on its base model (named after the folder), or a full fine-tuning run's model.")
@click.option("--adapter", "adapters", multiple=True, metavar="NAME=PATH",
              help="A LoRA adapter served as NAME: a run folder, a checkpoint (checkpoints/step_N) or an exported adapter folder (repeatable).")
@click.option("--api-key-file", required=True, type=SafePath(exists=True, dir_okay=False),
              help="File holding the API key clients send as 'Authorization: Bearer KEY' (chmod 600, 32+ characters).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float32"]), help="Compute dtype (default: the run's, else auto).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:1, ...")
@click.option("--max-model-len", type=click.IntRange(2), help="Longest prompt plus completion (default: the model's position limit).")
@click.option("--engine", type=click.Choice(ENGINES), default="auto", show_default=True,
              help="Who generates: vllm (a vLLM engine; needs vllm installed), torch (TorchBackend, as tinkergym eval computes), "
                   "or auto: vllm where it imports, else torch.")
@click.option("--gpu-memory-utilization", type=click.FloatRange(0.0, 1.0, min_open=True),
              help="vllm engine: fraction of GPU memory vLLM may take (default 0.9 on GPU, 0.3 on CPU).")
def serve_model(
    model: str | None, run_dir: str | None, adapters: tuple[str, ...], api_key_file: str, host: str, port: int,
    dtype: str | None, device: str, max_model_len: int | None, engine: str, gpu_memory_utilization: float | None,
) -> None:
    """Serve a model and its LoRA adapters through an OpenAI-compatible API.

    \b
    Examples:
      tinkergym serve-model --run runs/bandit --api-key-file key.txt
      tinkergym serve-model --model smollm2-135m --adapter a=runs/a --adapter b=runs/b/checkpoints/step_000009 \\
          --api-key-file key.txt --port 8001

    Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (stream: true included), and
    GET /health without the key. A request's "model" picks the base or an adapter. Evaluate through it with:
    tinkergym eval --endpoint http://127.0.0.1:8000/v1 --model NAME --tokenizer BASE --api-key-file key.txt --env ENV

    Engines: --engine auto (the default) serves with vLLM where vllm imports and with torch elsewhere;
    --engine vllm refuses to start without vllm; --engine torch computes as tinkergym eval does (--device
    applies to it only). Adapter checkpoints are converted to peft folders for vLLM when the server starts.
    """
    from tinkergym.backends.inference_engine import plan_serving
    from tinkergym.backends.service_auth import token_digest

    key = read_api_key(api_key_file)
    choice, engine = engine, _pick_engine(engine)
    plan = plan_serving(model=model, run=run_dir, adapters=[_adapter(a) for a in adapters], dtype=dtype)
    try:
        import uvicorn

        from tinkergym.backends.inference_server import create_inference_app
    except ImportError as exc:
        raise click.ClickException(f"serve-model needs the serve extra ({exc.name} is missing): pip install 'tinkergym[serve]'") from exc
    served = None
    if engine == "vllm":
        from tinkergym.backends.vllm_inference_engine import VLLMInferenceEngine
        from tinkergym.errors import ConfigError

        try:
            served = VLLMInferenceEngine(plan, max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization)
        except ConfigError as exc:  # e.g. a head size vLLM's CPU attention lacks: auto falls back, --engine vllm says so
            if choice != "auto":
                raise
            click.echo(f"vLLM cannot serve this ({exc}); serving with the torch engine", err=True)
            engine = "torch"
    if served is None:
        from tinkergym.backends.inference_engine import TorchInferenceEngine

        served = TorchInferenceEngine(plan, device=device, max_model_len=max_model_len)
    names = ", ".join(m.id for m in served.models())
    click.echo(f"serving {names} with the {engine} engine at http://{host}:{port}/v1", err=True)
    try:
        uvicorn.run(create_inference_app(served, token_digest(key)), host=host, port=port, log_level="info")
    finally:
        if hasattr(served, "close"):
            served.close()
