"""Preflight: what `python -m infra.preflight` checks before `pulumi up`, read-only.

- checks: the stack config's rules, quota, the Cloud TPU API, the HF token, the serving summary,
  and the command itself (main, which __main__ runs).
- iam: the custom roles the program declares, against the project's own (the permissions it
  needs).
- compile_check: the deviceless compile of the training step (`--compile`), its cached results
  in .compile-check/ (which `pulumi preview` shows through program.py), keyed by the step's
  sources.
- hlo_collectives: the compiled step's collectives, read from its HLO.

It reads the stack through infra.ops' stack client, so it stands above ops in
tests/infra/test_layers.py; nothing in ops imports it.
"""
