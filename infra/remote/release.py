"""The remote commands that build, verify, activate and prune a release on a worker.

A release is one deployed version in its own directory (RemoteLayout.release_dir): nothing in it
is shared with another version, so building one never touches what runs. Each command here is
idempotent and safe to kill at any instant:

- build: wipes whatever an interrupted build left in the directory, then creates the venv and
  installs the wheel. Never the active release (refused).
- verify: the package's files are as pip installed them (its RECORD), it imports from the
  release's own venv and reads the release's run config;
  only then is the `COMPLETE` marker written (atomically, after the files are on disk). A
  directory without it is garbage, removed by the next prune.
- switch: `current` is replaced with one rename(2), and only to a complete release.
- prune: removes every release but the active one and the names asked for; a directory is
  renamed away before it is deleted, so a half-deleted one never looks complete. Entries that
  are not release names (a mount point's lost+found) are left alone.

Each function returns an argv list (`sh -c SCRIPT sh ARGS...`): the paths travel as arguments,
never pasted into the script.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence

from infra.vm.layout import RemoteLayout

MARKER = "COMPLETE"
# A release is named by the first hex digits of its bundle's fingerprint (Bundle.release); prune
# touches nothing else in the releases directory.
NAME_LENGTH = 16
NAME_GLOB = "[0-9a-f]" * NAME_LENGTH

# Why a venv per release, layered on the base venv with a .pth that runs site.addsitedir:
# - the release's own site-packages comes first on sys.path, so its `workloads` shadows anything
#   an older deploy installed into the base venv (even a broken one, e.g. a dist-info without
#   RECORD that a kill during `pip install --force-reinstall` left behind);
# - pip, running in the release venv, sees the base venv's packages as installed, so with
#   install_deps it adds only what the base lacks, into the release, and never modifies the base;
# - addsitedir (not a plain path line) also processes the base's own .pth files.
# `pip install --target` would ignore the installed packages and copy the whole JAX stack into
# every release; `venv --system-site-packages` layers on the system Python, not on the base venv.
_BUILD = r"""set -eu
base_python=$1 release=$2 wheel=$3 deps=$4 current=$5
active=$(readlink "$current" 2>/dev/null || true)
# An active release without its marker (deleted, or unmarked because its package no longer
# imports) runs nothing that works: rebuilding it is the repair.
if [ "${active##*/}" = "${release##*/}" ] && [ -e "$release/COMPLETE" ]; then
    echo "$release is the active release: not rebuilding it" >&2
    exit 1
fi
rm -rf -- "$release"
mkdir -m 0755 -- "$release"
"$base_python" -m venv --without-pip "$release/venv"
purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])'
base_site=$("$base_python" -c "$purelib")
site=$("$release/venv/bin/python" -c "$purelib")
"$base_python" -c 'import sys; print("import site; site.addsitedir(%r)" % sys.argv[1])' \
    "$base_site" >"$site/_gemma4_base_venv.pth"
install -m 0644 "$wheel" "$release/"
pip_install() {
    "$release/venv/bin/python" -m pip install --disable-pip-version-check --no-input "$@"
}
# --ignore-installed: a same-version gemma4-tpu in the base venv must not count as installed.
pip_install --no-deps --ignore-installed "$release/${wheel##*/}"
if [ "$deps" = 1 ]; then pip_install "$release/${wheel##*/}"; fi
"""

# Run by the release's interpreter: the package it imports must be the release's own, and every
# file pip installed for it must still be there as installed. Importing a few modules cannot see
# a deleted or edited module that they do not import; the RECORD pip wrote (a sha256 per file)
# can, and hashing the package's ~1 MB costs a few milliseconds. Bytecode is left out: Python
# may rewrite it, and it is rebuilt from the sources it would differ from.
_IMPORTS = """import base64, hashlib, os, sys
from importlib import metadata
import workloads, workloads.cli, workloads.contract.runconfig
home = os.path.realpath(sys.prefix) + os.sep
where = os.path.realpath(workloads.__file__)
if not where.startswith(home):
    sys.exit(f"workloads was imported from {where}, not from the release venv {home}")
site = os.path.dirname(os.path.dirname(where))
dists = list(metadata.distributions(name="gemma4-tpu", path=[site]))
if len(dists) != 1 or dists[0].files is None:
    sys.exit(f"{site} holds {len(dists)} gemma4-tpu distributions with a RECORD, not one")
for file in dists[0].files:
    if file.hash is None or file.suffix == ".pyc":
        continue
    try:
        data = file.locate().read_bytes()
    except OSError:
        sys.exit(f"{file} is missing")
    digest = base64.urlsafe_b64encode(hashlib.new(file.hash.mode, data).digest()).rstrip(b"=")
    if digest.decode() != file.hash.value:
        sys.exit(f"{file} differs from what was installed")
