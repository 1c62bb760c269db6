"""Family ``nemotron_h`` (Nemotron 3 Ultra): plan-only, schema and plan facts in spec.py."""
