"""The examples of the documentation, found, parsed and run (tests/docs/test_docs_examples.py is their test).

Every fenced ```python and ```bash block of README.md and docs/**/*.md is an example. An HTML comment on the line just
above a fence (invisible on the site) says how it is checked; several may stand one above the other:

- ``<!-- docs-test: skip: REASON -->``: not run (a GPU, hours of training, a real upload); its command lines are
  still parsed. A skip without a reason is refused.
- ``<!-- docs-test: fixture=NAME -->``: run with what the fixture provides (:data:`FIXTURES`) in its environment.
- ``<!-- docs-test: continue -->``: a python block run in the namespace of the python block before it on the page.
- ``<!-- docs-test: background -->``: a bash block that starts a server: it runs in the background, in a process group
  of its own, until its ports answer HTTP on 127.0.0.1 (those of its ``--port N`` and ``--metrics-port N`` options, or
  ``background=PORT``), and serves the page's later blocks; the group is stopped (SIGTERM, then SIGKILL) at the page's
  end, pass or fail.

Each ``tinkergym ...`` command line of a bash block (skipped or not) is parsed against the real click command tree:
its command and subcommands exist, every option exists and every value converts, without the command being run.
Python blocks run each in a fresh interpreter (with the blocks they continue), bash blocks with ``bash -euo
pipefail``; both in a folder of their page, offline, with the virtual environment's ``bin`` first on ``PATH``.

A page's blocks run in order and share a :class:`PageRun`: the variables a bash block exports are in the environment
of the blocks after it, and a background block's ports are moved to free ones (the same substitution in every later
block of the page: ``--port N``, ``--metrics-port N``, ``127.0.0.1:N``, ``localhost:N``), so pages that show the
same port run side by side and the printed pages keep their ports.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[2]
#: The fixtures a block may ask for, and the variables each puts in the block's environment.
FIXTURES = {
    "scheduler": "a scheduler on 127.0.0.1 (SQLite): TINKERGYM_URL and TINKERGYM_SCHEDULER (its URL), TINKERGYM_API_KEY (a tenant's key), "
                 "TINKERGYM_SCHEDULER_DB (its database, for the operator's commands)",
    "tiny-model": "a tiny random model folder: TINY_MODEL",
}
#: How long one example (a python block with those it continues, or a bash block) may run.
TIMEOUT_S = 120
#: How long a background block may take to answer on its ports, and to stop after SIGTERM before SIGKILL.
READY_TIMEOUT_S = 180
STOP_GRACE_S = 10
#: Fence languages that are examples, and spellings of them that are refused (they would escape the checks).
LANGUAGES = ("python", "bash")
OTHER_SPELLINGS = {"py": "python", "python3": "python", "pycon": "python", "sh": "bash", "shell": "bash", "zsh": "bash", "console": None}
PORT_OPTION = re.compile(r"--(?:[a-z]+-)*port[ =](\d+)\b")  # --port N, --metrics-port N
DIRECTIVE = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[^\s`{]*)")


class ConventionError(Exception):
    """A page breaks the examples' convention (a skip without a reason, an unknown fixture, a stray directive)."""


@dataclass
class Block:
    """One fenced example: where it is, its language and code, and how its directives say to check it."""

    page: str
    path: Path
    line: int
    lang: str
    code: str
    skip: str | None = None
    fixtures: tuple[str, ...] = ()
    continues: bool = False
    background: int | None = None  # a background block: the port it is ready on, 0 for those of its --port options

    @property
    def where(self) -> str:
        """``PAGE:LINE`` of the block's opening fence."""
        return f"{self.page}:{self.line}"


def pages(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown page under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def page_name(path: Path, root: Path = ROOT) -> str:
    """``path`` as the tests name it: relative to the repository where it is inside it."""
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)


def _directives(body: list[tuple[int, str]], where: str) -> tuple[str | None, tuple[str, ...], bool, int | None]:
    skip, fixtures, continues, background = None, [], False, None
    for line, text in body:
        if text == "continue":
            continues = True
        elif text == "background" or text.startswith("background="):
            port = text.partition("=")[2].strip() or "0"
            if not port.isdigit():
                raise ConventionError(f"{where}: line {line}: background=PORT takes a port number, not {port!r}")
            background = int(port)
        elif text == "skip" or text.startswith("skip:") or text.startswith("skip "):
            reason = text[4:].lstrip(": ").strip()
            if not reason:
                raise ConventionError(f"{where}: line {line}: a skip needs its reason: <!-- docs-test: skip: REASON -->")
            skip = reason
        elif text.startswith("fixture="):
            name = text[len("fixture="):].strip()
            if name not in FIXTURES:
                raise ConventionError(f"{where}: line {line}: no fixture {name!r}; the fixtures are: {', '.join(FIXTURES)}")
            fixtures.append(name)
        else:
            raise ConventionError(f"{where}: line {line}: unknown directive {text!r}: write skip: REASON, fixture=NAME, continue "
                                  "or background")
    return skip, tuple(fixtures), continues, background


