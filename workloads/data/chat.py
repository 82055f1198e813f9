"""Prompt/answer pairs -> tokens and loss mask, rendered with the tokenizer's own chat template.

The prompt is exactly what vLLM's chat endpoint feeds the model for one user message: the
template rendered with the generation prompt (for Gemma 4 with thinking off that ends in an empty
thought channel) and tokenized without extra special tokens, as `apply_chat_template` does. The
target is exactly what the model must produce after it: the model turn's text as the template
renders it in a conversation, up to and including the end-of-turn token (generation stops there,
so the newline the template writes after it is not part of the target).

Prompt and target are tokenized separately and concatenated. That equals tokenizing the whole
text because both pieces end in a special token (Gemma tokenizers add no prefix space); the
constructor checks this on a sample.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from workloads.common import errors

# Stands in for an answer when reading the shape of a model turn off the template.
_SENTINEL = "SENTINEL_ANSWER"
_PROBE_PROMPT = "Write a Verilog module."


@dataclasses.dataclass(frozen=True)
class Example:
    """One rendered training sample: `tokens[:prompt_len]` is the prompt, the rest the target."""

    tokens: np.ndarray  # int32 [length]
    prompt_len: int

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def loss_mask(self) -> np.ndarray:
        """int32 [length]: 1 on the target (model turn incl. end-of-turn), 0 on the prompt."""
        mask = np.zeros(len(self), np.int32)
        mask[self.prompt_len :] = 1
        return mask


class ChatFormat:
    """Renders (prompt, answer) pairs with a Hugging Face tokenizer's chat template.

    Raises (from the constructor):
        errors.UserError: the tokenizer has no chat template, or its template does not render a
            model turn as `<opening><answer><end-of-turn>...` after the same history the
            generation prompt extends.
    """

    def __init__(self, tokenizer: Any, *, end_of_turn: str | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise errors.UserError(
                "the tokenizer has no chat template (tokenizer_config.json / "
                "chat_template.jinja of the model directory)"
            )
        self.tokenizer = tokenizer
        self.end_of_turn = end_of_turn or getattr(tokenizer, "eot_token", None) or "<turn|>"
        self.control_tokens = control_tokens(tokenizer)
        self._control_pattern = re.compile("|".join(map(re.escape, self.control_tokens)))
        history = self._render([_user(_PROBE_PROMPT)], generation_prompt=False)
        turn = self._model_turn(_PROBE_PROMPT, _SENTINEL, history)
        if turn.count(_SENTINEL) != 1:
            raise errors.UserError("the chat template does not render the assistant text verbatim")
        self.turn_opening, trailer = turn.split(_SENTINEL)
        if self.end_of_turn not in trailer:
            raise errors.UserError(
                f"the chat template ends a model turn with {trailer!r}, which "
                f"lacks the end-of-turn token {self.end_of_turn!r}"
            )
        self.turn_trailer = trailer
        self.target_suffix = trailer[: trailer.index(self.end_of_turn) + len(self.end_of_turn)]
        # Tokens of an empty model turn: a target this long shows nothing of its answer.
        self.empty_target_len = len(self._encode([self.target_suffix])[0])
        generation = self._render([_user(_PROBE_PROMPT)], generation_prompt=True)
        if not generation.startswith(history + self.turn_opening):
            raise errors.UserError(
                "the chat template's generation prompt does not open the model "
                f"turn it renders in a conversation ({self.turn_opening!r})"
            )
        # Whatever the generation prompt adds after the turn opening (Gemma 4: the empty thought
        # channel) is part of the prompt, not of the target.
        self.generation_extra = generation[len(history) + len(self.turn_opening) :]
        probe = self.render(_PROBE_PROMPT, _SENTINEL)
        text = self.prompt_text(_PROBE_PROMPT) + self.target_text(_PROBE_PROMPT, _SENTINEL)
        if list(probe.tokens) != self._encode([text])[0]:
            raise errors.UserError(
                "tokenizing prompt and target separately differs from "
                "tokenizing them together; cannot place the loss mask"
            )

    def _render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        )

    def _model_turn(self, prompt: str, answer: str, history: str) -> str:
        conversation = self._render([_user(prompt), _assistant(answer)], generation_prompt=False)
        if not conversation.startswith(history):
            raise errors.UserError(
                "the chat template renders the user turn differently when a "
                "model turn follows; cannot split prompt and target"
            )
        return conversation[len(history) :]

    def find_control_token(self, text: str) -> str | None:
        """The first control token (`<bos>`, `<|turn>`, `<turn|>`, ...) written in `text`, or
        None. The tokenizer turns such a string into the control token itself, so a prompt or an
        answer holding one would open or close turns of the conversation it is trained as."""
        if not self.control_tokens:
            return None
        found = self._control_pattern.search(text)
        return found.group(0) if found else None

    def prompt_text(self, prompt: str) -> str:
        """What the chat endpoint renders for one user message (with the generation prompt)."""
        return self._render([_user(prompt)], generation_prompt=True)

    def target_text(self, prompt: str, answer: str) -> str:
        """The model turn the template renders for `answer`, from after the turn opening up to
        and including the end-of-turn token."""
        history = self._render([_user(prompt)], generation_prompt=False)
        turn = self._model_turn(prompt, answer, history)
        if not (turn.startswith(self.turn_opening) and turn.endswith(self.turn_trailer)):
            raise errors.UserError(f"unexpected model turn from the chat template: {turn[:80]!r}")
        body = turn[len(self.turn_opening) : len(turn) - len(self.turn_trailer)]
        return body + self.target_suffix

    def _encode(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        return [
            list(ids) for ids in self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        ]

    def render(self, prompt: str, answer: str) -> Example:
        """Tokens and prompt length of one (prompt, answer) pair."""
        return self.render_many([(prompt, answer)])[0]

    def render_many(self, pairs: Iterable[tuple[str, str]]) -> list[Example]:
        """Renders pairs; tokenization is batched."""
        pairs = list(pairs)
        prompts = self._encode([self.prompt_text(p) for p, _ in pairs])
        targets = self._encode([self.target_text(p, a) for p, a in pairs])
        return [
            Example(np.asarray(p + t, dtype=np.int32), len(p))
            for p, t in zip(prompts, targets, strict=True)
        ]


def control_tokens(tokenizer: Any) -> tuple[str, ...]:
    """The special tokens of a Hugging Face tokenizer (named ones and added ones marked special),
    longest first so that a search takes `<|tool_response>` whole rather than a shorter token."""
    found = set(getattr(tokenizer, "all_special_tokens", ()) or ())
    for added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False):
            found.add(str(added.content))
    return tuple(sorted((t for t in found if t), key=lambda t: (-len(t), t)))


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}
