"""Hostile input to the ``tinkergym`` command line: a message that names the problem, exit code 2, never a traceback.

Every case fails while reading its input, before any model is built or any env is played, so the whole
table runs in seconds. The second half checks the same inputs through the Python API.
"""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium as gym
import pytest
from click.testing import CliRunner

import tinkergym
from tinkergym.backends import models
from testkit import own_envs  # registered by tests/conftest.py
from tinkergym.cli import main
from tinkergym.errors import ConfigError

BANDIT = "tinker/Bandit-v0"
DEEP = 100_000  # nesting depth of hostile JSON: far past Python's recursion limit
LONG_NAME = "x" * 5_000  # longer than any file name a file system takes
VALID_RUN_CONFIG = {"env": BANDIT, "model": "tiny", "steps": 1}


def _run_folder(root: Path, name: str, config: bytes | str | object, metrics: str | None = None, final: bool = False) -> Path:
    """A run folder as train would leave it, with ``config`` (bytes and text written as they are) as its config.json."""
    folder = root / name
    folder.mkdir()
    data = config if isinstance(config, bytes) else (config if isinstance(config, str) else json.dumps(config)).encode()
    (folder / "config.json").write_bytes(data)
    if metrics is not None:
        (folder / "metrics.jsonl").write_text(metrics, encoding="utf-8")
    if final:  # an exported LoRA adapter, as far as push looks before it uploads
        (folder / "final").mkdir()
        (folder / "final" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "tiny"}), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    """Hostile files and folders, by name; the case table refers to them as ``{name}``."""
    root = tmp_path_factory.mktemp("hostile")
    files = {
        "yaml_invalid": ("bad.yaml", "env: [unclosed\nsteps: 3\n"),
        "json_invalid": ("bad.json", '{"env": "tinker/Bandit-v0",'),
        "no_suffix": ("config", "env: tinker/Bandit-v0\n"),
        "steps_abc": ("steps.yaml", "env: tinker/Bandit-v0\nsteps: abc\n"),
        "lr_text": ("lr.json", '{"env": "tinker/Bandit-v0", "lr": "x"}'),
        "int_key": ("intkey.yaml", "env: tinker/Bandit-v0\n1: 2\n"),
        "list_config": ("list.yaml", "- env\n- steps\n"),
        "unknown_key": ("unknown.yaml", "env: tinker/Bandit-v0\nstpes: 3\n"),
        "deep_json": ("deep.json", "[" * DEEP + "]" * DEEP),
        "deep_yaml": ("deep.yaml", "[" * 5_000 + "]" * 5_000),
        "kwargs_list": ("kwargs.yaml", "env: tinker/Bandit-v0\nenv_kwargs: [1, 2]\n"),
        "steps_float": ("float.yaml", "env: tinker/Bandit-v0\nsteps: .inf\n"),
        "zero_checkpoint": ("zero.yaml", "env: tinker/Bandit-v0\ncheckpoint_every: 0\n"),
        "nul_out": ("nul.json", '{"env": "tinker/Bandit-v0", "out": "runs/a\\u0000b"}'),
        "deep_data": ("deep.jsonl", '{"question": ' + "[" * DEEP + "]" * DEEP + ', "answer": "1"}\n'),
        "a_file": ("a_file.txt", "not a folder\n"),
        "yaml_bomb": ("bomb.yaml", "env: tinker/Bandit-v0\nenv_kwargs:\n  l0: &l0 [x, x, x, x, x, x, x, x, x, x]\n"
                      + "".join(f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 9))),
        "kwargs_int_key": ("kwargs_key.yaml", "env: tinker/Bandit-v0\nenv_kwargs: {1: 2}\n"),
        "negative_seed": ("seed.yaml", "env: tinker/Bandit-v0\nseed: -1\n"),
        "dtype": ("dtype.yaml", "env: tinker/Bandit-v0\ndtype: float16\n"),
        "python_tag": ("tag.yaml", "env: !!python/object/apply:os.system [echo hi]\n"),
        "yaml_scalar": ("scalar.yaml", "just text\n"),
    }
    found = {name: str(root / filename) for name, (filename, _) in files.items()}
    for filename, text in files.values():
        (root / filename).write_text(text, encoding="utf-8")
    (root / "latin1.yaml").write_bytes("env: tinker/Bandit-v0\nmodel: caf\xe9\n".encode("latin-1"))
    found["latin1"] = str(root / "latin1.yaml")
    # envs new: the package folder the scaffold would create is a file
    (root / "blocked").mkdir()
    (root / "blocked" / "tinkergym-wordle").write_text("in the way\n", encoding="utf-8")
    found["blocked"] = str(root / "blocked")
    # run folders
    found["run_invalid_json"] = str(_run_folder(root, "run_invalid_json", b'{"env": "tinker/Bandit-v0", "steps": '))
    found["run_wrong_types"] = str(_run_folder(root, "run_wrong_types", {**VALID_RUN_CONFIG, "steps": "abc"}))
    found["run_no_checkpoint"] = str(_run_folder(root, "run_no_checkpoint", VALID_RUN_CONFIG))
    found["run_list"] = str(_run_folder(root, "run_list", [1, 2, 3]))
    found["run_latin1"] = str(_run_folder(root, "run_latin1", '{"env": "tinker/Bandit-v0", "model": "caf\xe9"}'.encode("latin-1")))
    found["push_bad_metrics"] = str(_run_folder(root, "push_bad_metrics", VALID_RUN_CONFIG, metrics='{"step": 0, "reward/mean": 0.5}\n{"step": 1, \n{"step": 2}\n', final=True))
    found["push_step_abc"] = str(_run_folder(root, "push_step_abc", VALID_RUN_CONFIG, metrics='{"step": "abc", "reward/mean": 0.5}\n', final=True))
    found["push_kwargs_5"] = str(_run_folder(root, "push_kwargs_5", {**VALID_RUN_CONFIG, "env_kwargs": 5}, final=True))
    found["push_latin1"] = str(_run_folder(root, "push_latin1", '{"env": "tinker/Bandit-v0", "model": "caf\xe9"}'.encode("latin-1"), final=True))
    found["push_metrics_list"] = str(_run_folder(root, "push_metrics_list", VALID_RUN_CONFIG, metrics="[1, 2]\n", final=True))
    # eval --model: folders that are not models
    (root / "empty_model").mkdir()
    found["empty_model"] = str(root / "empty_model")
    (root / "junk_model").mkdir()
    (root / "junk_model" / "config.json").write_text("this is not json", encoding="utf-8")
    found["junk_model"] = str(root / "junk_model")
    (root / "typeless_model").mkdir()
    (root / "typeless_model" / "config.json").write_text('{"hidden_size": 8}', encoding="utf-8")
    found["typeless_model"] = str(root / "typeless_model")
    found["tmp"] = str(root)
    return found


