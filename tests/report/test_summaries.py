"""train_summary.json as the report reads it: junk is one line naming the file, key and value."""

import json
import math

import pytest

from tests.report.test_command import summaries  # noqa: F401 - the fixture
from workloads import cli
from workloads.common import errors
from workloads.report import summaries as summaries_lib

GOOD = {"steps": 10, "wall_seconds": 60.0, "real_tokens": 5000, "tokens_per_second": 83.3}


def test_a_real_summary_passes_through_unchanged():
    data = {**GOOD, "accelerator": "v5p-8", "data": {"kept": 3}}
    assert summaries_lib.check_train_summary(data, "s.json") is data


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ([1, 2], "s.json: expected a JSON object (train_summary.json of workloads train), got"),
        ({"loss": 1}, "s.json: not a train summary the report can use: steps: missing: required"),
        ({**GOOD, "wall_seconds": "3h"}, "wall_seconds: '3h': Input should be a valid number"),
        ({**GOOD, "tokens_per_second": -1.0}, "tokens_per_second: -1.0: Input should be greater"),
        ({**GOOD, "wall_seconds": math.nan}, "wall_seconds: nan: Input should be a finite number"),
        ({**GOOD, "real_tokens": True}, "real_tokens: True: a whole number, not true/false"),
        ({**GOOD, "segments": 0}, "segments: 0: Input should be greater than 0"),
        ({**GOOD, "accelerator": 5}, "accelerator: 5: Input should be a valid string"),
    ],
)
def test_junk_is_one_line_naming_key_and_value(data, expected):
    with pytest.raises(errors.UserError) as info:
        summaries_lib.check_train_summary(data, "s.json")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("s.json: ")
    assert expected in message


def test_report_refuses_a_junk_summary_with_one_line(summaries, tmp_path, capsys):  # noqa: F811
    summaries["train"].write_text(json.dumps({"steps": "many", "wall_seconds": -3}))
    out = tmp_path / "report"
    assert cli.main(["report", "--train-summary", str(summaries["train"]), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"error: {summaries['train']}: not a train summary the report can use: ")
    assert "steps: 'many'" in err and "wall_seconds: -3" in err
    assert not out.exists()  # nothing drawn from it
