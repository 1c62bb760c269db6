"""Family ``hf_generic``: the generic path. Any Hugging Face causal LM that no native family covers is
trained and served through transformers' own modeling code (model.py) behind our CausalLM contract;
spec.py registers it (and says what it does not support), hf_source.py reads what transformers
knows of a config.json from its source files (torch-free), config.py is the ``model`` schema."""