# (id, arguments, a word the message must contain). "{name}" is replaced by the path of that name in ``paths``.
CASES = [
    # envs new
    ("new-long-name", ["envs", "new", "a" * 300], "too long"),
    ("new-dir-unwritable", ["envs", "new", "wordle", "--dir", "/proc/nonexistent"], "/proc/nonexistent"),
    ("new-dir-is-a-file", ["envs", "new", "wordle", "--dir", "{a_file}"], "a_file.txt"),
    ("new-package-is-a-file", ["envs", "new", "wordle", "--dir", "{blocked}"], "not a folder"),
    ("new-package-is-a-file-force", ["envs", "new", "wordle", "--dir", "{blocked}", "--force"], "not a folder"),
    ("new-dir-nul", ["envs", "new", "wordle", "--dir", "a\0b"], "NUL"),
    ("new-dir-name-too-long", ["envs", "new", "wordle", "--dir", LONG_NAME], "too long"),
    ("check-bad-kwarg", ["envs", "check", BANDIT, "--kwarg", "payoff_seed=-1"], "payoff_seed"),
    ("check-unknown-kwarg", ["envs", "check", BANDIT, "--kwarg", "colour=7"], "colour"),
    ("check-huge-fuzz", ["envs", "check", BANDIT, "--fuzz", "99999999999999999999999"], "--fuzz"),
    ("new-bad-id", ["envs", "new", "wordle", "--id", "no version"], "--id"),
    # play
    ("play-negative-seed", ["play", BANDIT, "--agent", "random", "--seed", "-5"], "--seed"),
    ("play-huge-seed", ["play", BANDIT, "--agent", "random", "--seed", "99999999999999999999999"], "--seed"),
    ("play-jsonl-unwritable", ["play", BANDIT, "--agent", "random", "--jsonl", "/proc/nope/x.jsonl"], "/proc/nope/x.jsonl"),
    ("play-jsonl-is-a-folder", ["play", BANDIT, "--agent", "random", "--jsonl", "{tmp}"], "--jsonl"),
    ("play-jsonl-nul", ["play", BANDIT, "--agent", "random", "--jsonl", "x\0.jsonl"], "NUL"),
    ("play-negative-payoff-seed", ["play", BANDIT, "--agent", "random", "--kwarg", "payoff_seed=-1"], "payoff_seed"),
    ("play-text-payoff-seed", ["play", BANDIT, "--agent", "random", "--kwarg", "payoff_seed=x"], "payoff_seed"),
    ("play-huge-arms", ["play", BANDIT, "--agent", "random", "--kwarg", "arms=99999999999999999999999"], "arms"),
    ("play-unknown-kwarg", ["play", BANDIT, "--agent", "random", "--kwarg", "colour=7"], "colour"),
    ("play-kwarg-not-identifier", ["play", BANDIT, "--agent", "random", "--kwarg", "1abc=2"], "KEY=VALUE"),
    ("play-kwarg-without-value", ["play", BANDIT, "--agent", "random", "--kwarg", "arms"], "KEY=VALUE"),
    ("play-deep-data-file", ["play", "tinker/Math-v0", "--agent", "random", "--kwarg", "data_files={deep_data}"], "deep.jsonl"),
    ("play-missing-data-file", ["play", "tinker/Math-v0", "--agent", "random", "--kwarg", "data_files=/nonexistent.jsonl"], "nonexistent.jsonl"),
    ("play-kwarg-deep-json", ["play", BANDIT, "--agent", "random", "--kwarg", "arms=" + "[" * DEEP], "arms"),
    ("play-kwarg-nan", ["play", "tinker/Math-v0", "--agent", "random", "--kwarg", "format_reward=NaN"], "format_reward"),
    ("play-data-file-name-too-long", ["play", "tinker/Math-v0", "--agent", "random", "--kwarg", "data_files=" + LONG_NAME], "too long"),
    ("play-max-steps-0", ["play", BANDIT, "--agent", "random", "--max-steps", "0"], "--max-steps"),
    # train --config
    ("config-invalid-yaml", ["train", "--config", "{yaml_invalid}"], "bad.yaml"),
    ("config-invalid-json", ["train", "--config", "{json_invalid}"], "bad.json"),
    ("config-no-suffix", ["train", "--config", "{no_suffix}"], ".yaml"),
    ("config-steps-abc", ["train", "--config", "{steps_abc}"], "steps"),
    ("config-lr-text", ["train", "--config", "{lr_text}"], "lr"),
    ("config-integer-key", ["train", "--config", "{int_key}"], "1"),
    ("config-not-utf8", ["train", "--config", "{latin1}"], "UTF-8"),
    ("config-list", ["train", "--config", "{list_config}"], "mapping"),
    ("config-unknown-key", ["train", "--config", "{unknown_key}"], "stpes"),
    ("config-deep-json", ["train", "--config", "{deep_json}"], "deep.json"),
    ("config-deep-yaml", ["train", "--config", "{deep_yaml}"], "deep.yaml"),
    ("config-kwargs-list", ["train", "--config", "{kwargs_list}"], "env_kwargs"),
    ("config-steps-infinite", ["train", "--config", "{steps_float}"], "steps"),
    ("config-checkpoint-every-0", ["train", "--config", "{zero_checkpoint}"], "checkpoint"),
    ("config-yaml-bomb", ["train", "--config", "{yaml_bomb}"], "env_kwargs"),
    ("config-nested-integer-key", ["train", "--config", "{kwargs_int_key}"], "env_kwargs"),
    ("config-negative-seed", ["train", "--config", "{negative_seed}"], "seed"),
    ("config-unknown-dtype", ["train", "--config", "{dtype}"], "float16"),
    ("config-python-tag", ["train", "--config", "{python_tag}"], "tag.yaml"),
    ("config-scalar", ["train", "--config", "{yaml_scalar}"], "mapping"),
    ("config-out-nul", ["train", "--config", "{nul_out}"], "NUL"),
    ("config-path-nul", ["train", "--config", "a\0b.yaml"], "NUL"),
    # train options
    ("train-steps-0", ["train", "--env", BANDIT, "--steps", "0"], "--steps"),
    ("train-negative-lr", ["train", "--env", BANDIT, "--lr", "-1"], "lr"),
    ("train-nan-lr", ["train", "--env", BANDIT, "--lr", "nan"], "lr"),
    ("train-infinite-lr", ["train", "--env", BANDIT, "--lr", "inf"], "lr"),
    ("train-huge-seed", ["train", "--env", BANDIT, "--seed", "99999999999999999999999"], "--seed"),
    ("train-out-is-a-file", ["train", "--env", BANDIT, "--model", "tiny", "--out", "{a_file}"], "a_file.txt"),
    ("train-out-unwritable", ["train", "--env", BANDIT, "--model", "tiny", "--out", "/proc/nope/run"], "/proc/nope/run"),
    ("train-out-name-too-long", ["train", "--env", BANDIT, "--model", "tiny", "--out", LONG_NAME], "too long"),
    ("train-env-nul", ["train", "--env", "tinker/Bandit\0-v0"], "Bandit"),
    ("train-unknown-trainer", ["train", "--env", BANDIT, "--trainer", "grop"], "grpo"),
    ("train-multi-agent-env", ["train", "--env", "tinker/GomokuDuel-v0"], "multi-agent"),
    ("train-misspelt-trainer-arg", ["train", "--env", BANDIT, "--trainer-arg", "scale_by_sdt=false"], "scale_by_std"),
    ("train-rloo-trainer-arg", ["train", "--env", BANDIT, "--trainer", "rloo", "--trainer-arg", "scale_by_std=false"], "rloo"),
    ("train-sft-misspelt-arg", ["train", "--trainer", "sft", "--trainer-arg", "demo_episode=5", "--demos", "baseline", "--env", BANDIT], "demo_episodes"),
    ("train-bad-env-kwarg", ["train", "--env", BANDIT, "--kwarg", "payoff_seed=-1"], "payoff_seed"),
    # train --resume / eval --run with a malformed config.json
    ("resume-invalid-json", ["train", "--resume", "{run_invalid_json}"], "config.json"),
    ("resume-wrong-types", ["train", "--resume", "{run_wrong_types}"], "steps"),
    ("resume-not-a-mapping", ["train", "--resume", "{run_list}"], "mapping"),
    ("resume-not-utf8", ["train", "--resume", "{run_latin1}"], "UTF-8"),
    ("eval-run-invalid-json", ["eval", "--env", BANDIT, "--run", "{run_invalid_json}"], "config.json"),
    ("eval-run-wrong-types", ["eval", "--env", BANDIT, "--run", "{run_wrong_types}"], "steps"),
    ("eval-run-not-a-mapping", ["eval", "--env", BANDIT, "--run", "{run_list}"], "mapping"),
    ("eval-run-without-checkpoint", ["eval", "--env", BANDIT, "--run", "{run_no_checkpoint}"], "no checkpoint"),
    # eval --model with a folder that is not a model
    ("eval-model-empty-folder", ["eval", "--env", BANDIT, "--model", "{empty_model}"], "empty_model"),
    ("eval-model-junk-config", ["eval", "--env", BANDIT, "--model", "{junk_model}"], "config.json"),
    ("eval-model-config-without-type", ["eval", "--env", BANDIT, "--model", "{typeless_model}"], "model_type"),
    ("eval-model-nul", ["eval", "--env", BANDIT, "--model", "a\0b"], "a\\x00b"),
    ("eval-out-is-a-folder", ["eval", "--env", BANDIT, "--model", "tiny", "--out", "{tmp}"], "--out"),
    ("eval-out-unwritable", ["eval", "--env", BANDIT, "--model", "tiny", "--out", "/proc/nope/t.jsonl"], "/proc/nope"),
    ("eval-out-name-too-long", ["eval", "--env", BANDIT, "--model", "tiny", "--out", LONG_NAME], "too long"),
    ("eval-huge-episodes", ["eval", "--env", BANDIT, "--model", "tiny", "--episodes", "99999999999999999999"], "--episodes"),
    ("eval-nan-temperature", ["eval", "--env", BANDIT, "--model", "tiny", "--temperature", "nan"], "--temperature"),
    ("eval-nan-top-p", ["eval", "--env", BANDIT, "--model", "tiny", "--top-p", "nan"], "--top-p"),
    ("eval-bad-env-kwarg", ["eval", "--env", BANDIT, "--model", "tiny", "--kwarg", "arms=1"], "arms"),
    # push: a malformed run folder fails before any upload
    ("push-malformed-metrics", ["push", "--run", "{push_bad_metrics}", "--repo-id", "me/x", "--token", "hf_x"], "metrics.jsonl"),
    ("push-step-abc", ["push", "--run", "{push_step_abc}", "--repo-id", "me/x", "--token", "hf_x"], "step"),
    ("push-metrics-not-objects", ["push", "--run", "{push_metrics_list}", "--repo-id", "me/x", "--token", "hf_x"], "metrics.jsonl"),
    ("push-env-kwargs-5", ["push", "--run", "{push_kwargs_5}", "--repo-id", "me/x", "--token", "hf_x"], "env_kwargs"),
    ("push-config-not-utf8", ["push", "--run", "{push_latin1}", "--repo-id", "me/x", "--token", "hf_x"], "UTF-8"),
]


