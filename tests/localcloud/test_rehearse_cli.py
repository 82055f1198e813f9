"""`python -m localcloud rehearse`'s bad arguments: one line each, exit status 2, nothing booted."""

from __future__ import annotations

import pytest

from localcloud import rehearse


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--workdir", "{file}"], "--workdir {file}: cannot be a directory (File exists)"),
        (
            ["--weights-seconds", "-1"],
            "--weights-seconds -1: a finite number of seconds, 0 (off) or more",
        ),
        (
            ["--weights-seconds", "nan"],
            "--weights-seconds nan: a finite number of seconds, 0 (off) or more",
        ),
        (
            ["--weights-seconds", "inf"],
            "--weights-seconds inf: a finite number of seconds, 0 (off) or more",
        ),
        (
            ["--stack", "nosuch"],
            "--stack nosuch: no Pulumi.nosuch.yaml in the checkout; its stacks are dev, prod",
        ),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_status_2(tmp_path, capsys, monkeypatch, args, line):
    def booted(*_args, **_kwargs):
        raise AssertionError("the rehearsal started")

    monkeypatch.setattr(rehearse, "run", booted)
    file = tmp_path / "a-file"
    file.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        rehearse.main([a.format(file=file) for a in args])
    assert exit_info.value.code == 2
    errors = [e for e in capsys.readouterr().err.splitlines() if "error:" in e]
    assert errors == [f"python -m localcloud rehearse: error: {line.format(file=file)}"]


def test_the_checked_in_stacks_are_known(tmp_path):
    assert rehearse.known_stacks() == ["dev", "prod"]
