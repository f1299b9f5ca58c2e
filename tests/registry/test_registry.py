"""The hub: discovery from metadata, lazy imports, registration and its error messages."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import gymnasium as gym
import pytest

import tinkergym
from click.testing import CliRunner

from tinkergym.cli import main
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
    with pytest.raises(UnknownEnvError, match=r"install it with: pip install tinkergym-fakeworld") as caught:
        tinkergym.spec("tinker/FakeWorld-v0")
    assert "Did you mean" not in str(caught.value)  # never the id that was typed
    with pytest.raises(UnknownEnvError, match="Did you mean: tinker/FakeWorld-v0"):
        tinkergym.spec("tinker/FakeWrld-v0")


def test_a_missing_namespace_says_what_to_check(monkeypatch) -> None:
    """No tinker/ id installed where this Python looks (the env packages are elsewhere, or `import tinkergym` is not the
    installed package): the message says which package Python imports and that a local folder may shadow it."""
    monkeypatch.setattr(hub, "list_envs", lambda refresh=False: [])
    message = hub.unknown_env_message("tinker/Bandit-v0")
    root = Path(tinkergym.__file__).resolve().parents[1]  # this clone: its own folder, then the name it will have
    assert f"install it with: pip install -e {root / 'env_packages' / 'bandit'} (from this clone; once published: pip install tinkergym-bandit)" in message
    assert "No env package of the tinker/ namespace is installed" in message
    assert 'python -c "import tinkergym; print(tinkergym.__file__, list(tinkergym.__path__))"' in message
    assert "A folder named tinkergym (or a tinkergym.py) beside the script is imported instead" in message
    assert "namespace" not in hub.unknown_env_message("nowhere/Thing-v0")  # a namespace the hub knows nothing of: no such advice


def test_a_folder_named_tinkergym_that_would_shadow_the_package_is_found(tmp_path, monkeypatch) -> None:
    from tinkergym.registry.shadowing import PACKAGE_DIR, shadow_note, shadowing_path

    project = tmp_path / "project"
    (project / "tinkergym").mkdir(parents=True)
    installed = tmp_path / "site"
    (installed / "tinkergym").mkdir(parents=True)
    (installed / "tinkergym" / "__init__.py").write_text("")
    monkeypatch.setattr(sys, "path", [str(project), str(installed)])
    assert shadowing_path(project) is None  # a folder without __init__.py loses to a package installed on the path
    monkeypatch.setattr(sys, "path", [str(project)])
    assert shadowing_path(project) == project / "tinkergym"  # ... and wins over one an import hook provides (an editable install)
    (project / "tinkergym" / "__init__.py").write_text("")
    monkeypatch.setattr(sys, "path", [str(project), str(installed)])
    assert shadowing_path(project) == project / "tinkergym"  # a package wins wherever it comes first
    assert shadowing_path(PACKAGE_DIR.parent) is None and shadowing_path(tmp_path) is None  # the installed package; nothing
    assert "Namespace tinker not found" in shadow_note(project)
    monkeypatch.undo()
    monkeypatch.chdir(project)
    listed = CliRunner().invoke(main, ["envs", "list"])
    assert listed.exit_code == 0 and f"note: {project / 'tinkergym'} shadows the installed tinkergym package" in listed.stderr
    monkeypatch.chdir(tmp_path)
    assert "shadows" not in CliRunner().invoke(main, ["envs", "list"]).stderr


def test_two_packages_claiming_one_id_is_an_error_naming_both(fake_site) -> None:
    fake_site.add("fakeenv-one", {"fake/Twin-v0": "fakeenv_one:EchoEnv"})
    fake_site.add("fakeenv-two", {"fake/Twin-v0": "fakeenv_two:EchoEnv"}, version="2.0")
    with pytest.warns(TinkergymWarning, match="fakeenv-one 1.0.*fakeenv-two 2.0"):
        tinkergym.register_installed_envs(refresh=True)
    assert "fake/Twin-v0" not in gym.registry
    with pytest.raises(DuplicateEnvIdError, match=r"fakeenv-one.*fakeenv-two.*TINKERGYM_ENV_PROVIDERS='fake/Twin-v0=fakeenv-one'") as caught:
        tinkergym.make("fake/Twin-v0")
    assert "uninstall" not in str(caught.value), "neither package is wrong to have installed; the user chooses one"


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


# ----- broken packages are warnings; the rest of the hub keeps working ---------------------------
def _registered_ids() -> set[str]:
    return {s.id for s in tinkergym.list_envs()}


def _assert_rest_of_hub_works() -> None:
    assert tinkergym.make("fake/Echo-v0").reset()[0] == "say something"
    assert {"fake/Echo-v0", "tinker/Bandit-v0"} <= _registered_ids()
    result = CliRunner().invoke(main, ["envs", "list"])
    assert result.exit_code == 0, result.output
    assert "fake/Echo-v0" in result.output and "tinker/Bandit-v0" in result.output
    result = CliRunner().invoke(main, ["envs", "list", "--json"])
    assert result.exit_code == 0 and "fake/Echo-v0" in result.output


@pytest.mark.parametrize(
    "manifest, message",
    [
        ('["fake/Bad-v0"]\ndata = ["x"]\n', r"data = \['x'\] \(an array\); it must be text"),
        ('["fake/Bad-v0"]\nmax_episode_steps = "x"\n', r"max_episode_steps = 'x' \(a string\); it must be a whole number"),
        ('["fake/Bad-v0"]\nmax_episode_steps = 0\n', r"max_episode_steps = 0 .*at least 1"),
        ('["fake/Bad-v0"]\nagents = true\n', r"agents = True \(a boolean\)"),
        ('["fake/Bad-v0"]\nkind = ["env"]\n', r"kind = \['env'\] \(an array\); it must be one of"),
        ('["fake/Bad-v0"]\nkind = "parallel"\n', r"kind = 'parallel'"),
        ('["fake/Bad-v0"]\nsummary = {text = "x"}\n', r"summary = \{'text': 'x'\} \(a table\); it must be text"),
        ('["fake/Bad-v0"]\nbaseline = 5\n', r"baseline = 5 \(an integer\); it must be an entry point 'module:attr'"),
        ('["fake/Bad-v0"]\nbaseline = "not an entry point"\n', r"baseline = 'not an entry point'"),
        ('["fake/Bad-v0"]\nkwargs = 5\n', r"'kwargs' is not a manifest field"),
        ('["fake/Bad-v0"]\nentry_point = 5\n', r"'entry_point' is not a manifest field"),
        ('"fake/Bad-v0" = 5\n', r"\['fake/Bad-v0'\] must be a table of fields, got an integer"),
    ],
    ids=["data-array", "steps-string", "steps-zero", "agents-bool", "kind-array", "kind-unknown", "summary-table",
         "baseline-int", "baseline-text", "kwargs", "entry-point", "entry-not-table"],
)
def test_manifest_value_of_the_wrong_type_is_a_warning_naming_the_package(fake_site, manifest, message) -> None:
    fake_site.add("fakeenv-bad", {"fake/Bad-v0": "fakeenv_bad:EchoEnv", "fake/Good-v0": "fakeenv_bad:EchoEnv"}, manifest=manifest)
    fake_site.add("fakeenv-echo", {"fake/Echo-v0": "fakeenv_echo:EchoEnv"})
    with pytest.warns(TinkergymWarning, match=r"fakeenv-bad 1\.0: the manifest entry for 'fake/Bad-v0' is invalid.*" + message):
        tinkergym.register_installed_envs(refresh=True)
    assert "fake/Bad-v0" not in _registered_ids() and "fake/Bad-v0" not in gym.registry
    assert "fake/Good-v0" in _registered_ids(), "the package's other ids are still registered"
    _assert_rest_of_hub_works()


@pytest.mark.parametrize(
    "content, message",
    [(b'["fake/Bad-v0"]\nsummary = "caf\xe9"\n', "is not UTF-8 text"), (b"\xff\xfe[\x00", "is not UTF-8 text"), (b"this is = = not toml", "is not valid TOML")],
    ids=["latin-1", "utf-16", "not-toml"],
)
def test_unreadable_manifest_is_a_warning_and_its_ids_keep_default_metadata(fake_site, content, message) -> None:
    fake_site.add("fakeenv-bad", {"fake/Bad-v0": "fakeenv_bad:EchoEnv"}, manifest="")
    (fake_site.root / "fakeenv_bad" / "tinkergym_envs.toml").write_bytes(content)
    fake_site.add("fakeenv-echo", {"fake/Echo-v0": "fakeenv_echo:EchoEnv"})
    with pytest.warns(TinkergymWarning, match=f"fakeenv-bad 1.0: .*tinkergym_envs.toml {message}"):
        tinkergym.register_installed_envs(refresh=True)
    assert tinkergym.spec("fake/Bad-v0").summary == ""
    _assert_rest_of_hub_works()


def test_unreadable_entry_points_file_is_a_warning(fake_site) -> None:
    fake_site.add("fakeenv-garbled", {"fake/Garbled-v0": "fakeenv_garbled:EchoEnv"})
    (fake_site.root / "fakeenv_garbled-1.0.dist-info" / "entry_points.txt").write_bytes(b"[tinkergym.envs]\nfake/Garbled-v0 = fakeenv_garbled:Echo\xe9\n")
    fake_site.add("fakeenv-echo", {"fake/Echo-v0": "fakeenv_echo:EchoEnv"})
    with pytest.warns(TinkergymWarning, match=r"fakeenv_garbled-1\.0\.dist-info: cannot read its metadata"):
        tinkergym.register_installed_envs(refresh=True)
    _assert_rest_of_hub_works()


def test_unreadable_metadata_of_an_unrelated_distribution_stays_quiet(fake_site) -> None:
    info = fake_site.root / "unrelated-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_bytes(b"Metadata-Version: 2.1\nName: unrelated\nVersion: 1.0\nSummary: caf\xe9\n")
    (info / "entry_points.txt").write_bytes(b"[console_scripts]\nunrelated = unrelated:caf\xe9\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tinkergym.register_installed_envs(refresh=True)


# ----- ids that would replace other libraries' envs ----------------------------------------------
@pytest.mark.parametrize("env_id", ["Foo-v0", "CartPole-v1", "Pendulum"])
def test_id_without_namespace_is_refused(fake_site, env_id) -> None:
    fake_site.add("fakeenv-bare", {env_id: "fakeenv_bare:EchoEnv"})
    fake_site.add("fakeenv-echo", {"fake/Echo-v0": "fakeenv_echo:EchoEnv"})
    with pytest.warns(TinkergymWarning, match=f"fakeenv-bare 1.0: env id '{env_id}' has no namespace.*e.g. 'fakeenv_bare/{env_id}'"):
        tinkergym.register_installed_envs(refresh=True)
    assert env_id not in _registered_ids()
    assert gym.spec("CartPole-v1").entry_point == "gymnasium.envs.classic_control.cartpole:CartPoleEnv"
    _assert_rest_of_hub_works()


def test_gymnasium_keeps_cartpole_after_import_with_a_clobbering_package(fake_site) -> None:
    fake_site.add("fakeenv-cartpole", {"CartPole-v1": "fakeenv_cartpole:EchoEnv", "phys2d/CartPole-v1": "fakeenv_cartpole:EchoEnv"})
    fake_site.add("fakeenv-echo", {"fake/Echo-v0": "fakeenv_echo:EchoEnv"})
    code = (
        "import gymnasium as gym, tinkergym\n"
        "env = gym.make('CartPole-v1')\n"
        "assert type(env.unwrapped).__name__ == 'CartPoleEnv', env.unwrapped\n"
        "assert env.reset(seed=0)[0].shape == (4,)\n"
        "assert 'fakeenv_cartpole' not in gym.spec('phys2d/CartPole-v1').entry_point\n"
        "assert tinkergym.make('fake/Echo-v0').reset()[0] == 'say something'\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake_site.root), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert "fakeenv-cartpole 1.0: env id 'CartPole-v1' has no namespace" in out.stderr
    assert "fakeenv-cartpole 1.0: env id 'phys2d/CartPole-v1' is already in Gymnasium's registry" in out.stderr


def test_id_another_library_registered_is_refused(fake_site) -> None:
    gym.register("thirdparty/Thing-v0", entry_point="gymnasium.envs.classic_control.cartpole:CartPoleEnv")
    try:
        fake_site.add("fakeenv-thing", {"thirdparty/Thing-v0": "fakeenv_thing:EchoEnv"})
        fake_site.add("fakeenv-echo", {"fake/Echo-v0": "fakeenv_echo:EchoEnv"})
        with pytest.warns(TinkergymWarning, match=r"fakeenv-thing 1\.0: env id 'thirdparty/Thing-v0' is already in Gymnasium's registry.*Rename the id"):
            tinkergym.register_installed_envs(refresh=True)
        assert gym.spec("thirdparty/Thing-v0").entry_point.endswith("cartpole:CartPoleEnv")
        assert "thirdparty/Thing-v0" not in _registered_ids()
        _assert_rest_of_hub_works()
    finally:
        gym.registry.pop("thirdparty/Thing-v0", None)


def test_id_another_library_registered_in_pettingzoo_is_refused(fake_site) -> None:
    import pettingzoo

    if not getattr(pettingzoo, "aec_registry", None):
        pytest.skip("this PettingZoo has no registry (PettingZoo < 1.27)")
    taken = next(iter(pettingzoo.aec_registry))
    before = pettingzoo.aec_registry[taken]
    fake_site.add("fakeenv-duel", {taken: "fakeenv_duel:EchoEnv"}, manifest=f'["{taken}"]\nkind = "aec"\nagents = 2\n')
    with pytest.warns(TinkergymWarning, match=f"fakeenv-duel 1.0: env id '{taken}' is already in PettingZoo's registry"):
        tinkergym.register_installed_envs(refresh=True)
    assert pettingzoo.aec_registry[taken] is before


def test_the_hubs_own_ids_are_updated_quietly_after_an_upgrade(fake_site) -> None:
    fake_site.add("fakeenv-echo", {"fake/Echo-v0": "fakeenv_echo:EchoEnv"})
    tinkergym.register_installed_envs(refresh=True)
    assert gym.spec("fake/Echo-v0").entry_point == "fakeenv_echo:EchoEnv"
    info = fake_site.root / "fakeenv_echo-1.0.dist-info" / "entry_points.txt"
    info.write_text("[tinkergym.envs]\nfake/Echo-v0 = fakeenv_echo:TextEnv\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tinkergym.register_installed_envs(refresh=True)
    assert gym.spec("fake/Echo-v0").entry_point == "fakeenv_echo:TextEnv"


# ----- two packages claiming one id ---------------------------------------------------------------
def test_the_user_chooses_which_package_provides_a_contested_id(fake_site, monkeypatch) -> None:
    fake_site.add("fakeenv-one", {"fake/Twin-v0": "fakeenv_one:EchoEnv"})
    fake_site.add("fakeenv-two", {"fake/Twin-v0": "fakeenv_two:EchoEnv", "fake/Echo-v0": "fakeenv_two:EchoEnv"}, version="2.0")
    with pytest.warns(TinkergymWarning) as caught:
        tinkergym.register_installed_envs(refresh=True)
    message = " ".join(str(w.message) for w in caught)
    assert "fakeenv-one 1.0 (fakeenv_one:EchoEnv) and fakeenv-two 2.0 (fakeenv_two:EchoEnv)" in message
    assert "registers none of them" in message and "uninstall" not in message
    assert "fake/Echo-v0" in _registered_ids(), "the packages' other ids still work"

    monkeypatch.setenv("TINKERGYM_ENV_PROVIDERS", "other/Id-v0=x, fake/Twin-v0=FakeEnv_Two")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tinkergym.register_installed_envs(refresh=True)
    assert tinkergym.spec("fake/Twin-v0").distribution == "fakeenv-two"
    assert gym.spec("fake/Twin-v0").entry_point == "fakeenv_two:EchoEnv"
    assert "fakeenv_two" in type(tinkergym.make("fake/Twin-v0").unwrapped).__module__

    monkeypatch.setenv("TINKERGYM_ENV_PROVIDERS", "fake/Twin-v0=fakeenv-three")
    with pytest.warns(TinkergymWarning, match="chooses 'fakeenv-three' for it, which does not declare it"):
        tinkergym.register_installed_envs(refresh=True)
    assert "fake/Twin-v0" not in _registered_ids()
    _assert_rest_of_hub_works()
