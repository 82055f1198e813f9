"""What an operator runs: `python -m infra.ops` (status, cost, logs, recover, ...), and the stack
client that it and preflight (infra.preflight, the floor above) share."""
