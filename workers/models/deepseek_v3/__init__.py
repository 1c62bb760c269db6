"""Family ``deepseek_v3`` (Kimi K2, DeepSeek-V3): plan-only, schema and plan facts in spec.py."""
