"""tinkergym: a Gym-compatible hub of text environments for training LLM agents with RL.

``import tinkergym`` registers every installed env id into Gymnasium's registry (and multi-agent ids into
PettingZoo's), reading package metadata only: no env package is imported until one of its envs is made.
"""

from tinkergym.aec import TextAECEnv
from tinkergym.core import TextEnv
from tinkergym.errors import InvalidAction, TinkergymError
from tinkergym.spaces import PrintableText
from tinkergym.registry import list_envs, make, make_aec, register_installed_envs, spec

__version__ = "0.1.0"

__all__ = [
    "InvalidAction",
    "PrintableText",
    "TextAECEnv",
    "TextEnv",
    "TinkergymError",
    "list_envs",
    "make",
    "make_aec",
    "spec",
]

register_installed_envs()
