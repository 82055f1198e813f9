"""One trainer process of a multi-host rehearsal (tests/train/test_multihost.py runs it once per
host, with the variables workloads.train.hosts reads): joins the others, trains `CONFIG`, and
writes what the test checks to `<REPORT_DIR>/host<i>.json`: the rows of every micro-batch it fed
(a digest per row) and the files it wrote under the run directory outside checkpoints/ (Orbax
writes each host's shards there by design). $MH_DELAY_AFTER_STEP / $MH_DELAY_S slow the stream
down after that step so a test can kill a host mid-run.

Usage: python -m tests.train.multihost_worker CONFIG REPORT_DIR
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time


def main() -> int:
    config, report_dir = sys.argv[1], sys.argv[2]
    from workloads.contract import runconfig
    from workloads.train import hosts

    cfg = runconfig.load(config)
    hosts.join(hosts.from_env())
    import jax

    from workloads.train import trainer

    index = jax.process_index()
    run_dir = os.path.realpath(cfg.train.output_dir)
    writes: set[str] = set()

    def audit(event: str, args: tuple) -> None:
        path = None
        if event == "open" and isinstance(args[0], str):
            mode, flags = args[1], args[2]
            writing = (mode and any(c in mode for c in "wax+")) or (flags or 0) & (
                os.O_WRONLY | os.O_RDWR | os.O_CREAT
            )
            path = args[0] if writing else None
        elif event in ("os.rename", "os.remove", "os.mkdir") and isinstance(args[0], str):
            path = args[1] if event == "os.rename" else args[0]  # rename: the target
        if path and isinstance(path, str):
            full = os.path.realpath(path)
            if full.startswith(run_dir + os.sep) and "/checkpoints/" not in full + "/":
                writes.add(os.path.relpath(full, run_dir))

    sys.addaudithook(audit)
    data = trainer.load_data(cfg, cfg.model.base)
    fed: list[list[str]] = []
    delay_after = int(os.environ.get("MH_DELAY_AFTER_STEP", "0") or 0)
    delay = float(os.environ.get("MH_DELAY_S", "0") or 0)
    per_step = cfg.train.grad_accum

    class Recording:
        stats = data.stats
        batches_per_epoch = data.batches_per_epoch

        def batches(self, epoch, *, skip=0):
            for i, batch in enumerate(data.batches(epoch, skip=skip)):
                position = epoch * data.batches_per_epoch + skip + i
                if delay and position >= delay_after * per_step:
                    time.sleep(delay)
                fed.append(
                    [str(position)]
                    + [hashlib.sha1(row.tobytes()).hexdigest()[:16] for row in batch.tokens]
                )
                yield batch

    try:
        result = trainer.train(cfg, data=Recording())
    finally:
        report = {
            "index": index,
            "count": jax.process_count(),
            "fed": fed,
            "batches_per_epoch": data.batches_per_epoch,
            "planned_rows": len(data.rows),
            "global_micro_batch": cfg.train.micro_batch,
            "writes": sorted(writes),
        }
        os.makedirs(report_dir, exist_ok=True)
        with open(os.path.join(report_dir, f"host{index}.json"), "w") as handle:
            json.dump(report, handle)
    return result.exit_status


if __name__ == "__main__":
    sys.exit(main())
