"""The hub: discovery from metadata, lazy imports, registration and its error messages."""

from __future__ import annotations

import subprocess
import sys
import warnings

import gymnasium as gym
import pytest

import tinkergym
from tinkergym.errors import DuplicateEnvIdError, EnvKindError, EnvPackageImportError, TinkergymWarning, UnknownEnvError
from tinkergym.registry import hub

MANIFEST = """
["fake/Echo-v0"]
kind = "env"
data = "free"
turns = "multi"
agents = 1
summary = "echo"
max_episode_steps = 2
"""


def test_listing_and_registering_reads_metadata_only(fake_site) -> None:
    fake_site.add("fakeenv-echo", {"fake/Echo-v0": "fakeenv_echo:EchoEnv"}, manifest=MANIFEST)
    found = tinkergym.register_installed_envs(refresh=True)
    s = found.specs["fake/Echo-v0"]
    assert (s.distribution, s.version, s.turns, s.summary, s.max_episode_steps) == ("fakeenv-echo", "1.0", "multi", "echo", 2)
    assert "fake/Echo-v0" in gym.registry
    assert "fakeenv_echo" not in sys.modules, "listing or registering must not import the env package"
    env = gym.make("fake/Echo-v0")
    assert "fakeenv_echo" in sys.modules
    env.reset(seed=0)
    env.step("a")
    assert env.step("win")[3] is True, "max_episode_steps from the manifest becomes a TimeLimit"


def test_tinkergym_make_wraps_gym_make(fake_site) -> None:
    fake_site.add("fakeenv-echo", {"fake/Echo-v0": "fakeenv_echo:EchoEnv"})
    env = tinkergym.make("fake/Echo-v0")
    assert env.reset(seed=1)[0] == "say something"
    with pytest.raises(EnvKindError, match=r"single-agent env; make it with: tinkergym.make\('fake/Echo-v0'\)"):
        tinkergym.make_aec("fake/Echo-v0")


def test_unknown_id_suggests_close_matches_and_the_package() -> None:
    with pytest.raises(UnknownEnvError) as caught:
        tinkergym.make("tinker/Bandit-v1")
    assert "Did you mean: tinker/Bandit-v0" in str(caught.value)
    with pytest.raises(UnknownEnvError, match="Did you mean: tinker/Gomoku-v0"):
        tinkergym.make("tinker/gomoku-v0")


def test_uninstalled_known_id_names_the_pip_install(fake_site, monkeypatch) -> None:
    monkeypatch.setitem(hub.known_packages(), "tinkergym-fakeworld", {"ids": ["tinker/FakeWorld-v0"]})
    with pytest.raises(UnknownEnvError, match=r"install it with: pip install tinkergym-fakeworld"):
        tinkergym.spec("tinker/FakeWorld-v0")
    with pytest.raises(UnknownEnvError, match="Did you mean: tinker/FakeWorld-v0"):
        tinkergym.spec("tinker/FakeWrld-v0")


def test_two_packages_claiming_one_id_is_an_error_naming_both(fake_site) -> None:
    fake_site.add("fakeenv-one", {"fake/Twin-v0": "fakeenv_one:EchoEnv"})
    fake_site.add("fakeenv-two", {"fake/Twin-v0": "fakeenv_two:EchoEnv"}, version="2.0")
    with pytest.warns(TinkergymWarning, match="fakeenv-one 1.0.*fakeenv-two 2.0"):
        tinkergym.register_installed_envs(refresh=True)
    assert "fake/Twin-v0" not in gym.registry
    with pytest.raises(DuplicateEnvIdError, match=r"fakeenv-one.*fakeenv-two.*pip uninstall"):
        tinkergym.make("fake/Twin-v0")


def test_a_broken_package_is_named_and_the_rest_keeps_working(fake_site) -> None:
    fake_site.add("fakeenv-broken", {"fake/Broken-v0": "fakeenv_broken:EchoEnv"}, module_code="raise RuntimeError('boom')\n")
    fake_site.add("fakeenv-bad-manifest", {"fake/Manifest-v0": "fakeenv_badmanifest:EchoEnv"}, manifest="this is = = not toml")
    fake_site.add("fakeenv-echo", {"fake/Echo-v0": "fakeenv_echo:EchoEnv"})
    with pytest.warns(TinkergymWarning, match="fakeenv-bad-manifest 1.0.*not valid TOML"):
        tinkergym.register_installed_envs(refresh=True)
    with pytest.raises(EnvPackageImportError, match=r"fakeenv-broken is installed but importing 'fakeenv_broken' failed: RuntimeError: boom"):
        tinkergym.make("fake/Broken-v0")
    assert tinkergym.make("fake/Echo-v0").reset()[0] == "say something"
    assert tinkergym.make("fake/Manifest-v0").reset()[0] == "say something"
    assert {"fake/Broken-v0", "fake/Echo-v0", "fake/Manifest-v0"} <= {s.id for s in tinkergym.list_envs()}


def test_malformed_entry_point_is_a_warning(fake_site) -> None:
    fake_site.add("fakeenv-malformed", {"fake/Bad-v0": "not a module path"})
    with pytest.warns(TinkergymWarning, match="fakeenv-malformed.*malformed"):
        tinkergym.register_installed_envs(refresh=True)
    assert "fake/Bad-v0" not in {s.id for s in tinkergym.list_envs()}


def test_aec_ids_go_to_pettingzoo_registry(fake_site) -> None:
    import pettingzoo

    fake_site.add(
        "fakeenv-duel",
        {"fake/Duel-v0": "fakeenv_duel:EchoEnv"},
        manifest='["fake/Duel-v0"]\nkind = "aec"\nagents = 2\n',
    )
    tinkergym.register_installed_envs(refresh=True)
    assert "fake/Duel-v0" not in gym.registry
    assert "fake/Duel-v0" in pettingzoo.aec_registry
    with pytest.raises(EnvKindError, match="make_aec"):
        tinkergym.make("fake/Duel-v0")
    pettingzoo.aec_registry.pop("fake/Duel-v0")


def test_module_prefixed_id_works_with_no_prior_import() -> None:
    code = (
        "import sys, gymnasium as gym\n"
        "env = gym.make('tinkergym:tinker/Bandit-v0')\n"
        "obs, info = env.reset(seed=0)\n"
        "assert 'arms' in obs and 'torch' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_import_is_quiet_when_nothing_is_broken() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tinkergym.register_installed_envs(refresh=True)
