"""``tinkergym scheduler``: the job scheduler's commands, run on its machine by its operator."""
