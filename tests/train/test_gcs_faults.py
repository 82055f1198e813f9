"""A gs:// training run whose GCS server is killed and restarted mid-run, through the fault
proxy (tests/fixtures/gcs_faults.py): the run rides through on retries or stops with one line
naming the object, and a restart ends on the uninterrupted run's weights."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.train.conftest import STEPS
from tests.train.test_gcs import metric_steps, same_weights
from tests.train.test_training import wait_for
from workloads.common import storage


@pytest.mark.slow
def test_a_gs_run_whose_server_restarts_midway_ends_on_the_same_weights(
    reference_run, config_for, gcs_faults, tmp_path
):
    from workloads.train import trainer

    run = f"{gcs_faults.bucket}/run"
    cfg = config_for(run)
    config_file = tmp_path / "run.json"
    config_file.write_text(json.dumps(cfg.model_dump(mode="json")))
    with open(tmp_path / "train.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workloads", "train", "--config", str(config_file)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for(lambda: storage.exists(f"{run}/metrics.jsonl"), 600, proc)
            gcs_faults.server.kill()
            time.sleep(5)  # refused connections meanwhile: gcsfs backs off 1, 2, 4 s
            gcs_faults.server.start()
            code = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
    log_text = (tmp_path / "train.log").read_text()
    assert gcs_faults.proxy.count("down") > 0  # the run did meet the dead server
    if code != 0:
        # Stopped: its last line is the one line naming what it could not reach.
        last = log_text.strip().splitlines()[-1]
        assert f"{run}/" in last and "Traceback" not in log_text, log_text
        result = trainer.train(cfg, log=lambda line: None)
        assert result.final_step == STEPS
    assert same_weights(cfg.train.checkpoint_dir, reference_run.checkpoint_dir) <= 1e-6, log_text
    assert metric_steps(run) == list(range(1, STEPS + 1))
    assert not storage.exists(f"{run}/train.lock")
    print(f"exit {code}; {gcs_faults.proxy.count('down')} requests met the dead server")
