"""`python -m workloads eval`: verilog-eval spec-to-rtl pass@k against a served model.

Settings come from the command line, else the run config's `eval` section (--config), else the
schema's defaults (n=5, temperature 0.8, top_p 0.95, 1024 new tokens, 60 s per simulation).
Writes `samples/<problem>.json` (resumable progress), `results.jsonl` (one line per problem),
`summary.json` and `summary.md` into the results directory (local or gs://).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import os
import time
from typing import Any

import pydantic

from workloads.common import cli_options, errors, logs, storage
from workloads.contract import catalog, runconfig
from workloads.contract import settings as settings_lib
from workloads.evaluation import extract, judge, passk, problems, prompting, sampling, sandbox

LOG = logs.get("eval")

_FIELDS = runconfig.EvalRunSection.model_fields


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Adds the eval options; every one defaults to the run config's value, then the schema's."""
    cli_options.add_config(parser, uses="uses its `eval` section")
    parser.add_argument(
        "--problems",
        type=storage.absolute,
        help="verilog-eval dataset_spec-to-rtl directory (local or gs://)",
    )
    shown = cli_options.config_default  # the help shows the schema's default
    shown(
        parser.add_argument("--endpoint", help="OpenAI-compatible base URL"), _default("endpoint")
    )
    parser.add_argument(
        "--model",
        help="served model name (default: the config's serve.served_model_name, "
        "else the only model the endpoint lists)",
    )
    parser.add_argument("--out", type=storage.absolute, help="results directory (local or gs://)")
    shown(parser.add_argument("-n", type=int, help="samples per problem"), _default("n"))
    shown(
        parser.add_argument("--temperature", type=float, help="sampling temperature"),
        _default("temperature"),
    )
    shown(parser.add_argument("--top-p", type=float, help="nucleus sampling"), _default("top_p"))
    shown(
        parser.add_argument("--max-tokens", type=int, help="tokens per answer at most"),
        _default("max_tokens"),
    )
    shown(
        parser.add_argument("--concurrency", type=int, help="requests in flight"),
        _default("concurrency"),
    )
    shown(
        parser.add_argument("--sim-timeout", type=float, help="seconds per compile/simulation"),
        _default("sim_timeout_s"),
    )
    shown(
        parser.add_argument(
            "-k", "--ks", type=_int_list, help="k values of pass@k, comma separated"
        ),
        _default("ks"),
    )
    parser.add_argument("--jobs", type=int, help="parallel simulations (default: CPU count)")
    parser.add_argument("--only", help="regular expression: evaluate only matching problem names")
    parser.add_argument("--limit", type=int, help="evaluate only the first N problems (smoke runs)")
    parser.add_argument(
        "--system-prompt",
        choices=prompting.SYSTEM_MODES,
        default="system",
        help="where verilog-eval's system message goes: its own turn (system), "
        "folded into the user turn, or left out",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="total seconds per request, connecting to the answer's last byte",
    )
    parser.add_argument(
        "--api-key-env",
        default="OPENAI_API_KEY",
        help="environment variable holding the API key, if the server needs one",
    )


def _default(field: str) -> Any:
    """The eval schema's default of `field` (what applies when neither flag nor config sets it)."""
    return _FIELDS[field].default


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: k values must be positive")
    return values


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """Merges the command line over the config's eval section over the schema defaults."""
    section: dict[str, Any] = {}
    served_model = None
    numerics = None
    if args.config:
        config = runconfig.load(args.config)
        if config.eval is None:
            raise errors.UserError(f"{args.config}: has no `eval` section")
        section = config.eval.model_dump()
        served_model = config.serve.served_model_name if config.serve else None
        numerics = settings_lib.serving_numerics(config.serve) if config.serve else None

    def pick(flag: Any, key: str) -> Any:
        if flag is not None:
            return flag
        if key in section:
            return section[key]
        return _FIELDS[key].default

    settings = {
        "problems_dir": args.problems or section.get("problems_dir"),
        "results_dir": args.out or section.get("results_dir"),
        "endpoint": pick(args.endpoint, "endpoint"),
        "model": args.model or served_model,
        "n": pick(args.n, "n"),
        "temperature": pick(args.temperature, "temperature"),
        "top_p": pick(args.top_p, "top_p"),
        "max_tokens": pick(args.max_tokens, "max_tokens"),
        "concurrency": pick(args.concurrency, "concurrency"),
        "sim_timeout_s": pick(args.sim_timeout, "sim_timeout_s"),
        "ks": tuple(pick(args.ks, "ks")),
        # The serving profile and numerics the scores were produced under (None: no config).
        "serving": numerics,
    }
    missing = [
        flag
        for flag, key in (("--problems", "problems_dir"), ("--out", "results_dir"))
        if not settings[key]
    ]
    if missing:
        raise errors.UserError(
            f"eval needs {' and '.join(missing)} (or --config with an eval section)"
        )
    # The flags meet the same schema as the config file's eval section (n >= 1, top_p in (0, 1],
    # a timeout > 0, ...): one definition of what is allowed.
    try:
        checked = runconfig.EvalRunSection.model_validate(
            {k: v for k, v in settings.items() if k not in ("model", "serving")}
        )
    except pydantic.ValidationError as exc:
        lines = settings_lib.problem_lines(exc.errors(), runconfig.EvalRunSection)
        raise errors.UserError("eval: " + "; ".join(lines)) from None
    settings |= checked.model_dump()
    settings["ks"] = _ks_within_n(settings["ks"], settings["n"])
    if not 0 < args.request_timeout < math.inf:  # also refuses nan
        raise errors.UserError(
            f"--request-timeout {args.request_timeout}: need a number of seconds > 0"
        )
    if args.jobs is not None and args.jobs < 1:
        raise errors.UserError(f"--jobs {args.jobs}: need at least 1 parallel simulation")
    sampling.check_endpoint(settings["endpoint"])
    return settings


