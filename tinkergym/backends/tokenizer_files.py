"""A model's tokenizer and chat template as files over the wire: read on a server, cached by content on a client.

The training server (``GET /v1/tokenizer``) and the inference server (``GET /v1/tokenizer``) send the same
allowlisted files of the model folder as ``{"files": {name: text}}``, so a client without the model (and
without torch) renders prompts with exactly the server's tokenizer and chat template. A vision-language model's
folder (a config with a ``vision_config`` and an image processor) sends its image processor's files too, so the
client renders images as the server's model reads them (:func:`tinkergym.chat.renderer_for` picks the image renderer
of such a folder). Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Any

from tinkergym.plumbing.folders import cache_root

#: Files of a model folder a client needs to build the same tokenizer and chat template.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "chat_template.jinja", "chat_template.json", "generation_config.json",
)
#: The image processor's files, sent beside the tokenizer's by a vision-language model's folder.
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
#: A file name a client accepts (no separators, no leading dot).
FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def files_folder(name_or_path: str) -> str | None:
    """A local folder with the config, tokenizer and image processor files of a model folder or hub id, for reading them
    without the weights: the folder itself, the hub id's snapshot in the local Hugging Face cache, or (the hub answering)
    those files alone downloaded; None when there is none (an unknown name, a hub out of reach)."""
    from tinkergym.backends.models import from_hub, from_hub_cache

    local = os.path.expanduser(name_or_path)
    if os.path.isdir(local):
        return local
    if "/" in name_or_path and not name_or_path.startswith((".", "/", "~")):
        return from_hub_cache(name_or_path) or from_hub(name_or_path, ["config.json", *TOKENIZER_FILES, *PROCESSOR_FILES])
    return None


def read_tokenizer_files(folder: str | Path) -> dict[str, str]:
    """The allowlisted tokenizer files present in ``folder`` (name -> text), and its image processor's files
    (:data:`PROCESSOR_FILES`) when it holds a vision-language model."""
    from tinkergym.backends.models import is_vision_folder

    files = {}
    for name in TOKENIZER_FILES + (PROCESSOR_FILES if is_vision_folder(folder) else ()):
        path = Path(folder) / name
        if path.is_file():
            files[name] = path.read_text(encoding="utf-8")
    return files


def default_cache_dir() -> Path:
    """Where fetched tokenizer folders live: ``$TINKERGYM_CACHE/remote`` or ``~/.cache/tinkergym/remote``."""
    return cache_root() / "remote"


def cache_tokenizer_files(answer: Any, cache_dir: Path, source: str) -> str:
    """A local folder holding the files of a ``/v1/tokenizer`` answer (checked; written once per content digest).

    Raises ValueError naming ``source`` (e.g. "the training server at URL") when the answer is not a set of
    tokenizer files.
    """
    files = answer.get("files") if isinstance(answer, dict) else None
    if not isinstance(files, dict) or not files or not all(isinstance(v, str) for v in files.values()):
        raise ValueError(f"{source} sent no tokenizer files")
    for filename in files:
        if not isinstance(filename, str) or not FILE_NAME.match(filename):
            raise ValueError(f"{source} sent a tokenizer file named {str(filename)[:140]!r}")
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode("utf-8")).hexdigest()
    return str(_write_once(Path(cache_dir) / digest, files))


def _write_once(dest: Path, files: dict[str, str]) -> Path:
    """``dest`` holding ``files`` (name -> text): written through a private ``.tmp`` folder unless already there."""
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for filename, text in files.items():
        (tmp / filename).write_text(text, encoding="utf-8")
    try:
        os.rename(tmp, dest)
    except OSError:  # another process wrote the same content first
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
