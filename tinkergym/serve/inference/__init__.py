"""The OpenAI-compatible inference server (tinkergym serve model) and its engines."""