def read_blocks(path: Path, name: str | None = None) -> list[Block]:
    """The python and bash blocks of the page at ``path``; :class:`ConventionError` where the page breaks the convention."""
    name = name or page_name(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    pending: list[tuple[int, str]] = []  # the directives just above the current line
    i = 0
    while i < len(lines):
        directive = DIRECTIVE.match(lines[i])
        fence = FENCE.match(lines[i])
        if directive:
            pending.append((i + 1, directive.group("body")))
            i += 1
            continue
        if not fence:
            if pending:
                raise ConventionError(f"{name}:{pending[0][0]}: a docs-test directive must stand on the line just above a fence")
            i += 1
            continue
        indent, marks, lang = len(fence.group("indent")), fence.group("fence"), fence.group("lang").lower()
        close = re.compile(rf"^[ \t]*{re.escape(marks[0])}{{{len(marks)},}}[ \t]*$")
        end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), len(lines))
        code = "\n".join(line[indent:] if line[:indent].strip() == "" else line.lstrip() for line in lines[i + 1:end])
        where = f"{name}:{i + 1}"
        if lang in OTHER_SPELLINGS and (OTHER_SPELLINGS[lang] is not None or pending):
            instead = f"```{OTHER_SPELLINGS[lang]}" if OTHER_SPELLINGS[lang] else "```bash for a command to check, ```text for output"
            raise ConventionError(f"{where}: ```{lang} is not checked: write {instead}")
        if lang in LANGUAGES:
            skip, fixtures, continues, background = _directives(pending, where)
            if background is not None and lang != "bash":
                raise ConventionError(f"{where}: background is for bash blocks (a server started from the shell)")
            if background == 0 and not PORT_OPTION.search(code):
                raise ConventionError(f"{where}: a background block without a --port N option says its port: background=PORT")
            if continues and lang != "python":
                raise ConventionError(f"{where}: continue is for python blocks (a bash block runs on its own)")
            if continues and (not blocks or blocks[-1].lang != "python" or blocks[-1].skip):
                raise ConventionError(f"{where}: continue follows a python block that runs; the block before it is not one")
            blocks.append(Block(name, path, i + 1, lang, code + "\n", skip, fixtures, continues, background))
        elif pending:
            raise ConventionError(f"{where}: docs-test directives are for python and bash blocks, not ```{lang or 'text'}")
        pending = []
        i = end + 1
    if pending:
        raise ConventionError(f"{name}:{pending[0][0]}: a docs-test directive must stand on the line just above a fence")
    return blocks


# ----- command lines -----------------------------------------------------------------------------------------
#: Stands for a word the shell would compute (``$VAR``, ``$(...)``): replaced by a value of the option's type when parsed.
DYNAMIC = "@@docs-dynamic@@"
SEPARATORS = {";", "&&", "||", "|", "&", "|&", "(", ")", "\n"}
REDIRECTIONS = {">", ">>", "<", "<<", "<<<", ">&", "&>", "<&", ">|", "&>>"}
PREFIXES = {"exec", "nohup", "time", "sudo", "command", "env"}


@dataclass
class CommandLine:
    """A ``tinkergym`` command of a bash block: where it starts, the line as written, and its arguments."""

    where: str
    text: str
    argv: list[str]
    comment: str = ""
    inner: list[CommandLine] = field(default_factory=list)


def _substitutions(text: str) -> tuple[str, list[str]]:
    """``text`` with each ``$(...)`` (outside single quotes) replaced by :data:`DYNAMIC`, and the commands inside them."""
    out, inner, i, quote = [], [], 0, ""
    while i < len(text):
        char = text[i]
        if char == "'" and quote != '"':
            quote = "" if quote == "'" else "'"
        elif char == '"' and quote != "'":
            quote = "" if quote == '"' else '"'
        elif char == "\\" and quote != "'":
            out.append(text[i:i + 2])
            i += 2
            continue
        if text.startswith("$(", i) and quote != "'" and not text.startswith("$((", i):
            depth, j = 1, i + 2
            while j < len(text) and depth:
                depth += {"(": 1, ")": -1}.get(text[j], 0)
                j += 1
            inner.append(text[i + 2:j - 1])
            out.append(DYNAMIC)
            i = j
            continue
        out.append(char)
        i += 1
    return "".join(out), inner


