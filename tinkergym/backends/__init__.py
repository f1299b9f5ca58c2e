"""Compute backends behind the Backend protocol: local torch, vLLM sampling, remote over HTTP."""
