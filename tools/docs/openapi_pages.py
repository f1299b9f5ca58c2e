"""The HTTP reference of the documentation site, from the servers' own OpenAPI documents (a MkDocs hook, see mkdocs.yml).

Each server's FastAPI app is built as its command builds it, but with throwaway settings in a temporary folder and no
model (building the app touches none: the backend, base or engine is only called by a request), and its
``app.openapi()`` is the document. A page names a document with ``[OAD(NAME)]`` on a line of its own; the hook puts
the document there, rendered as Markdown by essentials-openapi (its headings under the page's own), and adds each
document to the site as ``reference/openapi/NAME.json`` to download. Nothing here needs a network, a GPU or model
weights; the five documents take a few seconds, once per process (``mkdocs serve`` reuses them).

Run as a script, it writes the documents to a folder: ``python tools/docs/openapi_pages.py OUT_DIR``.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Where the documents are served in the site, beside the reference page.
SITE_FOLDER = "reference/openapi"
#: ``[OAD(NAME)]`` on a line of its own: the place of document NAME in a page.
MARKER = re.compile(r"^\[OAD\((?P<name>[a-z-]+)\)\]\s*$", re.MULTILINE)
#: A random 32-byte token's digest: the apps check requests against it, and the documents never see it.
DIGEST = bytes(32)
#: Templates that take the place of essentials-openapi's own: the responses of an operation as one table.
TEMPLATES = Path(__file__).with_name("openapi_templates")


def _scheduler(folder: Path) -> Any:
    from tinkergym.scheduler.app import SchedulerSettings, create_app

    settings = SchedulerSettings(db_url=f"sqlite:///{folder / 'scheduler.db'}", data_dir=folder / "data")
    return create_app(settings, background=False)


def _training(folder: Path) -> Any:
    from tinkergym.serve.training.app import create_app

    return create_app(None, run_dir=folder / "training", token_digest=DIGEST)


def _shared(folder: Path) -> Any:
    from tinkergym.serve.training.shared import create_shared_app

    return create_shared_app(None, run_dir=folder / "shared", token_digest=DIGEST)


def _model(folder: Path) -> Any:
    from tinkergym.serve.inference.app import create_inference_app

    return create_inference_app(None, DIGEST)


def _tinker(folder: Path) -> Any:
    from tinkergym.tinker_api.app import create_tinker_app
    from tinkergym.tinker_api.service import TinkerService

    logger = logging.getLogger("tinkergym.docs")
    return create_tinker_app(TinkerService(None, logger), lambda key: None, logger)


#: Each document's name and the builder of its app (in a fresh folder of its own).
APPS: dict[str, Callable[[Path], Any]] = {
    "scheduler": _scheduler,
    "training": _training,
    "shared": _shared,
    "model": _model,
    "tinker": _tinker,
}
_documents: dict[str, dict[str, Any]] = {}


def documents() -> dict[str, dict[str, Any]]:
    """Every app's OpenAPI document by name, built once per process."""
    if not _documents:
        with tempfile.TemporaryDirectory(prefix="tinkergym-openapi-") as tmp:
            for name, build in APPS.items():
                folder = Path(tmp) / name
                folder.mkdir()
                _documents[name] = build(folder).openapi()
    return _documents


def render(document: dict[str, Any]) -> str:
    """``document`` as Markdown, its title left out and its headings two levels down (under the page's ``##`` section)."""
    from openapidocs.mk.v3 import OpenAPIV3DocumentationHandler

    text = OpenAPIV3DocumentationHandler(document, style="MKDOCS", templates_path=str(TEMPLATES)).write()
    text = re.sub(r"^<!--.*?-->\s*", "", text, flags=re.DOTALL)  # the generator's own note
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and line.startswith("# "):
            continue  # the document's title: the page's section names it
        lines.append("#" + line if not fenced and re.match(r"#{2,5} ", line) else line)
    return "\n".join(lines)


# ----- the MkDocs hook ---------------------------------------------------------------------------------------
def on_files(files: Any, config: Any) -> Any:
    """Add each document to the site, as ``reference/openapi/NAME.json``."""
    from mkdocs.structure.files import File

    for name, document in documents().items():
        files.append(File.generated(config, f"{SITE_FOLDER}/{name}.json", content=json.dumps(document, indent=2)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Put the rendered document at each ``[OAD(NAME)]``; an unknown name fails the build, naming the known ones."""

    def place(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in APPS:
            from mkdocs.exceptions import PluginError

            raise PluginError(f"{page.file.src_uri}: no OpenAPI document {name!r}; the documents are {', '.join(APPS)}")
        return render(documents()[name])

    return MARKER.sub(place, markdown)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/docs/openapi_pages.py OUT_DIR")
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, document in documents().items():
        (out / f"{name}.json").write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        print(out / f"{name}.json")
