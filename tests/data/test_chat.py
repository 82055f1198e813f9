"""Rendering with the chat template: prompt == what the chat endpoint renders, loss mask == the
model turn exactly (answer + end-of-turn), nothing of the prompt."""

import numpy as np
import pytest

from workloads.common import errors
from workloads.data import chat

PROMPT = "Write a Verilog module named wide_lane that adds two 8-bit inputs a and b."
ANSWER = (
    "```verilog\nmodule wide_lane (\n    input [7:0] a,\n    input [7:0] b,\n"
    "    output [7:0] sum\n);\n    assign sum = a + b;\nendmodule\n```"
)


@pytest.fixture(scope="module")
def fmt(tiny_tokenizer):
    return chat.ChatFormat(tiny_tokenizer)


def test_prompt_tokens_are_what_apply_chat_template_gives(fmt, tiny_tokenizer):
    example = fmt.render(PROMPT, ANSWER)
    expected = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True
    )["input_ids"]
    assert list(example.tokens[: example.prompt_len]) == list(expected)
    assert tiny_tokenizer.decode(example.tokens[: example.prompt_len]) == (
        f"<bos><|turn>user\n{PROMPT}<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    )


def test_masked_tokens_are_exactly_the_model_turn(fmt, tiny_tokenizer):
    example = fmt.render(PROMPT, ANSWER)
    mask = example.loss_mask
    assert mask.dtype == np.int32 and mask.shape == example.tokens.shape
    masked = example.tokens[mask == 1]
    unmasked = example.tokens[mask == 0]
    assert tiny_tokenizer.decode(masked) == ANSWER + "<turn|>"
    assert masked[-1] == tiny_tokenizer.convert_tokens_to_ids("<turn|>")
    assert tiny_tokenizer.decode(unmasked) == fmt.prompt_text(PROMPT)
    # The mask is one block at the end: prompt first, then the whole target.
    assert list(mask) == [0] * example.prompt_len + [1] * (len(example) - example.prompt_len)


def test_target_is_the_model_turn_of_the_conversation(fmt, tiny_tokenizer):
    conversation = tiny_tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": ANSWER}],
        tokenize=False,
    )
    target = fmt.target_text(PROMPT, ANSWER)
    assert conversation.endswith("<|turn>model\n" + target + "\n")
    # Serving renders the prompt, the model produces the target: together the full sequence.
    whole = tiny_tokenizer(fmt.prompt_text(PROMPT) + target, add_special_tokens=False)
    assert list(fmt.render(PROMPT, ANSWER).tokens) == whole["input_ids"]


def test_target_follows_the_template_for_untrimmed_answers(fmt, tiny_tokenizer):
    example = fmt.render(PROMPT, f"\n  {ANSWER}  \n")
    assert tiny_tokenizer.decode(example.tokens[example.loss_mask == 1]) == ANSWER + "<turn|>"


def test_render_many_equals_render(fmt):
    pairs = [(PROMPT, ANSWER), ("Another request.", "```verilog\nmodule x;\nendmodule\n```")]
    for batched, (prompt, answer) in zip(fmt.render_many(pairs), pairs, strict=True):
        single = fmt.render(prompt, answer)
        assert batched.prompt_len == single.prompt_len
        assert np.array_equal(batched.tokens, single.tokens)


def test_template_structure_read_off_the_tokenizer(fmt):
    assert fmt.turn_opening == "<|turn>model\n"
    assert fmt.turn_trailer == "<turn|>\n"
    assert fmt.target_suffix == "<turn|>"
    assert fmt.generation_extra == "<|channel>thought\n<channel|>"


def test_tokenizer_without_chat_template_is_a_user_error(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    bare = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    bare.chat_template = None
    with pytest.raises(errors.UserError, match="no chat template"):
        chat.ChatFormat(bare)
