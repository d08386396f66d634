"""Issue 53: the library's errors name a setting in the caller's spelling -- the Python keyword for a Python caller,
the option on the command line -- and a value put in a message (a path with braces) is shown as it is."""

from __future__ import annotations

import pytest

import edgeprune
from conftest import run_cli
from edgeprune.errors import UserError
from edgeprune.settings import SettingError


def test_an_image_size_error_says_img_size_to_python_and_the_option_on_the_command_line(tmp_path):
    with pytest.raises(UserError) as err:
        edgeprune.prune_run(tmp_path / "r", model_name="deit_tiny_patch16_224", random_init=True, img_size=225)
    assert str(err.value).startswith("img_size 225 is not a multiple of the patch size 16") and "--" not in str(err.value)
    res = run_cli(["prune", "--model", "deit_tiny_patch16_224", "--random-init", "--img-size", "225", "-o",
                   tmp_path / "r"])
    assert res.exit_code == 2 and "error: --img-size 225 is not a multiple of the patch size 16" in res.output


def test_an_existing_output_says_force_and_shows_a_path_with_braces_as_it_is(tmp_path):
    out = tmp_path / "a{force}b.onnx"
    out.write_bytes(b"")
    with pytest.raises(UserError) as err:
        edgeprune.export(out, model_name="deit_tiny_patch16_224", random_init=True)
    assert str(err.value) == f"{out} exists (use force to overwrite)"
    res = run_cli(["export", "--model", "deit_tiny_patch16_224", "--random-init", "-o", out])
    assert res.exit_code == 2 and f"error: {out} exists (use --force to overwrite)" in res.output


def test_literal_braces_are_never_placeholders():
    err = SettingError(f"{SettingError.literal('{x} {{y}}')} and {{img_size}}")
    assert err.settings == ("img_size",)
    assert err.render(lambda name: "--img-size") == "{x} {{y}} and --img-size"
