"""The stack config: its model, its rules and estimates, how a stack's config is read, its
projection to the run config, and the generated reference (docs/config.md)."""
