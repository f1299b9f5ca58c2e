

def test_play_shows_the_image_as_a_mark_and_writes_json(tmp_path) -> None:
    """``tinkergym play`` prints an image observation's text with an ``[image HxW]`` mark, never the pixels, and its
    ``--jsonl`` transcript is JSON."""
    import json

    from click.testing import CliRunner

    from tinkergym.cli import main

    out = tmp_path / "t.jsonl"
    result = CliRunner().invoke(main, ["play", "tinker/ColourSquare-v0", "--agent", "baseline", "--seed", "0", "--jsonl", str(out)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "[image 64x64]\nWhich colour fills the square" in result.output and "array(" not in result.output
    record = json.loads(out.read_text().splitlines()[-1])
    assert record["first_observation"].startswith("[image 64x64]\n") and record["returns"]["agent"] == 1.0
