"""The scheduler's routes: thin, one module per resource."""
