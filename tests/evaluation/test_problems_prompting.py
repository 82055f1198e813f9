"""Loading a dataset_spec-to-rtl directory and the official spec-to-rtl prompt."""

import pathlib
import shutil

import pytest

from workloads.common import errors
from workloads.evaluation import problems, prompting


def test_loads_official_layout(problems_dir):
    loaded = problems.load(problems_dir)
    assert [p.name for p in loaded] == ["Prob001_majority3", "Prob002_count16", "Prob003_delay3"]
    assert [p.number for p in loaded] == [1, 2, 3]
    assert "module named TopModule" in loaded[0].prompt
    assert loaded[1].test_path.endswith("Prob002_count16_test.sv")
    assert loaded[1].ref_path.endswith("Prob002_count16_ref.sv")


def test_only_and_limit(problems_dir):
    assert [p.name for p in problems.load(problems_dir, only="count|delay")] == [
        "Prob002_count16",
        "Prob003_delay3",
    ]
    assert len(problems.load(problems_dir, limit=1)) == 1


def test_incomplete_and_empty_directories_are_user_errors(problems_dir, tmp_path):
    shutil.copytree(problems_dir, tmp_path / "d")
    (tmp_path / "d" / "Prob002_count16_ref.sv").unlink()
    with pytest.raises(
        errors.UserError, match=r"Prob002_count16 \(missing Prob002_count16_ref\.sv\)"
    ):
        problems.load(str(tmp_path / "d"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(errors.UserError, match="no ProbNNN"):
        problems.load(str(tmp_path / "empty"))
    with pytest.raises(errors.UserError, match="directory not found"):
        problems.load(str(tmp_path / "missing"))


def test_prompt_is_verilog_eval_spec_to_rtl(problems_dir):
    spec = pathlib.Path(problems_dir, "Prob001_majority3_prompt.txt").read_text()
    user = prompting.user_prompt(spec)
    assert user == (
        "\nQuestion:\n" + spec.strip() + "\n\n"
        "Enclose your code with [BEGIN] and [DONE]. Only output the code snippet\n"
        "and do NOT output anything else.\n"
        "\nAnswer:\n"
    )
    msgs = prompting.messages(spec)
    assert msgs == [
        {"role": "system", "content": prompting.SYSTEM_MESSAGE},
        {"role": "user", "content": user},
    ]
    folded = prompting.messages(spec, "user")
    assert len(folded) == 1 and folded[0]["content"].startswith(
        prompting.SYSTEM_MESSAGE + "\n\nQuestion:"
    )
    assert prompting.messages(spec, "none") == [{"role": "user", "content": user}]
    with pytest.raises(ValueError):
        prompting.messages(spec, "assistant")  # type: ignore[arg-type]


def test_the_served_prompt_is_the_training_prompt_layout(problems_dir, tiny_tokenizer):
    """vLLM's chat endpoint renders our messages with the model directory's chat template, the
    one training rendered its samples with (workloads/data/chat.py): the user turn, then the
    model turn opened with thinking off, exactly as in training; the official system message
    is one system turn in front of it."""
    from workloads.data import chat

    spec = pathlib.Path(problems_dir, "Prob001_majority3_prompt.txt").read_text()
    training = chat.ChatFormat(tiny_tokenizer).prompt_text(prompting.user_prompt(spec))

    def served(mode):
        return tiny_tokenizer.apply_chat_template(
            prompting.messages(spec, mode), tokenize=False, add_generation_prompt=True
        )

    assert served("none") == training
    assert training.startswith("<bos><|turn>user\nQuestion:\n")
    assert training.endswith("\n\nAnswer:<turn|>\n<|turn>model\n<|channel>thought\n<channel|>")
    system_turn = f"<|turn>system\n{prompting.SYSTEM_MESSAGE}<turn|>\n"
    assert served("system") == "<bos>" + system_turn + training.removeprefix("<bos>")
    assert served("user").endswith(training.split("Question:", 1)[1])
