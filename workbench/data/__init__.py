"""Text sources, tokenizers, batches and synthetic tasks."""
