"""The training server: the Backend protocol over HTTP (tinkergym serve backend)."""
