"""The embedded backend (``inference.backend=embedded``): the tiny-model engine of this repo
(engine.py) behind an SGLang-compatible HTTP server (server.py, weight_routes.py), one CPU
process (or one GPU) per worker. Registered by spec.py; its options are config.py."""
