"""Served as trained: vLLM's greedy tokens equal the training code's LoRA model's.

The merge has its own checks (shards, checksums, logits of the merged model in JAX). This one
closes the chain at the other end: the model vLLM loaded from the merged directory, asked for
greedy continuations of a few prompts, must produce token for token what the project's own LoRA
model (tunix + the run's adapters, before any merge) produces. A wrong weight mapping, a config
vLLM reads differently (head sizes, k_eq_v, RoPE, soft-capping), or a tokenizer mismatch shows up
as a different token. Both sides run in float32 (vLLM's CPU default is bf16, whose rounding
alone changes greedy decodes of a random model: serve with `--dtype float32`).
"""

from __future__ import annotations

import dataclasses
import http.client
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from workloads.common import errors
from workloads.evaluation import sampling

# Prompts of Verilog-ish text, tokenized by the model's own tokenizer; short, so a CPU decodes
# them in seconds.
PROMPTS = (
    "module TopModule(input a, input b, output y);",
    "Implement a 4-bit counter with a synchronous reset.",
    "always @(posedge clk) begin",
    "The output is 1 when at least two inputs are 1.",
)
NEW_TOKENS = 8
# Total deadline of one request to the server: a CPU engine decodes NEW_TOKENS in seconds.
SERVED_TIMEOUT_S = 120.0


class ParityError(errors.UserError):
    """The server could not be asked (not a mismatch: that is a ParityResult)."""


@dataclasses.dataclass(frozen=True)
class ParityResult:
    """Greedy continuations of the same prompts from both models.

    Attributes:
        prompts: the prompt token ids.
        trained: the LoRA model's continuation of each prompt.
        served: the server's continuation of each prompt.
    """

    prompts: tuple[tuple[int, ...], ...]
    trained: tuple[tuple[int, ...], ...]
    served: tuple[tuple[int, ...], ...]

    @property
    def ok(self) -> bool:
        return self.trained == self.served

    @property
    def tokens(self) -> int:
        return sum(len(t) for t in self.trained)

    def summary(self) -> str:
        if self.ok:
            return (
                f"passed: {len(self.prompts)} prompts x {NEW_TOKENS} greedy tokens, the served "
                "model's tokens equal the LoRA model's (before the merge) one for one"
            )
        pairs = zip(self.trained, self.served, strict=True)
        first = next(i for i, (a, b) in enumerate(pairs) if a != b)
        return (
            f"FAILED: prompt {first} {list(self.prompts[first])}: LoRA model "
            f"{list(self.trained[first])}, served {list(self.served[first])}"
        )


def prompt_ids(model_dir: str) -> list[list[int]]:
    """PROMPTS as token ids from the model's own tokenizer (BOS first, as vLLM would add it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [list(tokenizer(text)["input_ids"]) for text in PROMPTS]


def greedy(
    model: Any, mesh: Any, prompts: Sequence[Sequence[int]], new_tokens: int = NEW_TOKENS
) -> list[list[int]]:
    """Greedy continuations from a tunix Gemma 4 model (decoded without a KV cache). The prompts
    share one token array padded at the end, so the model compiles once; the causal mask keeps
    the padding out of every position that is read."""
    from workloads.merge import verify

    lengths = [len(p) for p in prompts]
    tokens = np.zeros((len(prompts), max(lengths) + new_tokens), dtype=np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt
    rows = np.arange(len(prompts))
    for offset in range(new_tokens):
        cursor = np.array(lengths) + offset
        logits = verify.forward(model, tokens, mesh)
        tokens[rows, cursor] = np.argmax(logits[rows, cursor - 1], axis=-1)
    return [tokens[row, n : n + new_tokens].tolist() for row, n in enumerate(lengths)]


def lora_greedy(
    base: str,
    checkpoint: str,
    prompts: Sequence[Sequence[int]],
    new_tokens: int = NEW_TOKENS,
    *,
    step: int | None = None,
) -> list[list[int]]:
    """Greedy continuations from the run's LoRA model (float32, CPU): the base model with the
    adapters restored from `checkpoint` by the training code's own restore path."""
    from workloads.merge import verify
    from workloads.model import gemma4

    mesh = verify.single_device_mesh()
    model = verify.restore_lora(
        gemma4.load_model(base, mesh=mesh, dtype="float32"), checkpoint, step=step, mesh=mesh
    )
    return greedy(model, mesh, prompts, new_tokens)


def served_greedy(
    base_url: str,
    model_name: str,
    prompts: Sequence[Sequence[int]],
    new_tokens: int = NEW_TOKENS,
    *,
    timeout_s: float = SERVED_TIMEOUT_S,
) -> list[list[int]]:
    """Greedy continuations from an OpenAI-compatible vLLM server: /v1/completions with the
    prompt as token ids, temperature 0, EOS ignored (so every answer has `new_tokens` tokens) and
    vLLM's `return_token_ids` (the ids themselves, no detokenize/retokenize round trip).

    Args:
        base_url: the server, without /v1.
        model_name: the served model's name.
        prompts: prompt token ids.
        new_tokens: tokens to generate per prompt.
        timeout_s: total deadline of each request, from connecting to the answer's last byte
            (eval's deadline: a server that drips its answer cannot stretch it).

    Returns:
        The generated token ids of each prompt.

    Raises:
        ParityError: the server refused a request, missed its deadline, or its answer has no
            token ids.
    """
    out = []
    for prompt in prompts:
        body = {
            "model": model_name,
            "prompt": list(prompt),
            "max_tokens": new_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        answer = _post(f"{base_url.rstrip('/')}/v1/completions", body, timeout_s)
        try:
            ids = [int(t) for t in answer["choices"][0]["token_ids"]]
        except (KeyError, IndexError, TypeError, ValueError):
            raise ParityError(
                f"{base_url}: the completion has no token ids: {json.dumps(answer)[:300]}"
            ) from None
        out.append(ids)
    return out


def _post(url: str, body: dict[str, Any], timeout_s: float) -> Any:
    try:
        status, _, payload = sampling.http_call(
            "POST",
            url,
            json.dumps(body).encode(),
            {"Content-Type": "application/json", "Accept": "application/json"},
            timeout_s,
        )
    except TimeoutError:
        raise ParityError(
            f"POST {url}: no complete answer within {timeout_s:g} s (each request's total deadline)"
        ) from None
    except (OSError, http.client.HTTPException) as exc:  # refused, reset, over the body cap
        raise ParityError(f"POST {url}: {' '.join(str(exc).split())[:300]}") from None
    if not 200 <= status < 300:
        detail = payload[:300].decode(errors="replace")
        raise ParityError(f"POST {url} -> {status}: {detail}")
    try:
        return json.loads(payload)
    except ValueError:
        raise ParityError(f"POST {url} -> {status}: not JSON: {payload[:100]!r}") from None


def check(
    base: str,
    checkpoint: str,
    merged: str,
    base_url: str,
    model_name: str,
    *,
    new_tokens: int = NEW_TOKENS,
    timeout_s: float = SERVED_TIMEOUT_S,
) -> ParityResult:
    """Both models' greedy continuations of PROMPTS (tokenized by the merged model's tokenizer,
    which the server uses too); timeout_s is each server request's total deadline."""
    prompts = prompt_ids(merged)
    trained = lora_greedy(base, checkpoint, prompts, new_tokens)
    served = served_greedy(base_url, model_name, prompts, new_tokens, timeout_s=timeout_s)
    return ParityResult(
        prompts=tuple(tuple(p) for p in prompts),
        trained=tuple(tuple(t) for t in trained),
        served=tuple(tuple(s) for s in served),
    )
