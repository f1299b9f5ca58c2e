"""``tinkergym train``'s options are made from TrainConfig's fields: one name, type, default and help each, on the field."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from tinkergym.cli import main
from tinkergym.cli.settings import SectionedCommand, given, setting_options
from tinkergym.cli.train import COMMAND_LINE_OPTIONS, SETTING_OPTIONS, build_config, train
from tinkergym.config import SECTIONS, TrainConfig, option_name, setting, setting_of

#: Fields that config files (or the run itself) set, with no option: the scheduler job a run records so that --resume
#: reattaches to it.
FILE_ONLY = {"scheduler_job"}


def _help(command: click.Command, args: tuple[str, ...] = ()) -> str:
    """``command``'s help on one line per option (wide enough that click wraps nothing), whitespace runs as one space."""
    result = CliRunner().invoke(command, [*args, "--help"], terminal_width=10_000, max_content_width=10_000)
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


def test_every_field_has_an_option_and_every_option_a_field_or_a_place_among_the_command_line_ones() -> None:
    settings = {f.name: setting_of(f) for f in fields(TrainConfig)}
    unset = [name for name, found in settings.items() if found is None or found.section not in SECTIONS]
    assert not unset, f"fields with no Setting (help, a section of SECTIONS), so no option: {unset}"
    assert {name for name, found in settings.items() if found is not None and found.option is None} == FILE_ONLY
    assert sorted(p.name for p in SETTING_OPTIONS if p.name) == sorted(set(settings) - FILE_ONLY)
    own = [p.name for p in COMMAND_LINE_OPTIONS]
    assert not set(own) & set(settings), "a command-line option named after a field would shadow the field's own"
    declared = {p.name for p in train.params} - {"help"}
    assert declared == {p.name for p in (*SETTING_OPTIONS, *COMMAND_LINE_OPTIONS)}, declared ^ {p.name for p in (*SETTING_OPTIONS, *COMMAND_LINE_OPTIONS)}


def test_an_option_takes_its_help_default_type_and_bounds_from_its_field() -> None:
    wide = CliRunner().invoke(train, ["--help"], terminal_width=10_000, max_content_width=10_000).output
    rows: dict[str, str] = {}  # option -> its help, a long option's on the next line
    for line in wide.split("\nRun:\n")[1].splitlines():
        if line.startswith("  -"):
            name = line.split()[0]
            rows[name] = line
        elif line.startswith("    "):
            rows[name] = " ".join((rows[name] + line).split())
    for f in fields(TrainConfig):
        found = setting_of(f)
        if f.name in FILE_ONLY or found is None:
            continue
        shown = rows[option_name(f.name)]
        assert found.help in shown, (f.name, shown)
        if f.default not in (MISSING, None, "") and not isinstance(f.default, bool):
            assert f"[default: {f.default}" in shown, (f.name, shown)
        for choice in found.choices:
            assert choice in shown.split("]")[0], (f.name, shown)
    text = _help(train)
    assert "--lr FLOAT RANGE Learning rate. [default: 0.0001; x>0]" in text
    assert "--seed INTEGER RANGE Run seed. [default: 0; 0<=x<=4294967295]" in text
    assert "--sampler-eager / --no-sampler-eager" in text and "--scheduler URL" in text and "--kwarg KEY=VALUE" in text


def test_a_subclass_with_another_default_and_help_shows_them_and_parses_to_them() -> None:
    """The options are made from the fields, not written beside them: a config class that changes a field changes its option."""

    @dataclass
    class LongRuns(TrainConfig):
        steps: int = field(default=300, metadata=setting("Optimizer steps of a long run.", "Run", min=5))

    command = SectionedCommand("long", params=setting_options(LongRuns), callback=lambda **options: options)
    text = _help(command)
    assert "--steps INTEGER RANGE Optimizer steps of a long run. [default: 300; x>=5]" in text
    assert "Optimizer steps. [default: 20" not in text
    assert command.main([], standalone_mode=False)["steps"] == 300
    refused = CliRunner().invoke(command, ["--steps", "4"])
    assert refused.exit_code == 2 and "4 is not in the range x>=5" in refused.output


