"""What every workload (and infra) uses: errors, logs, digests, processes, storage, the
command-line options' conventions and the boot/stage timing records (stage_records)."""
