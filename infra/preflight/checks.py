"""Read-only checks against the Cloud TPU API before `pulumi up` spends money.

    python -m infra.preflight [--stack dev]
    python -m infra.preflight --compile [--stack prod] [--depths 6,12,18]

For every TPU VM of the stack: the accelerator type and the runtime version are offered in the
configured zone, and no node of the same name is left in PREEMPTED state (a preempted spot node
is not restarted by anything and blocks re-creation). It also refuses the placeholders of the
checked-in stack files, and asks IAM whether the project can hold every permission of the
stack's custom roles (infra/preflight/iam.py; not reaching IAM is a warning). It changes
nothing and ends with one verdict line.

`--compile` instead compiles the stack's training step for its TPU topology on this machine, with
no TPU and no cloud calls (infra/preflight/compile_check.py): per-chip peak HBM, FLOPs, XLA's
estimated
step time as a band, the real tokens/s and share of the chips' peak it implies, and whether the
step fits.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import pathlib
import sys
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from infra.config import model as config_mod
from infra.config import sizing, stack_config, validation
from infra.ops import stack_client
from infra.preflight import compile_check, iam
from infra.tpu import api as tpu_api
from workloads.common import cli_options
from workloads.contract import catalog

ROOT = pathlib.Path(__file__).resolve().parents[2]
_DOCUMENTATION_RANGES = tuple(
    ipaddress.IPv4Network(n) for n in ("192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24")
)


class TpuReads(Protocol):
    """The three read-only calls of `google.cloud.tpu_v2.TpuClient` that preflight uses."""

    def list_accelerator_types(self, *, parent: str) -> Iterable[Any]: ...

    def list_runtime_versions(self, *, parent: str) -> Iterable[Any]: ...

    def get_node(self, *, name: str) -> Any: ...


@dataclasses.dataclass(frozen=True)
class Check:
    """One check's outcome: ok, and a line that says what was checked and what to do."""

    ok: bool
    message: str


@dataclasses.dataclass(frozen=True)
class SliceSpec:
    """A TPU VM the stack would create."""

    role: str
    key: str
    zone: str
    accelerator: str
    runtime_version: str
    node_name: str
    zone_fallbacks: tuple[str, ...] = ()


def slices(cfg: config_mod.StackConfig) -> list[SliceSpec]:
    """The training slice and, when serving is on, the serving slice."""
    train = catalog.accelerator(cfg.training.accelerator)
    specs = [
        SliceSpec(
            "training",
            "training",
            cfg.training.zone,
            train.name,
            cfg.training.runtime_version or train.runtime_version,
            cfg.training_node_name,
            cfg.training.zone_fallbacks,
        )
    ]
    if cfg.serving.enabled:
        serve = catalog.accelerator(cfg.serving.accelerator)
        specs.append(
            SliceSpec(
                "serving",
                "serving",
                cfg.serving.zone,
                serve.name,
                cfg.serving.runtime_version or serve.runtime_version,
                cfg.serving_node_name,
                cfg.serving.zone_fallbacks,
            )
        )
    return specs


def serving_summary(cfg: config_mod.StackConfig) -> str | None:
    """One line on how the serving VM will serve: the profile, replicas x TP, the numerics and
    the HBM estimate per chip (what validation's HBM rule checks); None when serving is off.

    Args:
        cfg: the validated stack config.

    Returns:
        The line, or None.
    """
    s = cfg.serving
    acc = catalog.ACCELERATORS.get(s.accelerator)
    if not s.enabled or acc is None or cfg.model_spec is None:
        return None
    weights = "bf16" if s.weight_quantization == "off" else s.weight_quantization
    kv = "bf16" if s.kv_cache_dtype in ("auto", "bfloat16") else s.kv_cache_dtype
    need = sizing.serving_hbm_bytes(cfg)
    tokens = sizing.serving_kv_tokens_per_replica(cfg, acc.hbm_bytes_per_chip)
    return (
        f"serving: profile {s.profile}: {s.data_parallel_size} replica(s) x TP "
        f"{s.tensor_parallel_size} on {acc.name}, weights {weights}, KV cache {kv}; "
        f"estimated HBM per chip {need / catalog.GB:.1f} GB for "
        f"{s.min_concurrent_sequences} x {s.max_model_len} tokens per replica, of "
        f"{s.hbm_utilization:g} x {acc.hbm_bytes_per_chip / catalog.GB:.1f} GB; KV cache room "
        f"~{tokens // 1000}K tokens per replica"
    )


def _api_error_types() -> tuple[type[BaseException], type[BaseException]]:
    from google.api_core import exceptions

    return exceptions.NotFound, exceptions.GoogleAPICallError


