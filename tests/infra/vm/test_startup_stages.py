"""The training startup script's stages and what runs after ready, for real in bash against fakes
of `gcloud`, `hf`, `systemd-run`, `systemctl` and Python 3.11 on PATH.

- every stage is a start and an end line in the stages file, in the format
  workloads.common.stage_records reads (a stage set -e stopped is ended "ok": false);
- the hub download uses Xet's high-performance mode and all shards at once, and does not
  upload: the upload runs after ready as its own unit, its marker written last; an upload cut
  short leaves no marker, so the next VM downloads again instead of using a partial copy;
- the venv comes from the bucket's archive for the lock's digest when its SHA-256 matches; a
  corrupt, partial or foreign archive falls back to a fresh install by uv; the first VM uploads
  it after ready.
"""

from __future__ import annotations

import hashlib
import pathlib
import subprocess

import pytest

from infra.config import stack_config
from infra.vm import roles, startup, templating
from tests.fixtures import pulumi_mocks
from tests.infra.vm.test_startup_idempotent import _functions, _run
from workloads.common import stage_records

DIGEST_KEY = "requirements_digest"

# gs://X is $FAKE_GCS/X; every call is logged to $FAKE_GCS/calls. `fail-<verb>` files make
# that verb fail (a network error), for the interrupted cases.
FAKE_GCLOUD = r"""#!/bin/bash
set -euo pipefail
printf '%s\n' "$*" >>"$FAKE_GCS/calls"
local_path() { printf '%s/%s' "$FAKE_GCS" "${1#gs://}"; }
verb="$1 $2"
shift 2
case "$verb" in
  "secrets versions") echo "hf_faketoken" ;;
  "storage ls")
    # A bucket's own listing answers unless the test made it unreachable.
    case "$1" in
      gs://*/*) [ ! -e "$FAKE_GCS/unreachable" ] && [ -e "$(local_path "$1")" ] ;;
      *) [ ! -e "$FAKE_GCS/unreachable" ] ;;
    esac ;;
  "storage cp")
    if [ "$1" = --quiet ]; then shift; fi
    if [ -e "$FAKE_GCS/fail-cp" ]; then echo "network error" >&2; exit 1; fi
    if [ "$1" = - ]; then mkdir -p "$(dirname "$(local_path "$2")")"; cat >"$(local_path "$2")"
    elif [[ "$1" == gs://* ]]; then cp "$(local_path "$1")" "$2"
    else mkdir -p "$(dirname "$(local_path "$2")")"; cp "$1" "$(local_path "$2")"; fi ;;
  "storage rsync")
    if [ -e "$FAKE_GCS/fail-rsync" ]; then
      # Cut short: one file made it.
      args=(); for a in "$@"; do case "$a" in --*) ;; *) args+=("$a") ;; esac; done
      if [[ "${args[1]}" == gs://* ]]; then
        mkdir -p "$(local_path "${args[1]}")"
        cp "$(ls -d "${args[0]}"/*.safetensors | head -n 1)" "$(local_path "${args[1]}")/"
      fi
      echo "network error" >&2; exit 1
    fi
    args=() skip=no-such-file
    for a in "$@"; do
      case "$a" in --exclude=*safetensors*) skip='*.safetensors' ;; --*) ;; *) args+=("$a") ;; esac
    done
    if [[ "${args[0]}" == gs://* ]]; then src=$(local_path "${args[0]}"); dst=${args[1]}
    else src=${args[0]}; dst=$(local_path "${args[1]}"); fi
    mkdir -p "$dst"
    (cd "$src" && find . -path ./.cache -prune -o -type f ! -name "$skip" -print |
      while read -r f; do mkdir -p "$dst/$(dirname "$f")"; cp "$f" "$dst/$f"; done) ;;
  *) echo "fake gcloud: unexpected $verb" >&2; exit 2 ;;
esac
"""
# `hf download REPO --local-dir DIR ...`: two shards and a config (the config only with
# `--exclude *.safetensors`), and what it was asked. FAKE_HF_SECONDS: the shards take that long;
# a file $FAKE_GCS/fail-hf-shards makes the shards' download fail.
FAKE_HF = r"""#!/bin/bash
printf '%s HF_XET_HIGH_PERFORMANCE=%s\n' "$*" "${HF_XET_HIGH_PERFORMANCE:-}" >>"$FAKE_GCS/hf-calls"
dir=$(printf '%s\n' "$@" | sed -n '/^--local-dir$/{n;p}')
mkdir -p "$dir/.cache"
echo '{"model_type": "gemma4"}' >"$dir/config.json"
case "$*" in *"--exclude *.safetensors"*) exit 0 ;; esac
if [ -n "${FAKE_HF_SECONDS:-}" ]; then /bin/sleep "$FAKE_HF_SECONDS"; fi
if [ -e "$FAKE_GCS/fail-hf-shards" ]; then echo "network error" >&2; exit 1; fi
echo shard1 >"$dir/model-00001-of-00002.safetensors"
echo shard2 >"$dir/model-00002-of-00002.safetensors"
"""
# Runs the unit's command in the foreground (the test waits for it), after recording the call.
FAKE_SYSTEMD_RUN = r"""#!/bin/bash
printf '%s\n' "$*" >>"$FAKE_GCS/systemd-run-calls"
while [[ "$1" == --* ]]; do shift; done
"$@"
"""
FAKE_SYSTEMCTL = "#!/bin/bash\nexit 3\n"  # is-active: inactive
# `python3.11 -m venv DIR` makes a venv whose python records pip calls (a fresh install).
# pip installing uv puts the fake `uv` into that venv.
FAKE_PYTHON = r"""#!/bin/bash
if [ "$1 $2" = "-m venv" ]; then
  mkdir -p "$3/bin"
  cat >"$3/bin/python" <<'PY'
#!/bin/bash
printf '%s\n' "$*" >>"$FAKE_GCS/pip-calls"
case "$*" in *" uv=="*) cp "$FAKE_GCS/../bin/fake-uv" "$(dirname "$0")/uv" ;; esac
PY
  chmod +x "$3/bin/python"
  exit 0
fi
exec /usr/bin/python3 "$@"
"""
# `uv pip install ... --python VENV/bin/python ...`: records the call; installing huggingface-hub
# puts the fake `hf` into VENV.
FAKE_UV = r"""#!/bin/bash
if [ "$1" = --version ]; then echo "uv @VERSION@"; exit 0; fi
printf '%s UV_PYTHON_DOWNLOADS=%s\n' "$*" "${UV_PYTHON_DOWNLOADS:-}" >>"$FAKE_GCS/uv-calls"
python=$(printf '%s\n' "$@" | sed -n '/^--python$/{n;p}')
case "$*" in *huggingface-hub*) cp "$FAKE_GCS/../bin/hf" "$(dirname "$python")/hf" ;; esac
"""
UV_VERSION = startup.pinned("uv").split("==")[1]


