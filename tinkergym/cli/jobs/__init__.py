"""``tinkergym jobs``: the client's side of the scheduler (a tenant's jobs and the workers that serve it)."""
