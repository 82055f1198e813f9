"""The systemd units of one VM, rendered from templates/systemd/: their text, which to enable and
which to start. One planner per VM role (plan_train_units, plan_serve_units); a role's
`plan_units` (infra/vm/roles.py) names its planner."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jinja2

from infra.vm import templating
from infra.vm.layout import RemoteLayout
from workloads.contract import runconfig

TRAIN_UNIT = "gemma4-train.service"
MERGE_UNIT = "gemma4-merge.service"
SERVE_UNIT = "gemma4-serve.service"
EVAL_UNIT = "gemma4-eval.service"
BENCH_UNIT = "gemma4-bench.service"
RELEASE_UNIT = "gemma4-release.service"
STOP_UNIT = "gemma4-serve-stop.service"
STOP_TIMER = "gemma4-serve-stop.timer"
ALL_UNITS = (
    TRAIN_UNIT,
    MERGE_UNIT,
    RELEASE_UNIT,
    SERVE_UNIT,
    EVAL_UNIT,
    BENCH_UNIT,
    STOP_UNIT,
    STOP_TIMER,
)


def systemd_quote(value: Any) -> str:
    """Quotes one argument of a systemd ExecStart= line (also escapes % specifiers and $)."""
    text = str(value).replace("%", "%%").replace("$", "$$")
    if text and all(c.isalnum() or c in "/._-+=:,@" for c in text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _environment() -> jinja2.Environment:
    env = templating.environment()
    env.filters["sd"] = systemd_quote
    return env


@dataclasses.dataclass(frozen=True)
class UnitPlan:
    """The units of one VM: name -> rendered text, which to enable and which to start."""

    units: dict[str, str]
    enable: list[str]
    start: list[str]


def _renderer(
    run_config: runconfig.RunConfig, layout: RemoteLayout, restart_burst: int
) -> Callable[..., str]:
    """render(unit, **extra): the text of templates/systemd/<unit>.j2 for this run and layout."""
    env = _environment()
    context: dict[str, Any] = {
        "run_name": run_config.run_name,
        # Only paths under `current`: a unit starts whatever release is active, and `current`
        # only ever points at a complete one (infra.remote.release).
        "python": layout.active_python,
        "config_path": layout.active_config,
        "env_file": layout.env_file,
        "work_dir": layout.state_dir,
        "ready_marker": layout.ready_marker,
        "restart_burst": restart_burst,
    }

    def render(unit: str, **extra: Any) -> str:
        return env.get_template(f"systemd/{unit}.j2").render(**context, **extra)

    return render


def plan_train_units(
    run_config: runconfig.RunConfig, layout: RemoteLayout, *, restart_burst: int = 10
) -> UnitPlan:
    """The training VM's units: gemma4-train (enabled, started) and, when the run config has a
    merge section, gemma4-merge (started by train's OnSuccess=); with a release section,
    gemma4-release (started by the last of those two on success)."""
    render = _renderer(run_config, layout, restart_burst)
    merge, release = run_config.merge is not None, run_config.release is not None
    units = {TRAIN_UNIT: render(TRAIN_UNIT, merge=merge, release=release and not merge)}
    if merge:
        units[MERGE_UNIT] = render(MERGE_UNIT, release=release)
    if release:
        units[RELEASE_UNIT] = render(RELEASE_UNIT)
    return UnitPlan(units, enable=[TRAIN_UNIT], start=[TRAIN_UNIT])


def plan_serve_units(
    run_config: runconfig.RunConfig,
    layout: RemoteLayout,
    *,
    curl: str = "/usr/bin/curl",
    restart_burst: int = 10,
) -> UnitPlan:
    """The serving VM's units: gemma4-serve (enabled, started), plus gemma4-eval and
    gemma4-bench when configured (enabled as WantedBy=gemma4-serve, so every serve start pulls
    them in; bench after eval), and with a stop section the gemma4-serve-stop timer (enabled,
    started) and its service.

    Raises:
        ValueError: the run config has no serve section.
    """
    if run_config.serve is None:
        raise ValueError("role 'serve' needs a run config with a serve section (serving.enabled)")
    render = _renderer(run_config, layout, restart_burst)
    serve = run_config.serve
    health = {
        "curl": curl,
        "health_url": f"http://127.0.0.1:{serve.port}/health",
        "ready_timeout_s": serve.ready_timeout_s,
    }
    units = {SERVE_UNIT: render(SERVE_UNIT)}
    order = [SERVE_UNIT]
    if run_config.eval is not None:
        units[EVAL_UNIT] = render(EVAL_UNIT, **health)
        order.append(EVAL_UNIT)
    if run_config.bench is not None:
        units[BENCH_UNIT] = render(BENCH_UNIT, after_eval=run_config.eval is not None, **health)
        order.append(BENCH_UNIT)
    if run_config.stop is not None:
        stop = run_config.stop
        units[STOP_UNIT] = render(STOP_UNIT, stop=stop)
        units[STOP_TIMER] = render(STOP_TIMER, after_s=round(stop.after_hours * 3600))
        order.append(STOP_TIMER)
    return UnitPlan(units, enable=list(order), start=list(order))
