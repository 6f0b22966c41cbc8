"""The command's help and version, and the version's one source."""

from __future__ import annotations

import importlib.metadata

import pytest

import torch_distribute as td
from torch_distribute.cli import main


def test_version_flag_and_the_installed_metadata_agree(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"torch-distribute {td.__version__}"
    # setuptools reads the version from torch_distribute.__version__ (pyproject's dynamic version)
    assert importlib.metadata.version("torch-distribute") == td.__version__


@pytest.mark.parametrize("command", [["devices"], ["version"], ["checkpoint"], ["checkpoint", "convert"]])
def test_every_subcommand_has_a_description(command, capsys):
    with pytest.raises(SystemExit):
        main([*command, "-h"])
    help_text = capsys.readouterr().out
    description = help_text.split("\n\n")[1]
    assert not description.startswith(("positional", "options")) and len(description) > 40, help_text
