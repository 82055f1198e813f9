"""What lands on a VM: the startup scripts, the systemd units, the workloads wheel and the source
archive."""