def _words(text: str) -> list[str]:
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def _simple_commands(words: list[str]) -> Iterator[list[str]]:
    current: list[str] = []
    skip_next = False
    for word in words:
        if skip_next:
            skip_next = False
            continue
        if word in SEPARATORS:
            if current:
                yield current
            current = []
        elif word in REDIRECTIONS or (word[:1] in "<>" and set(word) <= set("<>&|")):
            if current and current[-1].isdigit():
                current.pop()  # a file descriptor: 2>&1
            skip_next = True
        else:
            current.append(word)
    if current:
        yield current


def tinkergym_argv(words: list[str]) -> list[str] | None:
    """The arguments of ``tinkergym`` in a simple command, whichever way it is started; None for another program."""
    words = list(words)
    while words and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]) or words[0] in PREFIXES or
                     (words[0].startswith("-") and words[:1] != ["-m"])):
        words.pop(0)  # VAR=value, env/nohup/time..., and env's own options
    if not words:
        return None
    program = Path(words[0]).name
    if program == "tinkergym":
        return words[1:]
    if program.startswith("python") or program == "torchrun":  # python -m tinkergym, torchrun [its options] -m tinkergym
        for k in range(1, len(words) - 1):
            if words[k] == "-m":
                return words[k + 2:] if words[k + 1] == "tinkergym" else None
    return None


def command_lines(block: Block) -> list[CommandLine]:
    """Every ``tinkergym`` command in ``block`` (a bash block), also those inside ``$(...)`` and after ``&&``, ``|``, ``;``."""
    found: list[CommandLine] = []
    lines = block.code.splitlines()
    i = 0
    while i < len(lines):
        start, text = i, lines[i]
        while text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text[:-1] + " " + lines[i].strip()
        heredoc = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", text)
        if heredoc:  # a here-document's lines are data
            while i + 1 < len(lines) and lines[i + 1].strip() != heredoc.group(1):
                i += 1
            i += 1
        i += 1
        where = f"{block.page}:{block.line + 1 + start}"
        found += _commands_in(text, where)
    return found


