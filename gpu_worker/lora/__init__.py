"""Multi-LoRA on the worker: adapters loaded into per-slot stacks and applied per token row."""
