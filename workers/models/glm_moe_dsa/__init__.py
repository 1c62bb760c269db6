"""Family ``glm_moe_dsa`` (GLM-5): plan-only, schema and plan facts in spec.py."""
