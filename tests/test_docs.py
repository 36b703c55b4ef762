"""The README says what the code does: every S3Config field is in its table, every command it
shows exists."""

import dataclasses
import os
import re

from s3dcp import cli
from s3dcp.config import S3Config

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _readme() -> str:
    with open(README, encoding="utf-8") as f:
        return f.read()


def test_every_s3config_field_is_in_the_configuration_table():
    text = _readme()
    table = text[text.index("| field | default | what |"):]
    table = table[:table.index("\n\n")]
    named = set(re.findall(r"`([a-z_0-9]+)`", "\n".join(line.split("|")[1] for line in table.splitlines()[2:])))
    assert {f.name for f in dataclasses.fields(S3Config)} - named == set()
    assert named - {f.name for f in dataclasses.fields(S3Config)} == set()


def test_every_command_the_readme_shows_exists(capsys):
    shown = set(re.findall(r"^(?:eval \"\$\()?s3dcp ([a-z]+)", _readme(), flags=re.M))
    assert {"ls", "server", "mb", "gc"} <= shown
    for command in sorted(shown):
        assert cli.main([command, "--help"]) == 0, command
    capsys.readouterr()
