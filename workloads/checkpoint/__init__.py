"""The format of a run's LoRA checkpoints: what the trainer writes and the merge reads.

Training (workloads.train) writes it and reads it back to resume; the merge (workloads.merge)
reads it. Both import this package and neither imports the other. A run's checkpoint directory
(`<run>/checkpoints`, local or gs://):

    lora_meta.json               adapter_meta: rank, alpha, targets, base, HF config (written
                                 before the first step; the merge never asks for them again)
    <step>/                      one finished step (tunix's CheckpointManager, Orbax)
      model_params/              nnx.state(model, nnx.LoRAParam): the adapters only
      optimizer_state/           AdamW's moments (training reads them back to resume)
      checksums.json             checksums: size and CRC-32C of every file of the step
      _CHECKPOINT_METADATA       Orbax's step metadata; custom_metadata marks the manifest
    <step>.orbax-checkpoint-tmp-*  a save that never finished: no step

- adapter_meta: lora_meta.json, read and written.
- checksums: the manifest, written as Orbax finalizes a step (ManifestWriter) and checked before
  a resume or a merge reads the step (check_step).
- lora_restore: the finished steps (saved_steps, list_steps, resolve_step), the directory of a run
  (find_checkpoint_dir) and the arrays of a step onto the host (read_item, restore_lora_params).

The adapters' names inside model_params are those Qwix gives the tunix model's modules
(workloads.model.lora applies them; lora_restore flattens them to `layers.<i>.attn.q_einsum.
w_lora_a`).
"""