@pytest.mark.parametrize("args, keyword", [pytest.param(a, k, id=i) for i, a, k in CASES])
def test_bad_input_exits_2_with_a_message_that_names_it(paths, args, keyword, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # nothing a case writes lands in the repository
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    real_resolve_model = models.resolve_model

    def no_model_loads(name: str, cache_dir: object = None) -> str:
        if name in models.KNOWN_MODELS:  # what follows builds or converts a model: bad input must fail before
            raise AssertionError(f"bad input reached model loading ({name!r}) instead of failing first")
        return real_resolve_model(name, cache_dir)  # checks a local folder, or refuses the name (the hub is offline)

    monkeypatch.setattr(models, "resolve_model", no_model_loads)
    result = CliRunner().invoke(main, [a.format(**paths) if "{" in a else a for a in args])
    output = result.output
    assert "Traceback" not in output, output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2, output
    assert "Error" in output and keyword in output, output
    message = output[output.index("Error") :]
    assert len(message.splitlines()) <= 3 and len(message) <= 2_500, message



# ----- the Python API -----------------------------------------------------------------------------------
@pytest.mark.parametrize("env_id", [s.id for s in own_envs()])
@pytest.mark.parametrize("options", ["moves", ["index", 0], 5])
def test_reset_options_that_are_not_a_mapping_are_a_config_error(env_id, options) -> None:
    s = tinkergym.spec(env_id)
    env = tinkergym.make_aec(env_id) if s.kind == "aec" else gym.make(env_id)
    with pytest.raises(ConfigError, match=r"reset\(options=\.\.\.\) takes a dict"):
        env.reset(seed=0, options=options)
    env.reset(seed=0, options={})  # the env still works


@pytest.mark.parametrize("payoff_seed", ["x", -1, 1.5])
def test_a_bad_payoff_seed_is_a_config_error_at_construction(payoff_seed) -> None:
    with pytest.raises(ConfigError, match="payoff_seed"):
        gym.make(BANDIT, payoff_seed=payoff_seed)


@pytest.mark.parametrize("answer", ["inf", "-inf", "nan", "1e999"])
def test_a_non_finite_math_answer_is_graded_wrong(answer) -> None:
    env = gym.make("tinker/Math-v0")
    env.reset(seed=0)
    _, reward, terminated, _, info = env.step(f"\\boxed{{{answer}}}")
    assert reward == 0.0 and terminated and info["correct"] is False


def test_train_refuses_an_out_folder_that_holds_a_run(tmp_path: Path) -> None:
    # A second `train --out` into a run's folder would replace its metrics and checkpoints: refused, nothing touched.
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"env": "tinker/Bandit-v0"}))
    (run / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n')
    result = CliRunner().invoke(main, ["train", "--env", "tinker/Bandit-v0", "--model", "tiny", "--out", str(run)])
    assert result.exit_code == 2 and f"--resume {run}" in result.output and "--overwrite" in result.output
    assert "Usage:" not in result.output  # the message alone: the command line was right, the folder is taken
    assert (run / "metrics.jsonl").read_text() == '{"step": 0, "loss": 1.0}\n'
