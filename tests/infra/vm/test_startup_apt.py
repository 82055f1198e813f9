"""apt on a first boot, for real in bash: every apt call of the training startup script waits for
the apt-daily run that holds apt's locks, add-apt-repository (which runs its own `apt update`)
included, instead of failing on the lock it would find held."""

from __future__ import annotations

import pathlib

from infra.config import stack_config
from infra.vm import roles, startup, templating
from tests.fixtures import pulumi_mocks
from tests.infra.vm.test_startup_idempotent import _run

# Each apt tool fails as apt does while another apt holds its locks ($FAKE_GCS/apt-held), and
# records whether it ran with the locks held.
FAKE_APT_TOOL = r"""#!/bin/bash
name=$(basename "$0")
if [ -e "$FAKE_GCS/apt-held" ]; then
  echo "$name $* (locked)" >>"$FAKE_GCS/apt-calls"
  echo "E: Could not get lock /var/lib/apt/lists/lock. It is held by process 42 (apt-get)" >&2
  exit 100
fi
echo "$name $*" >>"$FAKE_GCS/apt-calls"
"""
# Every package but the PPA's Python counts as installed.
FAKE_DPKG_QUERY = r"""#!/bin/bash
case "$*" in *python3.11*) exit 1 ;; esac
printf 'install ok installed'
"""
# apt-daily lets go of the locks after the third look.
LOCK_RELEASED_LATER = r"""
apt_locks_free() {
  looks=$(( $(cat "$FAKE_GCS/looks" 2>/dev/null || echo 0) + 1 ))
  echo "$looks" >"$FAKE_GCS/looks"
  if [ "$looks" -ge 3 ]; then rm -f "$FAKE_GCS/apt-held"; fi
  [ ! -e "$FAKE_GCS/apt-held" ]
}
"""


def test_add_apt_repository_waits_for_apt_daily_like_every_apt_call(
    tmp_path: pathlib.Path,
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {
        "add-apt-repository": FAKE_APT_TOOL,
        "apt-get": FAKE_APT_TOOL,
        "dpkg-query": FAKE_DPKG_QUERY,
    }.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    gcs = tmp_path / "gcs"
    gcs.mkdir()
    cfg = stack_config.parse_stack_config(pulumi_mocks.stack_file_config("dev"))
    context = startup.train_context(cfg, roles.TRAIN, has_hf_secret=True)
    # A Python that is not there: the deadsnakes path of an Ubuntu 22.04 image.
    context |= {"python": "python3.11-absent", "log_file": str(tmp_path / "startup.log")}
    script = templating.render("startup/train.sh.j2", **context)
    # Only the PPA itself runs: the packages after it are installed.
    (gcs / "apt-held").touch()
    call = (
        LOCK_RELEASED_LATER
        + "grep() { if [ \"$*\" = '-rqs deadsnakes /etc/apt/sources.list.d/' ]; then return 1; fi; "
        + 'command grep "$@"; }; ensure_python'
    )

    rc, out = _run(tmp_path, script, call)

    calls = (gcs / "apt-calls").read_text().splitlines()
    assert rc == 0, out
    assert [c for c in calls if "(locked)" in c] == [], out
    assert any(c.startswith("add-apt-repository -y ppa:deadsnakes/ppa") for c in calls), calls
    assert "waiting for apt's lock" in out
