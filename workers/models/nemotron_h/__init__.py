"""Family ``nemotron_h`` (Nemotron-H / Nemotron 3): schema config.py, config.json hf_config.py, torch model.py, spec.py."""
