"""A TPU VM of the local cloud: a Debian 12 machine wired to the cloud's services as a VM is.

What the machine gets, each standing in for what a real VM has from its image or the cloud:
- `metadata.google.internal` in /etc/hosts, naming this VM's own metadata server;
- the guest agent's two jobs as units (localcloud/guest/: accounts and startup-script);
- sshd listening on this VM's "external" address (a loopback address of its own: containers
  share the host's network);
- `gcloud` (localcloud/guest/gcloud) and, for every process, the environment that points gcsfs,
  TensorStore and that gcloud at the GCS protocol server;
- the CPU in place of the TPU: JAX on its CPU backend with 4 devices, the chips of a v5p-8 or of
  one v6e-8 replica's tensor-parallel group.
The product (scripts, units, workloads) is not changed: it meets these only as a VM would.
"""

from __future__ import annotations

import pathlib
import subprocess

from infra.tpu import api as tpu_api
from localcloud import metadata_server
from localcloud.machine import HOST_CA, Machine

GUEST = pathlib.Path(__file__).resolve().parent / "guest"
# The TPU's stand-in: JAX's CPU backend, split into the devices the mesh expects.
CPU_AS_TPU = {
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
}
STAND_INS = (
    "the TPU: JAX's CPU backend with 4 devices",
    "the TPU VM image: Debian 12 (systemd 252) in a systemd-nspawn container, not Ubuntu 22.04",
    "google-guest-agent: a unit that creates the ssh-keys users and runs startup-script",
    "gcloud: a stand-in for storage cp/ls/rsync, secrets, and tpu-vm delete/stop sent to the "
    "local Cloud TPU API (localcloud/guest/gcloud)",
    "GCS: fake-gcs-server (the GCS JSON API; no IAM, no latency)",
    "the Pulumi engine: the program runs under mocks; the TpuNode provider's code creates and "
    "deletes the nodes, the SshDeployment provider's code deploys",
    "the Cloud TPU API: a local server of its REST protocol (localcloud/tpu_api.py) that the "
    "real google-cloud-tpu client and the VMs' gcloud reach by endpoint setting",
    "IAM: every TPU call checked against the program's own roles and bindings with Google's "
    "permission names (localcloud/iam.py); GCS and Secret Manager do not check",
    "docker and the vLLM TPU image: the CPU build of the same vLLM release, run by a docker "
    "stand-in with tensor/data parallelism 1, the text model's class and eager mode",
    "GitHub: the serving VM's disk carries the verilog-eval checkout (the three problems the "
    "wheel ships, named as the pinned commit)",
    "Docker Hub: not reachable (the docker stand-in runs the engine from the host's venv)",
)


