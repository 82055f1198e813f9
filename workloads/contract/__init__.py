"""The contract between the laptop and the VMs: the settings a user chooses (settings),
the run config infra writes and every workload reads (runconfig), and the facts both sides
share (catalog)."""
