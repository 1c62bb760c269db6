"""LoRA for every native family (issue 44): nn.Linear targets (linear.py), routed-expert stacks through
their grouped GEMMs (experts.py), injection, initial values and the published adapter (inject.py).
The file format of a published adapter: workers/weights/lora_format.py. The config: trainer.lora
(workers/common/config/lora.py)."""