class CloudVm:
    """One worker of a TPU node, booted as a container on `machine`'s disk.

    Args:
        machine: the container (a fresh disk for a new VM).
        address: its external address (sshd listens there).
        metadata: its metadata server (already listening on its own address).
        storage_url: the GCS protocol server's URL.
        secrets: Secret Manager's secrets this VM may read (name -> value), for `gcloud secrets`.
        tpu_url: the local Cloud TPU API's URL (the VM's gcloud sends its TPU calls there), or
            None where the VM has none.
        settings: more environment for every process of the VM (the rehearsal's own settings,
            such as a short run-lock lease; named in its summary).
    """

    def __init__(
        self,
        machine: Machine,
        address: str,
        metadata: metadata_server.MetadataServer,
        storage_url: str,
        secrets: dict[str, str] | None = None,
        tpu_url: str | None = None,
        settings: dict[str, str] | None = None,
    ) -> None:
        self.machine = machine
        self.address = address
        self.metadata = metadata
        self.storage_url = storage_url
        self.secrets = secrets or {}
        self.tpu_url = tpu_url
        self.settings = settings or {}

    @property
    def name(self) -> str:
        return self.machine.name

    def install(self) -> None:
        """Writes the cloud's wiring onto the machine's disk (before its first boot)."""
        m = self.machine
        m.write(
            "/etc/hosts",
            "127.0.0.1 localhost\n"
            f"{self.metadata.address} metadata.google.internal metadata\n"
            f"{self.address} {m.name}\n",
        )
        m.write("/usr/local/lib/localcloud/guest-agent", (GUEST / "guest-agent").read_text(), 0o755)
        m.write("/usr/local/bin/gcloud", (GUEST / "gcloud").read_text(), 0o755)
        for unit in ("localcloud-accounts.service", "google-startup-scripts.service"):
            m.write(f"/etc/systemd/system/{unit}", (GUEST / unit).read_text())
            link = m.root / "etc/systemd/system/multi-user.target.wants" / unit
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.is_symlink():
                link.symlink_to(f"/etc/systemd/system/{unit}")
        # The image masks sshd (containers for tests need none); a VM has it, on its address.
        mask = m.root / "etc/systemd/system/ssh.service"
        if mask.is_symlink():
            mask.unlink()
        m.write(
            "/etc/ssh/sshd_config.d/localcloud.conf",
            f"ListenAddress {self.address}\nPasswordAuthentication no\nUseDNS no\n",
        )
        environment = {
            "STORAGE_EMULATOR_HOST": self.storage_url,
            "TENSORSTORE_GCS_HTTP_URL": self.storage_url,
            # gcsfs's gRPC bucket probe waits 30 s per call against a server without it.
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            # google-auth's own settings for where the metadata server is (169.254.169.254 on
            # GCE): Application Default Credentials on the VM get its account's token there.
            "GCE_METADATA_HOST": self.metadata.address,
            "GCE_METADATA_IP": self.metadata.address,
            **CPU_AS_TPU,
            **self.settings,
        }
        if self.tpu_url:
            # gcloud's own endpoint override: the VM's TPU calls (release, stop) go to the local
            # Cloud TPU API, as the VM's service account (its metadata server's token).
            environment[tpu_api.ENDPOINT_ENV] = self.tpu_url
            m.write("/etc/localcloud/tpu-url", self.tpu_url + "\n")
        if HOST_CA.exists():
            # This network re-signs TLS with a CA the host trusts (bound in by Machine); uv
            # reads only its own roots unless told (pip reads /etc/pip.conf).
            environment["SSL_CERT_FILE"] = str(HOST_CA)
        lines = " ".join(f'"{k}={v}"' for k, v in environment.items())
        m.write(
            "/etc/systemd/system.conf.d/localcloud.conf", f"[Manager]\nDefaultEnvironment={lines}\n"
        )
        m.write("/etc/environment", "".join(f"{k}={v}\n" for k, v in environment.items()))
        m.write("/etc/localcloud/storage-url", self.storage_url + "\n")
        for name, value in self.secrets.items():
            m.write(f"/etc/localcloud/secrets/{name}", value, 0o600)

    def install_serving(
        self, engine_venv: pathlib.Path, verilog_eval_dir: str, verilog_eval_commit: str
    ) -> None:
        """The serving VM's stand-ins (before its first boot): `docker` running the CPU build of
        vLLM from `engine_venv` (the host's, bound read-only at the same path with the Python it
        was made from), a docker unit for the script's `systemctl enable --now docker`, and
        GitHub's verilog-eval as a checkout on the disk: the three problems the wheel ships,
        named as the pinned commit (GitHub is not reachable here; the script keeps a checkout
        whose HEAD is that commit)."""
        m = self.machine
        home = _venv_home(engine_venv)
        m.bind(home, str(home))
        m.bind(engine_venv, str(engine_venv))
        m.write("/usr/local/bin/docker", (GUEST / "docker").read_text(), 0o755)
        m.write("/etc/systemd/system/docker.service", (GUEST / "docker.service").read_text())
        m.write("/etc/localcloud/vllm-python", f"{engine_venv / 'bin' / 'python'}\n")
        sample = (
            pathlib.Path(__file__).resolve().parents[1] / "workloads/assets/verilog-eval-sample"
        )
        target = m.root / verilog_eval_dir.lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", "-r", f"{sample}/.", str(target)], check=True)
        git = ["git", "-C", str(target), "-c", "user.name=localcloud", "-c", "user.email=l@c"]
        subprocess.run([*git, "init", "-q"], check=True)
        subprocess.run([*git, "add", "-A"], check=True)
        subprocess.run([*git, "commit", "-qm", "verilog-eval sample"], check=True)
        (target / ".git" / "HEAD").write_text(verilog_eval_commit + "\n")

    def boot(self, timeout_s: float = 180.0, *, wait: bool = True) -> float:
        """Boots the VM (its units run the guest agent's jobs); returns the seconds it took
        (with wait=False: until PID 1 runs, as a VM create returns before its boot ends)."""
        self.install()
        return self.machine.boot(timeout_s, wait=wait)

    def startup_log(self) -> str:
        try:
            return (self.machine.root / "var/log/gemma4-startup.log").read_text(errors="replace")
        except OSError:
            return ""


def _venv_home(venv: pathlib.Path) -> pathlib.Path:
    """The Python installation a venv was made from (pyvenv.cfg's `home` is its bin/)."""
    for line in (venv / "pyvenv.cfg").read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "home":
            return pathlib.Path(value.strip()).parent
    raise FileNotFoundError(f"{venv}/pyvenv.cfg names no home")