def _ks_within_n(ks: tuple[int, ...], n: int) -> tuple[int, ...]:
    """The k of `ks` that n samples per problem can score: greedy decoding (n = 1) reports
    pass@1 rather than failing on the pass@5 of the default list; the rest are named once.

    Raises:
        UserError: no k of the list is <= n.
    """
    kept = tuple(k for k in ks if k <= n)
    dropped = [k for k in ks if k > n]
    if not kept:
        raise errors.UserError(
            f"pass@k with k={dropped} needs at least that many samples; n is {n}: "
            f"use --ks with values <= {n} or a larger -n"
        )
    if dropped:
        LOG.info(
            f"pass@k for k={dropped} left out: n is {n} sample(s) per problem; "
            f"reporting {', '.join(f'pass@{k}' for k in kept)}"
        )
    return kept


def _pick_model(client: sampling.ChatClient) -> str:
    served = client.models()
    if len(served) != 1:
        raise errors.UserError(
            f"{client.base_url} serves {served or 'no models'}; choose one with --model"
        )
    return served[0]


def main(args: argparse.Namespace) -> int:
    settings = _settings(args)
    judge.require_tools()
    items = problems.load(settings["problems_dir"], only=args.only, limit=args.limit)
    client = sampling.ChatClient(
        settings["endpoint"],
        api_key=os.environ.get(args.api_key_env) or None,
        timeout_s=args.request_timeout,
    )
    model = settings["model"] or _pick_model(client)
    params = sampling.SamplingParams(
        model=model,
        temperature=settings["temperature"],
        top_p=settings["top_p"],
        max_tokens=settings["max_tokens"],
    )
    results_dir = settings["results_dir"]
    n = settings["n"]
    LOG.info(
        f"{len(items)} problems x {n} samples from {client.base_url} ({model}) -> {results_dir}"
    )

    started = time.monotonic()
    samples = sampling.sample_all(
        [(p.name, prompting.messages(p.prompt, args.system_prompt)) for p in items],
        client,
        params,
        sampling.ProgressStore(results_dir),
        n=n,
        concurrency=settings["concurrency"],
        on_problem_done=lambda name, new, done: LOG.info(
            f"sampled {name} ({new} new) [{done}/{len(items)}]"
        ),
    )
    sampling_s = time.monotonic() - started

    extractions: dict[str, list[extract.Extraction | None]] = {}
    for p in items:
        extractions[p.name] = [
            None if "error" in s else extract.extract_code(s.get("text")) for s in samples[p.name]
        ]

    LOG.info(
        f"judging {sum(len(v) for v in extractions.values())} samples with iverilog in the "
        f"bubblewrap sandbox (uid {sandbox.SANDBOX_UID}, no network)"
    )
    started = time.monotonic()
    references, verdicts = judge.judge_all(
        items,
        extractions,
        limits=judge.Limits(timeout_s=settings["sim_timeout_s"]),
        workers=args.jobs,
    )
    judging_s = time.monotonic() - started

    rows = [
        _problem_row(
            p.name,
            samples[p.name],
            extractions[p.name],
            verdicts[p.name],
            references[p.name],
            settings["ks"],
        )
        for p in items
    ]
    summary = _summary(rows, settings, model, args.system_prompt, sampling_s, judging_s)
    storage.write_text_atomic(
        runconfig.join(results_dir, "results.jsonl"),
        "".join(json.dumps(row) + "\n" for row in rows),
    )
    storage.write_text_atomic(
        runconfig.join(results_dir, "summary.json"), json.dumps(summary, indent=2) + "\n"
    )
    storage.write_text_atomic(
        runconfig.join(results_dir, "summary.md"), render_markdown(summary, rows)
    )
    scores = ", ".join(f"pass@{k} {v:.3f}" for k, v in summary["pass_at"].items())
    LOG.info(f"{scores} over {len(rows)} problems; wrote {results_dir}/summary.md")
    return 0


