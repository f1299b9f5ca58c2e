"""``tinkergym push``: upload a finished run (model, model card, curve, metrics) to the Hugging Face Hub."""

from __future__ import annotations

import json

import click

from tinkergym.cli.common import SafePath


@click.command()
@click.option("--run", "run_dir", required=True, type=SafePath(exists=True, file_okay=False), help="The run folder (the --out of tinkergym train).")
@click.option("--repo-id", required=True, metavar="ORG/NAME", help="The model repo to push to; created if it does not exist.")
@click.option("--merged", is_flag=True, help="LoRA runs: merge the adapter into the base model and push a full model.")
@click.option("--private", is_flag=True, help="Create the repo private (an existing repo keeps its visibility).")
@click.option("--token", envvar="HF_TOKEN", show_envvar=True, help="Hugging Face token with write access (default: the cached login).")
@click.option("--revision", "--branch", "revision", metavar="BRANCH", help="Branch to commit to (default main); created if needed.")
@click.option("--commit-message", help="Commit message (default names the trainer, env and steps).")
def push(run_dir: str, repo_id: str, merged: bool, private: bool, token: str | None, revision: str | None, commit_message: str | None) -> None:
    """Push a finished training run to the Hugging Face Hub as one commit.

    Uploads the exported model (final/: a peft adapter, or a full model for --full runs and with
    --merged) with its tokenizer, a README.md model card (base model, envs with their package versions,
    trainer, resolved config, reward curve, final results, usage), learning_curve.png, metrics.jsonl,
    the run's config.json as tinkergym_config.json, and the last evaluation when the run evaluated.

    Exit codes: 2 for bad input (not a run folder, no final/ export, a bad repo id, no token),
    1 when the upload fails (the Hub's message is shown). HF_ENDPOINT selects another Hub.

    \b
    Examples:
      tinkergym push --run runs/bandit --repo-id my-name/bandit-grpo
      tinkergym push --run runs/bandit --repo-id my-org/bandit-grpo-merged --merged --private
      tinkergym push --run runs/bandit --repo-id my-name/bandit-grpo --branch step-30
    """
    from tinkergym.trainers.publish import PushOptions, push_run

    options = PushOptions(run=run_dir, repo_id=repo_id, merged=merged, private=private, token=token, revision=revision, commit_message=commit_message)
    result = push_run(options, log=lambda line: click.echo(line, err=True))  # bad input exits 2, a failed upload 1 (see TinkergymGroup)
    click.echo(json.dumps(result))