"""
# verify also reads the run config (0600, root's on the VMs: the check before a deploy, run as
# the login user, stops at the imports).
_IMPORT_CHECK = _IMPORTS + "workloads.contract.runconfig.load(sys.argv[1])\n"

_VERIFY = r"""set -eu
release=$1 fingerprint=$2 check=$3
shift 3
for unit in "$@"; do
    if [ ! -s "$release/units/$unit" ]; then echo "$release/units/$unit is missing" >&2; exit 1; fi
done
if ! "$release/venv/bin/python" -c "$check" "$release/run.yaml"; then
    rm -f -- "$release/COMPLETE"
    exit 1
fi
# The marker is only worth something once the files it vouches for are on disk.
sync -f "$release/run.yaml"
printf '%s\n' "$fingerprint" >"$release/COMPLETE.part"
mv -f -- "$release/COMPLETE.part" "$release/COMPLETE"
"""

_SWITCH = r"""set -eu
release=$1 target=$2 current=$3 config_link=$4 active_config=$5
if [ ! -e "$release/COMPLETE" ]; then echo "$release is not complete" >&2; exit 1; fi
ln -sfn -- "$target" "$current.part"
mv -Tf -- "$current.part" "$current"
ln -sfn -- "$active_config" "$config_link.part"
mv -Tf -- "$config_link.part" "$config_link"
"""

_PRUNE = r"""set -eu
releases=$1 current=$2 name_pattern=$3
shift 3
[ -d "$releases" ] || exit 0
cd "$releases"
active=$(readlink "$current" 2>/dev/null || true)
active=${active##*/}
for entry in * .[!.]*; do
    if [ ! -e "$entry" ] && [ ! -L "$entry" ]; then continue; fi
    case "$entry" in
        .prune-*) rm -rf -- "$entry"; continue ;;
        $name_pattern) ;;
        *) continue ;;  # not ours (lost+found of a mount point, ...)
    esac
    if [ "$entry" = "$active" ]; then continue; fi
    keep=0
    if [ -e "$entry/COMPLETE" ]; then
        for name in "$@"; do if [ "$entry" = "$name" ]; then keep=1; fi; done
    fi
    if [ "$keep" = 1 ]; then continue; fi
    rm -rf -- ".prune-$entry"
    mv -Tf -- "$entry" ".prune-$entry"
    rm -rf -- ".prune-$entry"
done
exit 0
"""


def build(
    layout: RemoteLayout, release: str, staged_wheel: str, *, install_deps: bool
) -> list[str]:
    """(Re)creates the release's venv and installs the staged wheel into it."""
    return [
        "sh",
        "-c",
        _BUILD,
        "sh",
        layout.python,
        layout.release_dir(release),
        staged_wheel,
        "1" if install_deps else "0",
        layout.current,
    ]


def verify(layout: RemoteLayout, release: str, fingerprint: str, units: Sequence[str]) -> list[str]:
    """Checks the release's units, package and config, then marks it complete."""
    return [
        "sh",
        "-c",
        _VERIFY,
        "sh",
        layout.release_dir(release),
        fingerprint,
        _IMPORT_CHECK,
        *units,
    ]


def import_check() -> str:
    """The script the release's own interpreter runs to show that its package imports from its
    own venv (what a deploy's check asks of the active release before calling it up to date)."""
    return _IMPORTS


def unmark(layout: RemoteLayout, release: str) -> list[str]:
    """Removes the release's COMPLETE marker (its package no longer imports): build may then
    rebuild it even while it is the active one."""
    return ["rm", "-f", "--", posixpath.join(layout.release_dir(release), MARKER)]


def move_aside(path: str, suffix: str) -> list[str]:
    """Renames `path` (a `current` that is not a symlink) to `<path>.<suffix>`, kept for a look."""
    return ["mv", "-T", "--", path, f"{path}.{suffix}"]


def switch(layout: RemoteLayout, release: str) -> list[str]:
    """Points `current` (and the stable run-config link) at a complete release."""
    path = layout.release_dir(release)
    return [
        "sh",
        "-c",
        _SWITCH,
        "sh",
        path,
        posixpath.relpath(path, posixpath.dirname(layout.current)),
        layout.current,
        layout.config_path,
        layout.active_config,
    ]


def prune(layout: RemoteLayout, keep: Sequence[str]) -> list[str]:
    """Removes every release but the active one and the complete ones named in `keep`."""
    return ["sh", "-c", _PRUNE, "sh", layout.releases_dir, layout.current, NAME_GLOB, *keep]


def is_release_name(name: str) -> bool:
    """Whether an entry of the releases directory is a release (or one being pruned)."""
    return name.startswith(".prune-") or (
        len(name) == NAME_LENGTH and all(c in "0123456789abcdef" for c in name)
    )
