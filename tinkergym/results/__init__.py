"""The results table: declared rows of the hub's own tasks (:mod:`.rows`), each trained and evaluated on held-out seeds
by :mod:`.runner`, summarized with the intervals of :mod:`.stats`, and rendered by :mod:`.table`.

The command is ``tinkergym results`` (``list``, ``run ROW [--quick]``, ``table``); docs/results/README.md says how the
committed rows were made and what each shows.
"""
