"""Family ``mistral`` (MistralForCausalLM: Mistral 7B, Mistral NeMo, Mistral Small): config.py schema,
spec.py registration; the torch module is the shared dense decoder (workers/models/dense/)."""
