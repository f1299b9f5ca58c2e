"""tinkergym's HTTP servers and what they share: ASGI pieces, bearer-token auth, slow-client bounds, lifetime."""
