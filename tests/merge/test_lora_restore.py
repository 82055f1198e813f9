"""Reading one item of a checkpoint step on its own (what resume's integrity check and the
merge do) says nothing when nothing is wrong."""

from __future__ import annotations

import logging

from tests.merge.conftest import STEPS


def test_reading_an_item_does_not_warn_about_item_level_metadata(lora_run, caplog):
    from workloads.checkpoint import lora_restore

    item = lora_run.checkpoints / str(STEPS[-1]) / "model_params"
    # Orbax writes _CHECKPOINT_METADATA per step, never per item: the warning it logs when it
    # looks for one in the item would be noise on every resume and merge.
    assert (item.parent / "_CHECKPOINT_METADATA").exists()
    assert not (item / "_CHECKPOINT_METADATA").exists()
    with caplog.at_level(logging.INFO, logger="absl"):
        arrays = lora_restore.read_item(str(item))
    assert arrays and all(name.endswith(("lora_a", "lora_b")) for name in arrays)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    # The filter is gone afterwards: the same warning elsewhere still shows.
    logging.getLogger("absl").warning("Metadata file does not exist: %s", str(item))
    assert caplog.records[-1].getMessage().startswith("Metadata file does not exist")
