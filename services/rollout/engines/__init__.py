"""Generation engines: transformers and vLLM, multi-LoRA, weight updates into an engine."""
