"""The Tinker API's routes, thin, one module per concern: the service and its sessions (:mod:`.sessions`), training runs
(:mod:`.runs`), their weights and checkpoints (:mod:`.weights`), sampling (:mod:`.sampling`), futures (:mod:`.futures`) and
the REST listing of runs and checkpoints (:mod:`.rest`). What they depend on is :mod:`tinkergym.tinker_api.deps`."""