def _commands_in(text: str, where: str) -> list[CommandLine]:
    flat, inner = _substitutions(text)
    comment = ""
    try:
        words = _words(flat)
    except ValueError as exc:  # unbalanced quotes
        return [CommandLine(where, text.strip(), ["<unparsable>"], f"the shell cannot read this line: {exc}")]
    if "#" in flat:
        match = re.search(r"(?:^|\s)#(.*)$", flat)
        comment = match.group(1).strip() if match else ""
    found = []
    words = [re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", DYNAMIC, word) for word in words]  # $VAR, ${VAR}
    for words_ in _simple_commands(words):
        argv = tinkergym_argv(words_)
        if argv is not None:
            found.append(CommandLine(where, text.strip(), argv, comment))
    for command in inner:
        found += _commands_in(command, where)
    return found


# ----- parsing a command line against the click tree ---------------------------------------------------------
def _stand_in(param: click.Parameter | None) -> str:
    """A value that ``param``'s type converts, for a word the shell would compute."""
    kind = param.type if param is not None else click.STRING
    if isinstance(kind, click.Choice):
        return str(kind.choices[0])
    if isinstance(kind, (click.IntRange, click.FloatRange)) and kind.min is not None:
        value = kind.min + (1 if kind.min_open else 0)
        return str(value)
    if isinstance(kind, click.types.IntParamType):
        return "1"
    if isinstance(kind, click.types.FloatParamType):
        return "1.0"
    if isinstance(kind, click.types.BoolParamType):
        return "true"
    return "x"


def _with_stand_ins(command: click.Command, args: list[str], ctx: click.Context) -> list[str]:
    """``args`` with each :data:`DYNAMIC` word that is an option's value of ``command`` replaced by a stand-in."""
    options = {opt: param for param in command.get_params(ctx) if isinstance(param, click.Option) for opt in param.opts + param.secondary_opts}
    out = list(args)
    for k, word in enumerate(out):
        if DYNAMIC not in word:
            continue
        if k and out[k - 1] in options and not options[out[k - 1]].is_flag:
            out[k] = _stand_in(options[out[k - 1]])
        elif word.startswith("--") and "=" in word and word.split("=", 1)[0] in options:
            out[k] = word.split("=", 1)[0] + "=" + _stand_in(options[word.split("=", 1)[0]])
    return out


@contextlib.contextmanager
def _paths_need_not_exist(root: click.Command) -> Iterator[None]:
    """Every path option of the tree accepts a path that does not exist yet (an example's files come from the steps
    before it, or from the reader's machine); everything else about a value is checked as usual."""
    saved: list[tuple[click.Path, bool]] = []

    def walk(command: click.Command) -> None:
        for param in command.params:
            if isinstance(param.type, click.Path):
                saved.append((param.type, param.type.exists))
                param.type.exists = False
        if isinstance(command, click.Group):
            for sub in command.commands.values():
                walk(sub)

    walk(root)
    try:
        yield
    finally:
        for kind, exists in saved:
            kind.exists = exists


def parse_error(argv: list[str], root: click.Command, prog: str = "tinkergym") -> str | None:
    """Why click would refuse ``tinkergym ARGV`` (a missing command, an unknown option, a value that does not convert),
    or None when it parses. Nothing is invoked; ``--help`` and ``--version`` parse."""
    with _paths_need_not_exist(root), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            command, name, args, parent = root, prog, list(argv), None
            while True:
                probe = click.Context(command, info_name=name, parent=parent)
                ctx = command.make_context(name, _with_stand_ins(command, args, probe), parent=parent, resilient_parsing=False)
                if not isinstance(command, click.Group):
                    return None
                rest = [*ctx._protected_args, *ctx.args]
                if not rest:
                    if command.invoke_without_command:
                        return None
                    return f"{' '.join(ctx.command_path.split())} needs a command: one of {', '.join(sorted(command.commands))}"
                name, sub, args = command.resolve_command(ctx, rest)
                if sub is None or name is None:
                    return f"no such command {rest[0]!r} in {ctx.command_path}"
                command, parent = sub, ctx
        except click.exceptions.Exit as exc:
            return None if exc.exit_code == 0 else f"exits {exc.exit_code}"
        except click.ClickException as exc:
            shown = exc.format_message()
            if DYNAMIC in shown or "'x'" in shown:
                return None  # a computed word whose stand-in did not convert: not the page's fault
            return f"{type(exc).__name__}: {shown}"


# ----- running ----------------------------------------------------------------------------------------------
PYTHON_DRIVER = """
import json, sys
namespace = {"__name__": "__main__"}
for block in json.load(open(sys.argv[1], encoding="utf-8")):
    code = "\\n" * block["line"] + block["code"]  # the page's line numbers in tracebacks
    exec(compile(code, block["path"], "exec"), namespace)
"""


def example_env(cache: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment an example runs in: offline, tinkergym's cache in ``cache``, the venv's ``bin`` first on PATH."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.update({
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TINKERGYM_CACHE": str(cache),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        "PYTHONUNBUFFERED": "1",
    })
    env.update(extra or {})
    return env


def python_chain(blocks: list[Block], block: Block) -> list[Block]:
    """``block`` and the python blocks it continues (``continue``), first to last."""
    chain = [block]
    index = blocks.index(block)
    while chain[0].continues:
        index -= 1
        while blocks[index].lang != "python":
            index -= 1
        chain.insert(0, blocks[index])
    return chain


#: Variables a shell sets for itself: never carried from one block to the next.
SHELL_OWN = {"_", "SHLVL", "PWD", "OLDPWD", "DOCS_EXAMPLE_ENV_OUT"}


@dataclass
class Background:
    """A background block's process group, where its output goes, and the ports it answers on."""

    block: Block
    process: subprocess.Popen[bytes]
    log: Path
    ports: list[int]

    def output(self) -> str:
        """The last 3000 characters the block printed (stdout and stderr together)."""
        return self.log.read_text(encoding="utf-8", errors="replace")[-3000:] if self.log.exists() else ""

    def stop(self) -> None:
        """SIGTERM to the whole group, SIGKILL to what is left after :data:`STOP_GRACE_S`."""
        for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break  # the group is empty
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(self.process):
                time.sleep(0.1)
            if not _group_alive(self.process):
                break
        self.process.wait(timeout=5)


def _group_alive(process: subprocess.Popen[bytes]) -> bool:
    process.poll()  # reap the leader, or its group seems alive forever
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    return True


