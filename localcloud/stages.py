"""The rehearsal's stages, in the order they run: the one list of their names.

localcloud/rehearse.py runs them, its docstring and docs/rehearsal.md's table of stages name
them, and tests/localcloud/test_stages.py holds all three to this tuple, so a stage added to one
is added to the others (the docstring once listed 8 where 15 ran). Their measured times live in
docs/benchmarks.md.
"""

from __future__ import annotations

STAGES = (
    "plan",  # the program under Pulumi's mocks
    "cloud",  # the storage server, the buckets, the tiny model and data in them
    "image",  # the Debian 12 tree (built once, cached after)
    "boot",  # the training node created through the local Cloud TPU API; its VM boots
    "deploy",  # the startup script to ready, then the deploy over SSH
    "control",  # the recovery controller's VM watching the training node
    "train",  # the trainer until a checkpoint is intact in the bucket
    "preempt",  # the node taken back: its VM killed
    "recover",  # the controller recreates the node; the new VM installs its release and trains
    "resume",  # the trainer takes the run lock over and finishes
    "merge",  # the merge unit
    "release",  # the training VM gives its node back (when the stack asks)
    "serve",  # the serving VM, vLLM healthy
    "eval",  # the eval unit
    "bench",  # the bench unit
)
