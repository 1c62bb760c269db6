"""Router role: smg (the SGLang Model Gateway) in front of the SGLang servers."""
