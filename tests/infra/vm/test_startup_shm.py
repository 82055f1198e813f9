"""The startup scripts' /dev/shm check, run for real in bash against a fake /proc/meminfo and
fake `df` and `mount` on PATH: a tmpfs big enough is left alone, a small one on a host with the
RAM is grown, and a host without the RAM stops the boot before staging, naming the key.
"""

from __future__ import annotations

import pathlib

import pytest

from infra.config import sizing, stack_config
from infra.vm import roles, startup, templating
from tests.fixtures import pulumi_mocks
from tests.infra.vm.test_startup_idempotent import _run
from workloads.contract import catalog

GIB = 2**30
# df prints the size the fake mount recorded last (or the initial one).
FAKE_DF = r"""#!/bin/bash
printf '1B-blocks\n%s\n' "$(cat "$FAKE_SHM_SIZE")"
"""
FAKE_MOUNT = r"""#!/bin/bash
printf '%s\n' "$*" >>"$FAKE_MOUNT_CALLS"
size=$(printf '%s' "$2" | sed -n 's/.*size=\([0-9]*\).*/\1/p')
printf '%s' "$size" >"$FAKE_SHM_SIZE"
"""


@pytest.fixture
def host(tmp_path: pathlib.Path):
    """A fake host: set_ram(bytes), set_shm(bytes); the env a script runs with."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("df", FAKE_DF), ("mount", FAKE_MOUNT)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "gcs").mkdir()
    (tmp_path / "shm").mkdir()

    class Host:
        path = tmp_path
        mount_calls = tmp_path / "mount-calls"

        def set_ram(self, total: int) -> None:
            (tmp_path / "meminfo").write_text(
                f"MemTotal:       {total // 1024} kB\nMemFree:        1000 kB\n"
            )

        def set_shm(self, size: int) -> None:
            (tmp_path / "shm-size").write_text(str(size))

        def shm(self) -> int:
            return int((tmp_path / "shm-size").read_text())

        def run(self, script: str) -> tuple[int, str]:
            exports = (
                f"export MEMINFO={tmp_path / 'meminfo'} SHM_DIR={tmp_path / 'shm'} "
                f"FAKE_SHM_SIZE={tmp_path / 'shm-size'} FAKE_MOUNT_CALLS={self.mount_calls}; "
            )
            return _run(tmp_path, script, exports + "ensure_shm")

    return Host()


def _script(role: str) -> tuple[str, int]:
    if role == "train":
        cfg = stack_config.parse_stack_config(pulumi_mocks.stack_file_config("dev"))
        return templating.render(
            "startup/train.sh.j2", **startup.train_context(cfg, roles.TRAIN, has_hf_secret=True)
        ), sizing.training_shm_bytes(cfg)
    cfg = stack_config.parse_stack_config(pulumi_mocks.stack_file_config("prod"))
    return templating.render(
        "startup/serve.sh.j2", **startup.serve_context(cfg, roles.SERVE)
    ), sizing.serving_shm_bytes(cfg)


@pytest.mark.parametrize("role", ["train", "serve"])
def test_a_big_enough_shm_is_left_alone(host, role):
    script, needed = _script(role)
    host.set_ram(4 * needed)
    host.set_shm(2 * needed)
    rc, output = host.run(script)
    assert rc == 0, output
    assert not host.mount_calls.exists()
    assert host.shm() == 2 * needed


def test_the_v5p_hosts_default_shm_holds_the_training_stack_with_the_merge():
    """The documented v5p host (448 GB) boots with a 224 GB /dev/shm: base + merged weights +
    working set (157 GB for the checked-in stacks) fit without growing it."""
    cfg = stack_config.parse_stack_config(pulumi_mocks.stack_file_config("prod"))
    v5p = catalog.accelerator("v5p-8")
    assert v5p.shm_bytes == 224 * 10**9
    assert sizing.training_shm_bytes(cfg) <= v5p.shm_bytes


@pytest.mark.parametrize("role", ["train", "serve"])
def test_a_small_shm_on_a_host_with_the_ram_is_grown(host, role):
    script, needed = _script(role)
    host.set_ram(2 * needed)  # 75% of it is room enough
    host.set_shm(needed // 4)
    rc, output = host.run(script)
    assert rc == 0, output
    assert host.mount_calls.read_text().split() == [
        "-o",
        f"remount,size={needed}",
        str(host.path / "shm"),
    ]
    assert host.shm() == needed
    assert f"grown from {(needed // 4) >> 30} GiB to {needed >> 30} GiB" in output
    # The next boot finds it big enough: no second remount.
    host.mount_calls.unlink()
    rc, output = host.run(script)
    assert rc == 0 and not host.mount_calls.exists(), output


@pytest.mark.parametrize(
    ("role", "key"), [("train", "training.shmWorkingSetGb"), ("serve", "serving.shmWorkingSetGb")]
)
def test_a_host_without_the_ram_stops_before_staging_naming_the_key(host, role, key):
    script, needed = _script(role)
    ram = needed  # 75% of it is too little
    host.set_ram(ram)
    host.set_shm(ram // 2)
    rc, output = host.run(script)
    assert rc == 1
    assert not host.mount_calls.exists()
    line = next(line for line in output.splitlines() if key in line)
    assert (
        f"{key}: {host.path / 'shm'} must hold {needed >> 30} GiB but is {(ram // 2) >> 30} GiB "
        f"and this host's {ram >> 30} GiB of RAM allow at most {(ram * 75 // 100) >> 30} GiB"
    ) in line
    assert f"lower {key}" in line
