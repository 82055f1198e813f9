"""`python -m localcloud rehearse`'s bad arguments: one line each, exit status 2, nothing booted."""

from __future__ import annotations

import pytest

from localcloud import rehearse


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--workdir", "{file}"], "--workdir {file}: cannot be a directory (File exists)"),
        (["--weights-seconds", "-1"], "--weights-seconds -1: must be 0 (off) or more"),
    ],
)
def test_a_bad_argument_is_one_line_and_exit_status_2(tmp_path, capsys, args, line):
    file = tmp_path / "a-file"
    file.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        rehearse.main([a.format(file=file) for a in args])
    assert exit_info.value.code == 2
    errors = [e for e in capsys.readouterr().err.splitlines() if "error:" in e]
    assert errors == [f"python -m localcloud rehearse: error: {line.format(file=file)}"]
