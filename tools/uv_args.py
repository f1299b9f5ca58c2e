"""Print the options that make ``uv pip install`` find packages where this machine's pip finds them.

``make install`` installs with uv (a resolver and installer many times faster than pip on two cores), which reads no
pip configuration. Where the machine points pip at other places (``pip.conf`` or ``PIP_*`` variables: a local folder of
wheels such as a CPU build of torch, extra indexes, a constraints file), uv must look there too, or it would pull other
builds (a multi-GB CUDA torch) from PyPI. This prints them as uv's options, one shell word each, read from
``pip config list`` (the environment's variables take precedence over the files, as in pip).

``python tools/uv_args.py [PYTHON]``: PYTHON's pip is asked (default: this interpreter's). Only the standard library:
``make install`` runs it with the new virtual environment's interpreter, whose pip is there before anything is installed.
"""

from __future__ import annotations

import re
import subprocess
import sys

#: pip's option -> uv's option. Each value of a pip option may hold several space-separated entries.
OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links", "constraint": "--constraint"}
LINE = re.compile(r"^(?P<section>[^.]*)\.(?P<key>[a-z-]+)='(?P<value>.*)'$")


def pip_settings(python: str) -> dict[str, str]:
    """pip's settings by name (``find-links``...), the last one listed winning: pip lists the files first, then the environment."""
    return parse(subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False).stdout)


def parse(listed: str) -> dict[str, str]:
    """The settings of ``pip config list``'s output (``global.find-links='/opt/wheels'`` lines), the last of a name winning."""
    settings: dict[str, str] = {}
    for line in listed.splitlines():
        match = LINE.match(line.strip())
        if match and match["section"] in ("global", "install", ":env:"):
            settings[match["key"]] = match["value"]
    return settings


def uv_args(settings: dict[str, str]) -> list[str]:
    """uv's options for pip's settings, in a fixed order; uv then takes the best match over all the indexes, as pip does."""
    args = []
    for key, option in OPTIONS.items():
        for value in settings.get(key, "").split():
            args += [option, value]
    if "extra-index-url" in settings or "find-links" in settings:
        args += ["--index-strategy", "unsafe-best-match"]
    return args


if __name__ == "__main__":
    # One line of words for the shell to split: pip itself splits these settings at whitespace, so no value holds any.
    print(" ".join(uv_args(pip_settings(sys.argv[1] if len(sys.argv) > 1 else sys.executable))))