@pytest.fixture
def vm(tmp_path: pathlib.Path):
    """A fake training VM under tmp_path: its script (rendered with paths moved there), its
    fakes on PATH and its bucket (tmp_path/gcs/bucket)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fakes = {
        "gcloud": FAKE_GCLOUD,
        "systemd-run": FAKE_SYSTEMD_RUN,
        "systemctl": FAKE_SYSTEMCTL,
        "python3.11": FAKE_PYTHON,
        "fake-uv": FAKE_UV.replace("@VERSION@", UV_VERSION),
        "sleep": "#!/bin/sh\n",  # retry's backoff
    }
    for name, text in fakes.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "gcs").mkdir()
    (tmp_path / "boot_id").write_text("boot-1\n")
    (tmp_path / "uptime").write_text("42.50 80.00\n")
    return VM(tmp_path)


class VM:
    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self.stage = root / "shm" / "models" / "base"
        self.venv = root / "opt" / "venv"
        self.hub_venv = root / "opt" / "venv-hub"
        self.state = root / "state"
        self.state.mkdir()
        (root / "shm").mkdir()
        cfg = stack_config.parse_stack_config(pulumi_mocks.stack_file_config("dev"))
        context = startup.train_context(cfg, roles.TRAIN, has_hf_secret=True)
        self.digest = context[DIGEST_KEY]
        self.archive = f"gs://bucket/venv/train-{self.digest}.tar.gz"
        context |= {
            "stage_dir": str(self.stage),
            "model_uri": "gs://bucket/models/gemma-4-31b",
            "model_marker_uri": "gs://bucket/models/gemma-4-31b.complete",
            "venv_archive_uri": self.archive,
            "venv_dir": str(self.venv),
            "python": "python3.11",
            "tmpdir": str(root / "shm"),
            "state_dir": str(self.state),
            "stages_file": str(self.state / "stages.jsonl"),
            "script_copy": str(self.state / "startup.sh"),
            "log_file": str(root / "startup.log"),
            "ready_marker": str(self.state / "ready"),
            "env_file": str(self.state / "env"),
            "boot_failed_marker": str(self.state / "boot-failed"),
            "boot_failed_note": str(self.state / "boot-failed-note"),
        }
        self.script = templating.render("startup/train.sh.j2", **context)
        (self.state / "startup.sh").write_text(self.script)
        (root / "bin" / "hf").write_text(FAKE_HF)
        (root / "bin" / "hf").chmod(0o755)

    def run(self, call: str) -> tuple[int, str]:
        exports = (
            f"export BOOT_ID_FILE={self.root / 'boot_id'} UPTIME_FILE={self.root / 'uptime'}; "
        )
        return _run(self.root, self.script, exports + call)

    def bucket(self, *parts: str) -> pathlib.Path:
        return self.root.joinpath("gcs", "bucket", *parts)

    def calls(self, name: str = "calls") -> list[str]:
        path = self.root / "gcs" / name
        return path.read_text().splitlines() if path.exists() else []

    def rows(self) -> dict[str, dict]:
        records = stage_records.read_records(str(self.state / "stages.jsonl"))
        return {row["stage"]: row for row in stage_records.summarise(records)}

    def new_vm(self) -> None:
        """The VM is replaced: a new disk and RAM, the same bucket."""
        for path in (self.stage, self.venv, self.hub_venv):
            subprocess.run(["rm", "-rf", str(path)], check=True)
        pathlib.Path(f"{self.stage}.staged").unlink(missing_ok=True)
        (self.state / "stages.jsonl").unlink(missing_ok=True)
        (self.root / "boot_id").write_text("boot-2\n")


def test_stages_are_json_lines_workloads_stages_reads_and_a_stopped_stage_is_not_ok(vm):
    call = (
        'stage_start boot "$(kernel_boot_time)"; stage_end true; '
        "noted() { STAGE_NOTE='cached \"x\"'; }; stage venv noted; "
        "trap 'stage_end false \"the startup script stopped here\"' EXIT; "
        "stage weights false"
    )
    rc, output = vm.run(call)
    assert rc != 0, output
    records = stage_records.read_records(str(vm.state / "stages.jsonl"))
    assert len(records) == 6  # every line is valid JSON
    assert {r["boot"] for r in records} == {"boot-1"} and {r["source"] for r in records} == {
        "startup"
    }
    rows = vm.rows()
    assert list(rows) == ["boot", "venv", "weights"]
    assert rows["boot"]["seconds"] == pytest.approx(42.5, abs=0.5)  # the boot clock's uptime
    assert rows["venv"]["note"] == 'cached "x"' and rows["venv"]["state"] == "done"
    assert rows["weights"]["state"] == "failed"
    assert rows["weights"]["note"] == "the startup script stopped here"
    assert "stage venv: " in output


def test_the_hub_download_is_fast_and_its_upload_runs_after_ready_marker_last(vm):
    _fresh_venv(vm)
    rc, output = vm.run("ensure_uv; stage weights ensure_base_model 0")
    assert rc == 0, output
    files_call, hf_call = vm.calls("hf-calls")  # the small files first, then the rest
    assert f"--local-dir {vm.stage} --max-workers 16 --exclude *.safetensors" in files_call
    assert f"--local-dir {vm.stage} --max-workers 16 " in hf_call
    assert hf_call.endswith("HF_XET_HIGH_PERFORMANCE=1")
    assert pathlib.Path(f"{vm.stage}.staged").exists()
    assert pathlib.Path(f"{vm.stage}.files").exists()
    assert not pathlib.Path(f"{vm.stage}.staging").exists()
    # Nothing went to the bucket before ready.
    assert not any(c.startswith(("storage rsync", "storage cp")) for c in vm.calls())
    assert vm.rows()["weights"]["note"] == "from the hub (google/gemma-4-31B-it)"

    # After ready: the uploads run as their own unit (the fake runs it in the foreground).
    rc, output = vm.run("start_uploads 0")
    assert rc == 0, output
    (unit,) = vm.calls("systemd-run-calls")
    assert unit.startswith("--unit=gemma4-uploads --collect")
    assert unit.endswith(f"/bin/bash {vm.state / 'startup.sh'} uploads")
    assert sorted(p.name for p in vm.bucket("models", "gemma-4-31b").iterdir()) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]  # the hub's .cache is not uploaded
    assert vm.bucket("models", "gemma-4-31b.complete").read_text() == "google/gemma-4-31B-it\n"
    calls = vm.calls()
    rsync = max(i for i, c in enumerate(calls) if c.startswith("storage rsync"))
    marker = calls.index("storage cp - gs://bucket/models/gemma-4-31b.complete")
    assert marker > rsync  # the marker is written last
    rows = vm.rows()
    assert rows["weights_upload"]["state"] == "done" and rows["weights_upload"]["source"] == (
        "upload"
    )

    # A later boot of a new VM: the bucket's copy, no hub download, no upload.
    vm.new_vm()
    rc, output = vm.run("ensure_uv; stage weights ensure_base_model 0; start_uploads 0")
    assert rc == 0, output
    assert len(vm.calls("hf-calls")) == 2
    assert (vm.stage / "model-00002-of-00002.safetensors").read_text() == "shard2\n"
    assert vm.rows()["weights"]["note"] == "from gs://bucket/models/gemma-4-31b"


def test_the_hub_client_is_pinned_in_its_own_venv_and_kept_across_boots(vm):
    rc, output = vm.run("ensure_uv; stage weights ensure_base_model 0")
    assert rc == 0, output
    (install,) = vm.calls("uv-calls")
    constraints = vm.hub_venv / "gemma4-constraints.txt"
    assert install == (
        f"pip install -q --no-cache --compile-bytecode --python {vm.hub_venv}/bin/python "
        f"-c {constraints} huggingface-hub hf-xet UV_PYTHON_DOWNLOADS=never"
    )
    pins = constraints.read_text().splitlines()
    assert "huggingface-hub==1.33.0" in pins and "hf-xet==1.8.0" in pins  # the lock's pins
    assert not vm.venv.exists()  # the main venv is not needed for the download
    pathlib.Path(f"{vm.stage}.staged").unlink()  # the next boot downloads again ...
    rc, output = vm.run("ensure_uv; stage weights ensure_base_model 0")
    assert rc == 0, output
    assert len(vm.calls("hf-calls")) == 4  # two downloads of the small files, then the rest
    assert len(vm.calls("uv-calls")) == 1  # ... with the client it has


def test_the_boot_failed_marker_quotes_the_failing_steps_words_though_the_log_lags(vm):
    """The log reaches its file through tee, which can be behind the script when the script
    exits (a busy host): the marker, the one line the deploy prints, still names the cause."""
    (vm.root / "bin" / "tee").write_text('#!/bin/sh\n/bin/sleep 1\nexec /usr/bin/tee "$@"\n')
    (vm.root / "bin" / "tee").chmod(0o755)
    call = (
        'sleep() { /bin/sleep "$@"; }; keep_script() { :; }; report_boot_failure() { :; }; '
        'refuse() { log "training.shmWorkingSetGb: 200 GiB does not fit" >&2; return 3; }; '
        "begin; stage shm refuse"
    )
    rc, output = vm.run(call)
    assert rc == 3, output
    marker = (vm.state / "boot-failed").read_text()
    assert marker.startswith("stage shm failed (exit 3) at "), marker
    assert marker.rstrip().endswith(
        f"training.shmWorkingSetGb: 200 GiB does not fit; log {vm.root / 'startup.log'}"
    ), marker
    assert (vm.state / "boot-failed-note").read_text() == marker
    assert not (vm.state / "ready").exists()


# `boot` with what needs a real VM replaced: no console tee or lock, worker 0, a venv stage that
# takes a second; the hub download takes a second too (FAKE_HF_SECONDS).
BOOT_ON_A_FAKE_VM = (
    'begin() { rm -f "$READY_MARKER"; trap \'stage_end false "stopped"\' EXIT; }; '
    "worker_number() { echo 0; }; worker_endpoints() { echo 10.0.0.2; }; "
    "instance_zone() { echo us-east5-a; }; ensure_shm() { :; }; "
    "ensure_python() { :; }; ensure_venv() { /bin/sleep 1; STAGE_NOTE=installed; }; "
    "write_env() { :; }; start_uploads() { :; }; "
)


def test_the_weights_download_runs_beside_the_venv_install_and_ready_does_not_wait_for_it(vm):
    """The shards take 3 s, the venv 1 s: ready comes once the venv and the small files are
    there, and the boot then waits for the weights (the trainer waits for .staged)."""
    rc, output = vm.run(f"export FAKE_HF_SECONDS=3; {BOOT_ON_A_FAKE_VM} boot")
    assert rc == 0, output
    rows = vm.rows()
    weights, venv = rows["weights"], rows["venv"]
    assert weights["state"] == venv["state"] == "done"
    assert weights["note"] == "from the hub (google/gemma-4-31B-it)"
    # Side by side: each started before the other ended.
    weights_end = weights["start"] + weights["seconds"]
    venv_end = venv["start"] + venv["seconds"]
    assert weights["start"] < venv_end and venv["start"] < weights_end, rows
    ready = (vm.state / "ready").stat().st_mtime
    staged = pathlib.Path(f"{vm.stage}.staged").stat().st_mtime
    assert venv_end <= ready + 0.5 and ready < staged - 1, (ready, staged, rows)
    assert not pathlib.Path(f"{vm.stage}.staging").exists()
    assert not pathlib.Path(f"{vm.stage}.failed").exists()


def test_weights_that_fail_after_ready_leave_the_reason_for_the_trainer(vm):
    (vm.root / "gcs" / "fail-hf-shards").touch()
    rc, output = vm.run(f"{BOOT_ON_A_FAKE_VM} boot")
    assert rc != 0, output
    assert (vm.state / "ready").exists()  # the config and tokenizer came first
    assert "the trainer stops with its reason" in output
    failed = pathlib.Path(f"{vm.stage}.failed").read_text()
    assert failed.startswith(f"the weights stage stopped ({vm.root / 'startup.log'} on ")
    assert not pathlib.Path(f"{vm.stage}.staged").exists()
    assert not pathlib.Path(f"{vm.stage}.staging").exists()
    assert vm.rows()["weights"]["state"] == "failed"


def test_a_failed_weights_stage_fails_the_boot_before_ready(vm):
    vm.bucket("models", "gemma-4-31b").mkdir(parents=True)
    vm.bucket("models", "gemma-4-31b", "config.json").write_text("{}")
    vm.bucket("models", "gemma-4-31b.complete").write_text("x\n")
    (vm.root / "gcs" / "fail-rsync").touch()  # the bucket's copy cannot be read
    rc, output = vm.run(f"{BOOT_ON_A_FAKE_VM} boot")
    assert rc != 0, output
    assert "the weights stage failed" in output
    assert not (vm.state / "ready").exists()
    assert pathlib.Path(f"{vm.stage}.failed").exists()
    rows = vm.rows()
    assert rows["venv"]["state"] == "done"
    assert (rows["weights"]["state"], rows["weights"]["note"]) == (
        "failed",
        "the startup script stopped here",
    )


def test_an_upload_cut_short_leaves_no_marker_and_the_next_vm_downloads_again(vm):
    _fresh_venv(vm)
    rc, output = vm.run("ensure_uv; stage weights ensure_base_model 0")
    assert rc == 0, output
    (vm.root / "gcs" / "fail-rsync").touch()
    rc, output = vm.run("start_uploads 0")
    assert "network error" in (vm.root / "startup.log").read_text()
    assert vm.bucket("models", "gemma-4-31b").is_dir()  # part of it made it ...
    assert not vm.bucket("models", "gemma-4-31b.complete").exists()  # ... and is not complete
    upload = vm.rows()["weights_upload"]
    assert (upload["state"], upload["note"]) == ("failed", "the upload stopped here")

    # The next VM does not use the partial copy: it downloads from the hub, and uploads after.
    (vm.root / "gcs" / "fail-rsync").unlink()
    vm.new_vm()
    _fresh_venv(vm)
    rc, output = vm.run("ensure_uv; stage weights ensure_base_model 0")
    assert rc == 0, output
    assert len(vm.calls("hf-calls")) == 4  # two boots, each the small files then the rest
    assert not any(c.startswith("storage rsync gs://") for c in vm.calls())
    rc, output = vm.run("start_uploads 0")
    assert rc == 0, output
    assert vm.bucket("models", "gemma-4-31b.complete").exists()


def _fresh_venv(vm: VM) -> None:
    """What a pip install leaves: a venv whose python works, stamped with the digest."""
    (vm.venv / "bin").mkdir(parents=True, exist_ok=True)
    (vm.venv / "bin" / "python").symlink_to("/usr/bin/python3")
    (vm.venv / "lib").mkdir()
    (vm.venv / "lib" / "pkg.py").write_text("VALUE = 1\n")
    (vm.venv / ".gemma4-requirements").write_text(vm.digest + "\n")


def test_the_first_vm_uploads_its_venv_and_the_next_restores_it_verified(vm):
    _fresh_venv(vm)
    (vm.root / "gcs" / "bucket" / "models").mkdir(parents=True)
    (vm.root / "gcs" / "bucket" / "models" / "gemma-4-31b.complete").write_text("x\n")
    rc, output = vm.run("start_uploads 0")
    assert rc == 0, output
    archive = vm.bucket("venv", f"train-{vm.digest}.tar.gz")
    recorded = vm.bucket("venv", f"train-{vm.digest}.tar.gz.sha256").read_text().split()[0]
    assert recorded == hashlib.sha256(archive.read_bytes()).hexdigest()
    calls = [c for c in vm.calls() if c.startswith("storage cp")]
    sha_upload = next(i for i, c in enumerate(calls) if c.endswith(".tar.gz.sha256"))
    tar_upload = next(i for i, c in enumerate(calls) if c.endswith(".tar.gz"))
    assert tar_upload < sha_upload  # the checksum, the completion marker, last
    assert vm.rows()["venv_upload"]["state"] == "done"

    vm.new_vm()
    rc, output = vm.run("stage venv ensure_venv")
    assert rc == 0, output
    assert (vm.venv / "lib" / "pkg.py").read_text() == "VALUE = 1\n"
    assert (vm.venv / ".gemma4-requirements").read_text().strip() == vm.digest
    assert vm.calls("pip-calls") == [] and vm.calls("uv-calls") == []  # no install at all
    assert vm.rows()["venv"]["note"] == f"restored from {vm.archive}"
    assert not pathlib.Path(f"{vm.venv}.restore").exists()

    # The next boot of the same VM: the venv is kept as it is.
    rc, output = vm.run("stage venv ensure_venv")
    assert rc == 0 and vm.rows()["venv"]["note"] == "up to date", output


@pytest.mark.parametrize("damage", ["corrupt", "partial", "foreign", "download fails"])
def test_a_bad_archive_falls_back_to_a_fresh_install(vm, damage):
    _fresh_venv(vm)
    (vm.root / "gcs" / "bucket" / "models").mkdir(parents=True)
    (vm.root / "gcs" / "bucket" / "models" / "gemma-4-31b.complete").write_text("x\n")
    if damage == "foreign":  # a venv for other pins under this name
        (vm.venv / ".gemma4-requirements").write_text("0000\n")
        subprocess.run(
            ["tar", "-czf", str(vm.root / "v.tgz"), "-C", str(vm.venv.parent), "venv"], check=True
        )
        vm.bucket("venv").mkdir(parents=True)
        archive = vm.bucket("venv", f"train-{vm.digest}.tar.gz")
        archive.write_bytes((vm.root / "v.tgz").read_bytes())
        sha = hashlib.sha256(archive.read_bytes()).hexdigest()
        vm.bucket("venv", f"train-{vm.digest}.tar.gz.sha256").write_text(f"{sha}  venv.tar.gz\n")
    else:
        rc, output = vm.run("start_uploads 0")
        assert rc == 0, output
    archive = vm.bucket("venv", f"train-{vm.digest}.tar.gz")
    if damage == "corrupt":
        data = bytearray(archive.read_bytes())
        data[len(data) // 2] ^= 0xFF
        archive.write_bytes(bytes(data))
    elif damage == "partial":  # the upload stopped before its checksum
        vm.bucket("venv", f"train-{vm.digest}.tar.gz.sha256").unlink()
    elif damage == "download fails":
        (vm.root / "gcs" / "fail-cp").touch()
    vm.new_vm()
    rc, output = vm.run("ensure_uv; stage venv ensure_venv")
    assert rc == 0, output
    fresh = f"pip install -q --no-cache --compile-bytecode --python {vm.venv}/bin/python -r"
    assert any(c.startswith(fresh) for c in vm.calls("uv-calls")), output
    assert (vm.venv / ".gemma4-requirements").read_text().strip() == vm.digest
    assert vm.rows()["venv"]["note"] == "installed by uv"
    assert not pathlib.Path(f"{vm.venv}.restore").exists()
    expected = {
        "corrupt": "is not the recorded",
        "partial": "no venv archive for",
        "foreign": "not a venv for",
        "download fails": "could not download",
    }[damage]
    assert expected in output


def test_other_workers_upload_nothing(vm):
    _fresh_venv(vm)
    rc, output = vm.run("start_uploads 1")
    assert rc == 0, output
    assert vm.calls("systemd-run-calls") == [] and vm.calls() == []


def test_without_a_copy_of_the_script_nothing_starts_and_the_boot_goes_on(vm):
    _fresh_venv(vm)
    (vm.state / "startup.sh").unlink()
    rc, output = vm.run("start_uploads 0")
    assert rc == 0, output
    assert f"{vm.state / 'startup.sh'} is missing: gemma4-uploads not started" in output
    assert vm.calls("systemd-run-calls") == []


def test_the_boot_keeps_the_script_it_runs_for_the_uploads(vm, tmp_path):
    """Run as the guest agent runs it ($0 is the script's file), the script keeps a copy."""
    (vm.state / "startup.sh").unlink()
    script = tmp_path / "startup-script"
    script.write_text(_functions(vm.script) + "keep_script\n")
    proc = subprocess.run(
        ["bash", str(script)],
        capture_output=True,
        text=True,
        env={"PATH": f"{vm.root / 'bin'}:/usr/bin:/bin", "FAKE_GCS": str(vm.root / "gcs")},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    kept = vm.state / "startup.sh"
    assert kept.read_text() == script.read_text()
    assert kept.stat().st_mode & 0o777 == 0o700
