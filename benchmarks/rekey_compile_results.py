"""Carries the committed compile-check results across a change that leaves the step's XLA input
as it was (a module moved, an import or a type name renamed, code outside the traced step edited).

    .venv/bin/python benchmarks/rekey_compile_results.py OLD_REV [--dry-run]

A result in .compile-check/ is keyed by a hash of the step's sources
(infra/preflight/compile_check.py,
STEP_SOURCES), so any edit of those files, even one that XLA never sees, orphans it, and compiling
every committed setting again costs about an hour of two cores. This script lowers the training
step at 6 layers (jit(...).lower(): the program XLA would compile, without compiling it) for every
committed setting, once in a worktree of OLD_REV and once in this checkout. Where the two lowered
programs are the same text (their sha256), the results of OLD_REV's key hold for today's key, and
the files are renamed to it (levers included); any other setting is named and left to be compiled
again (`python -m infra.preflight --compile`, benchmarks/compile_sweep.py,
benchmarks/step_levers.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ".compile-check"
DEPTH = 6  # the smallest committed depth: the same lowered text at 6 layers is the same code


def lowered_hashes(tree: pathlib.Path, names: list[str] | None) -> dict[str, tuple[str, str]]:
    """Runs this file's --lower mode in `tree`: {setting name: (cache key, sha256 of the HLO)}."""
    command = [sys.executable, str(pathlib.Path(__file__).resolve()), "--lower", str(tree)]
    if names is not None:
        command += ["--names", ",".join(names)]
    env = {**os.environ, "PYTHONPATH": str(tree), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"rekey: lowering in {tree} failed:\n{done.stderr[-2000:]}")
    return {name: (key, digest) for name, key, digest in json.loads(done.stdout)}


def lower_here(tree: pathlib.Path, names: list[str] | None) -> None:
    """--lower: prints [[name, key, sha256], ...] for the committed settings of `tree` (or for
    `names`, committed or not). Runs inside `tree`'s own code (PYTHONPATH)."""
    import jax.stages

    sys.path.insert(0, str(tree / "benchmarks"))
    import compile_sweep  # the tree's own sweep settings

    from infra.config import stack_config

    try:
        from infra.preflight import compile_check
    except ImportError:  # a tree from before preflight had its own folder (infra/ops/)
        from infra.ops import compile_check  # type: ignore[no-redef]
    from workloads.train import compile_step

    class Lowered(Exception):  # carries the result out of compile_train_step
        pass

    def capture(self: jax.stages.Lowered, *_a: object, **_k: object) -> None:
        raise Lowered(hashlib.sha256(self.as_text().encode()).hexdigest())

    jax.stages.Lowered.compile = capture  # type: ignore[method-assign]
    candidates = {
        stack: stack_config.parse_stack_config(
            stack_config.read_stack_file(tree / f"Pulumi.{stack}.yaml"), validate=False
        )
        for stack in ("dev", "prod")
    }
    for i, row in enumerate(compile_sweep.SETTINGS, start=1):
        if row[3] % row[1] == 0:  # the micro-batch splits over fsdp
            candidates[f"sweep{i}"] = compile_sweep.sweep_config("prod", *row)
    out, seen = [], set()
    for name, cfg in candidates.items():
        key = compile_check.cache_key(compile_check.step_settings(cfg))
        committed = any((tree / RESULTS).glob(f"{key}-*.json"))
        if key in seen or (names is None and not committed) or (names and name not in names):
            continue
        seen.add(key)
        compile_step.libtpu_environment(cfg.training.accelerator)
        try:
            compile_check.compile_depth(cfg)(DEPTH)
        except Lowered as hlo:
            out.append([name, key, str(hlo)])
            continue
        sys.exit(f"rekey: {name}: the step was not lowered")
    print(json.dumps(out))


def rename_plan(old_key: str, new_key: str) -> list[tuple[pathlib.Path, pathlib.Path]]:
    """Every committed file of `old_key` (depth results and levers) and its name under `new_key`."""
    plan = []
    for folder in (ROOT / RESULTS, ROOT / RESULTS / "levers"):
        for path in sorted(folder.glob(f"{old_key}-*.json")):
            plan.append((path, path.with_name(new_key + path.name[len(old_key) :])))
    return plan


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old_rev", nargs="?", help="the commit whose results are committed")
    parser.add_argument("--dry-run", action="store_true", help="say what would be renamed")
    parser.add_argument("--lower", type=pathlib.Path, help=argparse.SUPPRESS)
    parser.add_argument("--names", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lower is not None:
        lower_here(args.lower, args.names.split(",") if args.names else None)
        return 0
    if not args.old_rev:
        parser.error("OLD_REV is required")
    with tempfile.TemporaryDirectory() as tmp:
        old = pathlib.Path(tmp) / "old"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), args.old_rev],
            check=True,
            capture_output=True,
        )
        try:
            before = lowered_hashes(old, None)
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)],
                check=False,
                capture_output=True,
            )
    after = lowered_hashes(ROOT, sorted(before))
    status = 0
    for name, (old_key, old_hlo) in sorted(before.items()):
        new_key, new_hlo = after.get(name, ("?", "?"))
        if new_hlo != old_hlo:
            print(f"{name}: {old_key} -> {new_key}: the lowered step differs; compile it again")
            status = 1
            continue
        for src, dst in rename_plan(old_key, new_key) if old_key != new_key else []:
            print(
                f"{name}: {src.relative_to(ROOT)} -> {dst.name} (same lowered step {old_hlo[:12]})"
            )
            if not args.dry_run:
                src.rename(dst)
    return status


if __name__ == "__main__":
    sys.exit(main())
