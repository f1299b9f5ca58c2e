"""The Backend protocol and its plain types: what the core, trainers, engines and the wire speak (no torch, nothing else of the project)."""
