"""Family ``glm_moe_dsa`` (GLM-5: MLA attention with DeepSeek sparse attention, sigmoid-routed MoE):
config.py schema, model.py torch module from the shared blocks (trained by both plans, served by the
embedded engine), spec.py registration and plan facts."""