def _problem_row(
    name: str,
    sample_records: list[dict[str, Any]],
    extractions: list[extract.Extraction | None],
    verdicts: list[judge.Verdict],
    reference: judge.Reference,
    ks: tuple[int, ...],
) -> dict[str, Any]:
    n = len(verdicts)
    c = sum(v.passed for v in verdicts)
    per_sample = []
    for record, extraction, verdict in zip(sample_records, extractions, verdicts, strict=True):
        entry: dict[str, Any] = {
            "index": record["index"],
            "passed": verdict.passed,
            "status": verdict.status,
            "reason": record.get("error", verdict.reason),
            "mismatches": verdict.mismatches,
            "samples": verdict.samples,
            "finish_reason": record.get("finish_reason"),
            "completion_tokens": record.get("completion_tokens"),
            "extraction": extraction.method if extraction else None,
            "notes": list(extraction.notes) if extraction else [],
            "code": extraction.code if extraction else None,
            "seconds": verdict.seconds,
        }
        if not verdict.passed:
            entry["log_tail"] = verdict.log_tail
        per_sample.append(entry)
    return {
        "problem": name,
        "n": n,
        "passed": c,
        "pass_at": {str(k): passk.pass_at_k(n, c, k) for k in ks},
        "statuses": "".join(v.status for v in verdicts),
        "reference_samples": reference.samples,
        "reference_error": None if reference.samples else reference.verdict.reason,
        "samples": per_sample,
    }


def _summary(
    rows: list[dict[str, Any]],
    settings: dict[str, Any],
    model: str,
    system_prompt: str,
    sampling_s: float,
    judging_s: float,
) -> dict[str, Any]:
    statuses = collections.Counter(s["status"] for row in rows for s in row["samples"])
    all_samples = [s for row in rows for s in row["samples"]]
    return {
        "problems": len(rows),
        "n": settings["n"],
        "pass_at": {
            str(k): passk.mean_pass_at_k(((r["n"], r["passed"]) for r in rows), k)
            for k in settings["ks"]
        },
        "temperature": settings["temperature"],
        "top_p": settings["top_p"],
        "max_tokens": settings["max_tokens"],
        "model": model,
        "endpoint": settings["endpoint"],
        "serving": settings.get("serving"),
        "problems_dir": settings["problems_dir"],
        "system_prompt": system_prompt,
        "sim_timeout_s": settings["sim_timeout_s"],
        "status_counts": dict(sorted(statuses.items())),
        "truncated_samples": sum(s["finish_reason"] == "length" for s in all_samples),
        "request_errors": statuses.get("E", 0),
        "reference_failures": [r["problem"] for r in rows if r["reference_error"]],
        "completion_tokens": sum(s["completion_tokens"] or 0 for s in all_samples),
        "wall_seconds": {"sampling": round(sampling_s, 1), "judging": round(judging_s, 1)},
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def render_markdown(summary: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The human-readable summary: scores next to the paper's, failure kinds, per-problem rows."""
    paper = {"1": catalog.PAPER.pass_at_1, "5": catalog.PAPER.pass_at_5}
    lines = [
        "# verilog-eval spec-to-rtl",
        "",
        f"Model `{summary['model']}` at {summary['endpoint']}: {summary['problems']} problems, "
        f"n={summary['n']}, temperature {summary['temperature']}, top_p {summary['top_p']}, "
        f"max {summary['max_tokens']} new tokens, {summary['sim_timeout_s']:g} s per simulation.",
        "",
        f"Served with: {settings_lib.served_with(summary.get('serving'))}.",
        "",
        "| metric | this run | paper |",
        "|---|---|---|",
    ]
    for k, value in summary["pass_at"].items():
        reference = f"{paper[k]:.3f}" if k in paper else "n/a"
        lines.append(f"| pass@{k} | {value:.3f} | {reference} |")
    lines += ["", "| status | meaning | samples |", "|---|---|---|"]
    for status, count in summary["status_counts"].items():
        lines.append(f"| `{status}` | {judge.STATUS_MEANINGS.get(status, '?')} | {count} |")
    lines += [
        "",
        f"Answers cut off by the token limit: {summary['truncated_samples']}. "
        f"Requests rejected by the server: {summary['request_errors']}.",
    ]
    if summary["reference_failures"]:
        lines += [
            "",
            "**Warning**: the reference solution itself fails on "
            + ", ".join(summary["reference_failures"])
            + " (an iverilog version problem?); their samples count as failures.",
        ]
    lines += ["", "| problem | passed | statuses |", "|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['problem']} | {row['passed']}/{row['n']} | `{row['statuses']}` |")
    return "\n".join(lines) + "\n"
