"""Router role: the inference backend's router (smg for SGLang), started through the backend's spec."""
