"""Family ``tiny_moe``: a small causal MoE decoder in plain torch (config.py schema, spec.py registration,
model.py / layers.py / moe.py torch code, which the dense ``llama`` family reuses with no experts)."""