def _offered_types(client: TpuReads, project: str, zone: str) -> set[str]:
    parent = f"projects/{project}/locations/{zone}"
    return {
        getattr(t, "type_", None) or str(t.name).rsplit("/", 1)[-1]
        for t in client.list_accelerator_types(parent=parent)
    }


def check_slice(client: TpuReads, project: str, spec: SliceSpec) -> list[Check]:
    """The three checks of one slice; API errors become failed checks, not tracebacks."""
    not_found, api_error = _api_error_types()
    checks: list[Check] = []
    where = f"{spec.role} {spec.accelerator} in {spec.zone}"
    try:
        offered = _offered_types(client, project, spec.zone)
    except api_error as exc:
        return [Check(False, f"{where}: cannot list accelerator types: {exc}")]
    if spec.accelerator in offered:
        checks.append(Check(True, f"{where}: accelerator type offered"))
    else:
        hint = ""
        for zone in spec.zone_fallbacks:
            try:
                if spec.accelerator in _offered_types(client, project, zone):
                    hint = (
                        f"; {zone} offers it: pulumi config set --path "
                        f"'{config_mod.PROJECT}:{spec.key}.zone' {zone}"
                    )
                    break
            except api_error:
                continue
        checks.append(Check(False, f"{where}: accelerator type not offered in this zone{hint}"))

    parent = f"projects/{project}/locations/{spec.zone}"
    try:
        versions = {str(v.version) for v in client.list_runtime_versions(parent=parent)}
    except api_error as exc:
        checks.append(Check(False, f"{where}: cannot list runtime versions: {exc}"))
    else:
        if spec.runtime_version in versions:
            checks.append(Check(True, f"{where}: runtime version {spec.runtime_version} offered"))
        else:
            checks.append(
                Check(
                    False,
                    f"{where}: runtime version {spec.runtime_version} not offered in {spec.zone}",
                )
            )

    name = f"projects/{project}/locations/{spec.zone}/nodes/{spec.node_name}"
    try:
        node = client.get_node(name=name)
    except not_found:
        checks.append(Check(True, f"{where}: no node named {spec.node_name} yet"))
    except api_error as exc:
        checks.append(Check(False, f"{where}: cannot look up node {spec.node_name}: {exc}"))
    else:
        state = getattr(node.state, "name", str(node.state))
        if state == "PREEMPTED":
            checks.append(
                Check(
                    False,
                    f"{where}: node {spec.node_name} is PREEMPTED (nothing restarts it); delete it "
                    f"with `gcloud compute tpus tpu-vm delete {spec.node_name} --zone "
                    f"{spec.zone} --project {project}`, then `pulumi refresh` and `pulumi up`",
                )
            )
        else:
            checks.append(Check(True, f"{where}: node {spec.node_name} exists ({state})"))
    return checks


def check_placeholders(cfg: config_mod.StackConfig) -> list[Check]:
    """The checked-in stack files carry a placeholder project and a documentation SSH range."""
    checks = []
    if cfg.project == config_mod.PLACEHOLDER_PROJECT:
        checks.append(
            Check(
                False,
                f"project: {cfg.project!r} is the placeholder: "
                f"pulumi config set {config_mod.PROJECT}:project <your-project-id>",
            )
        )
    for text in cfg.ssh.source_ranges:
        net = ipaddress.ip_network(text, strict=False)
        if isinstance(net, ipaddress.IPv4Network) and any(
            net.subnet_of(doc) for doc in _DOCUMENTATION_RANGES
        ):
            checks.append(
                Check(
                    False,
                    f"ssh.sourceRanges: {text} is a documentation range (placeholder): pulumi "
                    f"config set --path '{config_mod.PROJECT}:ssh.sourceRanges[0]' <your-ip>/32",
                )
            )
    return checks


def run_preflight(
    cfg: config_mod.StackConfig,
    client_factory: Callable[[], TpuReads],
    *,
    has_hf_token: bool | None = None,
    iam_session_factory: Callable[[], iam.Session] | None = None,
    warn: Callable[[str], None] = print,
) -> list[Check]:
    """Every check of a validated config, in order. The client is created only when the
    project is not the placeholder; failing to create it (no credentials) is a failed check.
    With `iam_session_factory`, the custom roles' permissions are asked of IAM too (a warning
    line through `warn` when IAM cannot be reached)."""
    checks = [Check(False, p) for p in validation.rule_hf_token(cfg, has_hf_token)]
    checks += check_placeholders(cfg)
    if cfg.project == config_mod.PLACEHOLDER_PROJECT:
        return checks  # the API calls would only fail on a project that does not exist
    if iam_session_factory is not None:
        report = iam.check_roles(cfg, iam_session_factory)
        for line in report.warnings:
            warn(f"WARN  {line}")
        checks += [Check(ok, line) for ok, line in report.checks]
    try:
        client = client_factory()
    except Exception as exc:
        checks.append(
            Check(
                False,
                f"cannot create the Cloud TPU client: {exc} "
                "(run `gcloud auth application-default login`)",
            )
        )
        return checks
    for spec in slices(cfg):
        checks += check_slice(client, cfg.project, spec)
    return checks