def test_train_help_shows_every_option_in_its_section() -> None:
    result = CliRunner().invoke(main, ["train", "--help"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    for param in train.params:
        assert isinstance(param, click.Option)
        for name in (*param.opts, *param.secondary_opts):
            assert any(line.lstrip().startswith(name) or f" / {name}" in line for line in lines), name
    heads = [line[:-1] for line in lines if line and not line.startswith(" ") and line.endswith(":")]
    assert heads[-len(SECTIONS) - 1:] == [*SECTIONS, "Options"], heads
    model = result.output.split("\nModel:\n")[1].split("\n\n")[0]
    assert "--lora-rank" in model and "--full" in model and "--steps" not in model


def _config(tmp_path: Path, *args: str, file: str | None = None) -> TrainConfig:
    """The config ``train`` builds from ``args`` (and a config file holding ``file``), before anything trains."""
    if file is not None:
        (tmp_path / "config.yaml").write_text(file, encoding="utf-8")
        args = ("--config", str(tmp_path / "config.yaml"), *args)
    with train.make_context("train", list(args)) as ctx:
        config: TrainConfig = build_config(given(ctx.params, SETTING_OPTIONS))
    return config


def test_an_option_overrides_the_config_file_which_overrides_the_default(tmp_path: Path) -> None:
    file = "env: tinker/Bandit-v0\nsteps: 5\nlr: 0.001\nenv_kwargs: {arms: 3}\ndeterministic: true\nsampler_eager: false\nsampler: vllm\n"
    config = _config(tmp_path, "--steps", "2", "--kwarg", "payoff_seed=4", "--eval-kwarg", "arms=4", "--clip-high", "0.3", file=file)
    assert (config.steps, config.lr, config.group_size) == (2, 0.001, 8)  # the option, the file, the default
    assert config.env_kwargs == {"arms": 3, "payoff_seed": 4} and config.eval_env_kwargs == {"arms": 4}
    assert config.deterministic is True and config.sampler_eager is False and config.clip_high == 0.3
    assert _config(tmp_path, "--no-sampler-eager", "--sampler", "vllm", file="env: tinker/Bandit-v0\nsampler_eager: true\n").sampler_eager is False
    assert _config(tmp_path, "--env", "tinker/Bandit-v0", "--scheduler", "http://127.0.0.1:8780", "--wandb", "p").scheduler_url == "http://127.0.0.1:8780"


@pytest.mark.parametrize("args, named", [
    (["--lora-dropout", "1"], "--lora-dropout"),
    (["--weight-decay", "-0.1"], "--weight-decay"),
    (["--clip-low", "nan"], "nan is not a finite number"),
    (["--transcripts-every", "-1"], "--transcripts-every"),
    (["--env-latency", "3601"], "--env-latency"),
    (["--eval-kwarg", "split"], "--eval-kwarg"),
    (["--trainer-arg", "scale_by_std"], "--trainer-arg"),
    (["--dtype", "float16"], "--dtype"),
    (["--sampler-eager"], "--sampler vllm"),
])
def test_a_bad_value_is_refused_with_exit_2_naming_its_option(args: list[str], named: str) -> None:
    result = CliRunner().invoke(main, ["train", "--env", "tinker/Bandit-v0", "--model", "tiny", *args])
    assert result.exit_code == 2, result.output
    assert named in result.output, result.output


def test_a_server_owned_option_beside_backend_url_is_refused_by_its_option_name() -> None:
    result = CliRunner().invoke(main, ["train", "--env", "tinker/Bandit-v0", "--backend-url", "http://127.0.0.1:9", "--lora-dropout", "0.1",
                                       "--full"])
    assert result.exit_code == 2, result.output
    assert "--lora-dropout, --full: a training server's model is set where the server starts" in result.output
