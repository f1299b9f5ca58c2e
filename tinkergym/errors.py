"""One exception hierarchy for tinkergym.

Category classes also inherit the matching builtin, so ``except ValueError`` keeps working for callers
that do not know tinkergym. Every message says what to do next.
"""

from __future__ import annotations


class TinkergymError(Exception):
    """Base class of every error tinkergym raises on purpose."""


class ConfigError(TinkergymError, ValueError):
    """A bad argument, option or configuration value."""


class UnknownEnvError(TinkergymError, KeyError):
    """An env id that no installed package provides."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class DuplicateEnvIdError(TinkergymError, RuntimeError):
    """Two installed distributions declare the same env id."""


class EnvPackageImportError(TinkergymError, ImportError):
    """An env package is installed but its module failed to import."""


class EnvKindError(TinkergymError, TypeError):
    """A single-agent id was used where a multi-agent one is needed, or the other way round."""


class NonFiniteError(TinkergymError, FloatingPointError):
    """The model produced NaN or infinite values (weights, logits or gradients): training has diverged."""


class OutOfMemoryError(TinkergymError, MemoryError):
    """A pass needed more device memory than there is; the message says which setting lowers it."""


class CheckFailed(TinkergymError, AssertionError):
    """A conformance check found an env that breaks the text-env contract."""


class ScaffoldError(TinkergymError, ValueError):
    """``tinkergym envs new`` cannot create the requested package."""


class SandboxUnavailableError(TinkergymError, RuntimeError):
    """Untrusted code cannot run here under real isolation (bubblewrap missing, user namespaces refused)."""


class EnvUnavailableError(TinkergymError, RuntimeError):
    """An installed env that cannot be made on this machine: data it needs is not installed, and an env never
    downloads while it is made. The message says how to install what is missing. Hub-wide commands (``play --all``,
    ``envs check --all``) report such an env as skipped, not failed."""


class InvalidAction(TinkergymError, ValueError):
    """Raised by an env's own step logic for a bad action.

    The env base classes catch it and turn it into an observation that says what was wrong, with the
    env's documented penalty: it never reaches the caller of ``step``.
    """


class TinkergymWarning(UserWarning):
    """A problem that does not stop the hub (a broken plugin, an ignored option)."""