def verdict(checks: list[Check]) -> tuple[bool, str]:
    """(ok, report text): one line per check, then the verdict line."""
    failed = [c for c in checks if not c.ok]
    lines = [f"{'ok  ' if c.ok else 'FAIL'}  {c.message}" for c in checks]
    if failed:
        lines.append(
            f"preflight: FAILED ({len(failed)} of {len(checks)} checks): "
            "fix the above before `pulumi up`"
        )
    else:
        lines.append(f"preflight: OK ({len(checks)} checks passed): `pulumi up` can go ahead")
    return not failed, "\n".join(lines)


def _default_stack() -> str:
    if os.environ.get("PULUMI_STACK"):
        return os.environ["PULUMI_STACK"]
    return stack_client.current_stack_name(ROOT) or "dev"


def _depths(text: str) -> tuple[int, ...]:
    try:
        depths = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--depths {text!r}: expected comma-separated layer counts, e.g. 6,12,18"
        ) from None
    bad = [d for d in depths if d <= 0 or d % 6]
    if bad or len(set(depths)) != len(depths):
        raise argparse.ArgumentTypeError(
            f"--depths {text!r}: each must be a distinct positive multiple of 6 (the model's "
            "5 sliding : 1 global layer pattern)"
        )
    return depths


def _compile_check(stack: str, cfg: config_mod.StackConfig, depths: tuple[int, ...] | None) -> int:
    """Exit status: 0 = the step fits, 1 = it does not (one line naming the keys), 2 = error."""
    from workloads.common import errors

    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the TPU exists only as a topology here
    try:
        est = compile_check.check(
            stack,
            cfg,
            compile_fn=compile_check.compile_depth(cfg),
            depths=depths or compile_check.DEPTHS,
        )
    except errors.UserError as exc:
        print(f"compile-check: FAILED: {exc}")
        return 2
    if est is None:
        print("compile-check: FAILED: nothing was compiled")
        return 2
    print(compile_check.report(est))
    return 0 if est.fits else 1


def _real_client() -> TpuReads:
    try:
        client: TpuReads = tpu_api.tpu_client()
    except ImportError:
        raise SystemExit("preflight needs google-cloud-tpu: pip install -e '.[infra]'") from None
    return client


def build_parser() -> argparse.ArgumentParser:
    parser = cli_options.parser("python -m infra.preflight", __doc__.splitlines()[0])
    cli_options.add_stack(parser)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the stack's training step for its TPU without one (needs libtpu: "
        "pip install -e '.[compile]'); no cloud calls",
    )
    cli_options.config_default(
        parser.add_argument(
            "--depths",
            type=_depths,
            default=None,
            help="with --compile: comma-separated layer counts to compile, multiples of 6; the "
            "first two are fitted, a third is the held-out check",
        ),
        compile_check.DEPTHS,
    )
    parser.add_argument("--root", default=str(ROOT), help=argparse.SUPPRESS)
    return parser


def main(
    argv: list[str] | None = None,
    client_factory: Callable[[], TpuReads] = _real_client,
    iam_session_factory: Callable[[], iam.Session] = iam.google_session,
) -> int:
    """Exit status: 0 = all checks passed, 1 = a check failed, 2 = the stack config is invalid."""
    args = build_parser().parse_args(argv)
    stack = args.stack or _default_stack()
    path = pathlib.Path(args.root) / f"Pulumi.{stack}.yaml"
    try:
        # The compile check measures the settings as they are; validation's own verdict on
        # them (its HBM rule is a deliberate over-estimate) is printed next to it.
        cfg = stack_config.parse_stack_config(
            stack_config.read_stack_file(path), validate=not args.compile
        )
    except config_mod.ConfigError as exc:
        for problem in exc.problems:
            print(f"FAIL  {problem}")
        print(f"preflight: FAILED: {path.name} is invalid ({len(exc.problems)} problem(s))")
        return 2
    if args.compile:
        for problem in validation.check(cfg):
            print(f"note: `pulumi up` refuses this stack as it is: {problem}")
        return _compile_check(stack, cfg, args.depths)
    print(f"preflight: stack {stack} (project {cfg.project}), read-only")
    summary = serving_summary(cfg)
    if summary:
        print(summary)
    for warning in validation.cross_region_fallbacks(cfg):
        print(f"WARN  {warning}")
    ok, report = verdict(
        run_preflight(
            cfg,
            client_factory,
            has_hf_token=stack_config.stack_file_has_hf_token(path),
            iam_session_factory=iam_session_factory,
        )
    )
    print(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