@dataclass
class PageRun:
    """What the blocks of one page share as they run in order: their folder, the variables earlier bash blocks
    exported, the free ports that stand for the page's ports, and the servers of its background blocks."""

    folder: Path
    variables: dict[str, str] = field(default_factory=dict)
    ports: dict[int, int] = field(default_factory=dict)
    background: list[Background] = field(default_factory=list)
    broken: str | None = None  # a background block that did not become ready: the later blocks cannot run

    def code(self, block: Block) -> str:
        """``block``'s code with the page's ports moved to the free ones chosen for them."""
        code = block.code
        for port, free in self.ports.items():
            code = re.sub(rf"(--(?:[a-z]+-)*port[ =]|127\.0\.0\.1:|localhost:){port}\b", rf"\g<1>{free}", code)
        return code

    def stop(self) -> None:
        """Stop every background block's process group, the last started first."""
        while self.background:
            self.background.pop().stop()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _answers(port: int) -> bool:
    """Whether an HTTP server answers on 127.0.0.1:``port`` (any status: 401 and 404 are answers)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


def start_background(block: Block, run: PageRun, env: dict[str, str], timeout: float = READY_TIMEOUT_S) -> str | None:
    """Start a background block in a process group of its own and wait until its ports answer; what went wrong, or None.
    Its server stays in ``run.background`` until :meth:`PageRun.stop`."""
    ports = [block.background] if block.background else [int(port) for port in PORT_OPTION.findall(block.code)]
    for port in ports:
        run.ports.setdefault(port, _free_port())
    log = run.folder / f".background-{block.line}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(["bash", "-euo", "pipefail", "-c", run.code(block), block.where], cwd=run.folder,
                                   env={**env, **run.variables}, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    server = Background(block, process, log, [run.ports[port] for port in ports])
    run.background.append(server)
    deadline = time.monotonic() + timeout
    waiting = list(server.ports)
    while waiting:
        if process.poll() is not None:
            problem = f"{block.where}: the background example exited {process.returncode} before 127.0.0.1:{waiting[0]} answered"
            break
        if time.monotonic() > deadline:
            problem = f"{block.where}: the background example did not answer on 127.0.0.1:{waiting[0]} within {timeout:.0f} s"
            break
        if _answers(waiting[0]):
            waiting.pop(0)
        else:
            time.sleep(0.25)
    else:
        return None
    run.broken = block.where
    return f"{problem} (the page's port {next(p for p, f in run.ports.items() if f == waiting[0])})\n--- output\n{server.output()}"


def run_example(chain: list[Block], cwd: Path, env: dict[str, str], timeout: float = TIMEOUT_S, run: PageRun | None = None) -> str | None:
    """Run a bash block, or a python block with those it continues (``chain``), in ``cwd``; what went wrong, or None.
    With ``run`` (the page's :class:`PageRun`), the block sees what the page's earlier blocks exported and started, a
    bash block's exports are kept for the blocks after it, and a background block is started."""
    last = chain[-1]
    run = run or PageRun(cwd)
    if run.broken:
        return f"{last.where}: not run: the background example at {run.broken} did not start"
    env = {**env, **run.variables}
    if last.background is not None:
        return start_background(last, run, env)
    exported = None
    if last.lang == "python":
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, encoding="utf-8") as spec:
            json.dump([{"path": str(b.path), "line": b.line, "code": run.code(b)} for b in chain], spec)
        command = [sys.executable, "-c", PYTHON_DRIVER, spec.name]
    else:
        exported = cwd / ".exported-env"
        env["DOCS_EXAMPLE_ENV_OUT"] = str(exported)
        # on the block's first line, so the shell's line numbers are the block's
        command = ["bash", "-euo", "pipefail", "-c", 'trap \'env -0 > "$DOCS_EXAMPLE_ENV_OUT"\' EXIT; ' + run.code(last), last.where]
    try:
        done = subprocess.run(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return (f"{last.where}: the example ran past {timeout:.0f} s: make it smaller (fewer steps, episodes or envs; the tiny model), "
                f"or mark it <!-- docs-test: skip: REASON -->\n{output[-3000:]}")
    finally:
        if last.lang == "python":
            os.unlink(spec.name)
    if exported is not None and exported.exists():
        for item in exported.read_bytes().decode(errors="replace").split("\0"):
            name, sep, value = item.partition("=")
            if sep and name not in SHELL_OWN and env.get(name) != value:
                run.variables[name] = value
        exported.unlink()
    if done.returncode == 0:
        return None
    what = " (with the blocks it continues: " + ", ".join(b.where for b in chain[:-1]) + ")" if len(chain) > 1 else ""
    return f"{last.where}: the {last.lang} example{what} exited {done.returncode}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
