"""What an operator runs: `python -m infra.ops` (status, cost, logs, recover, ...), preflight and
the deviceless compile check, and the stack client they share."""
