"""The vLLM engine: a sampler beside a trainer, its weights synced from it."""
