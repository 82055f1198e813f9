"""The model: Gemma 4 as Tunix builds it (gemma4), its parallel loading, the tiny random model,
the adapter's metadata, and where a job reads the base weights staged on its host
(base_weights)."""
