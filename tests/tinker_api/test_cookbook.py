"""tinker-cookbook's own training loops, unchanged, against tinkergym's Tinker API: ``supervised.train`` on a local
conversation file and ``rl.train`` on hub envs (single-agent and AEC) through :mod:`tinkergym.cookbook`. Offline: the
tiny model, its tokenizer registered under the served model's name, the cookbook's ``role_colon`` renderer."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("tinker")
pytest.importorskip("tinker_cookbook")

from tinker_cookbook import tokenizer_utils  # noqa: E402

RENDERER = "role_colon"


@pytest.fixture
def cookbook(cluster: Any, tiny: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The served model's name loads the tiny model's tokenizer (the cookbook asks the hub by name otherwise)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    tokenizer_utils.register_tokenizer(cluster.model, lambda: tokenizer)
    monkeypatch.setenv("TINKER_API_KEY", cluster.keys["alice"])
    yield cluster
    tokenizer_utils.unregister_tokenizer(cluster.model)


def read_metrics(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_cookbook_supervised_train_on_a_local_file(cookbook: Any, tmp_path: Path) -> None:
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]}) + "\n"
                            for w in ("red", "green", "blue", "red", "green", "blue", "red", "green")))
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=cookbook.model, renderer_name=RENDERER, max_length=64, batch_size=4)
    config = train.Config(log_path=str(tmp_path / "sl"), model_name=cookbook.model, recipe_name="tinkergym-test", renderer_name=RENDERER,
                          dataset_builder=FromConversationFileBuilder(file_path=str(data), common_config=common), learning_rate=2e-2,
                          lr_schedule="constant", num_epochs=4, lora_rank=8, base_url=cookbook.url, save_every=0, eval_every=0)
    asyncio.run(train.main(config))
    losses = [r["train_mean_nll"] for r in read_metrics(tmp_path / "sl") if "train_mean_nll" in r]
    assert len(losses) == 8 and losses[-1] < 0.7 * losses[0], losses


@pytest.mark.slow
@pytest.mark.parametrize("env_id", ["tinker/Bandit-v0", "tinker/Gomoku-v0", "tinker/GomokuDuel-v0"])
def test_cookbook_rl_train_on_hub_envs(cookbook: Any, tmp_path: Path, env_id: str) -> None:
    from tinker_cookbook.rl import train

    from tinkergym.cookbook import HubRLDatasetBuilder

    kwargs = {"size": 5, "win_length": 3, "max_invalid_actions": 2} if "Gomoku" in env_id else {}
    builder = HubRLDatasetBuilder(env_id=env_id, renderer_name=RENDERER, model_name=cookbook.model, batch_size=2, group_size=3,
                                  num_batches=2, env_kwargs=kwargs)
    config = train.Config(learning_rate=1e-2, dataset_builder=builder, model_name=cookbook.model, recipe_name="tinkergym-test",
                          renderer_name=RENDERER, max_tokens=6, log_path=str(tmp_path / "rl"), eval_every=0, save_every=0, lora_rank=4,
                          base_url=cookbook.url)
    asyncio.run(train.main(config))
    rows = read_metrics(tmp_path / "rl")
    steps = [r for r in rows if any(k.startswith("env/all/") for k in r)]
    assert len(steps) == 2, rows
    assert all("env/all/reward/total" in r for r in steps)
    # single-agent: a group is group_size rollouts of one seed; AEC: a group is the two seats of one game
    episodes = 2 * (2 if "Duel" in env_id else 3)
    assert [r["env/all/total_episodes"] for r in steps] == [episodes, episodes]


def test_cookbook_rl_train_async_mode(cookbook: Any, tmp_path: Path) -> None:
    """The cookbook's async mode (sampling runs ahead of training, at most one step off policy) with the ppo loss."""
    from tinker_cookbook.rl import train

    from tinkergym.cookbook import HubRLDatasetBuilder

    builder = HubRLDatasetBuilder(env_id="tinker/Bandit-v0", renderer_name=RENDERER, model_name=cookbook.model, batch_size=2, group_size=3,
                                  num_batches=3)
    config = train.Config(learning_rate=1e-2, dataset_builder=builder, model_name=cookbook.model, recipe_name="tinkergym-test",
                          renderer_name=RENDERER, max_tokens=6, log_path=str(tmp_path / "rl"), eval_every=0, save_every=0, lora_rank=4,
                          base_url=cookbook.url, async_config=train.AsyncConfig(max_steps_off_policy=1, groups_per_batch=2, loss_fn="ppo"))
    asyncio.run(train.main(config))
    steps = [r for r in read_metrics(tmp_path / "rl") if "env/all/reward/total" in r]
    assert len(steps) == 3, steps
    assert all(r["env/all/total_episodes"] == 6 for r in steps)
