"""LoRA fine-tuning of Gemma 4 on Tunix: model loading (workloads.model.gemma4), Qwix adapters
(lora), the resumable PeftTrainer loop (trainer), metrics (metrics) and the `train` command
(command).
"""
