"""The worker: lends a machine's devices to the scheduler and runs each leased job's server (tinkergym worker)."""
