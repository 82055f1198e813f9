"""A local stand-in for the cloud: real Debian 12 machines as systemd-nspawn containers.

Tests-only tooling (and the `python -m localcloud rehearse` command): it builds a Debian 12 root
file system with debootstrap once (cached, keyed by its package list), boots fresh copies of it
with systemd 252 as PID 1, runs commands in them, and kills them without warning, as a
preemption does. The program (infra/), the templates and the workloads never import it: it lives
at the repository's top level, outside the packages the wheel and the recovery controller's
source archive are built from, and tests/localcloud/test_isolation.py keeps it that way.
"""
