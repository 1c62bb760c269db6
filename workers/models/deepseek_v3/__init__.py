"""Family ``deepseek_v3`` (Kimi K2, DeepSeek-V3: MLA attention, sigmoid-routed MoE): config.py schema,
hf_config.py config.json mapping, model.py torch module from the shared blocks (trained by both
plans, served by the embedded engine), spec.py registration and plan facts."""
