"""Structured outputs: constraints (JSON schema, regex, choice, grammar) compiled into grammars whose token
bitmask the sampler applies at every step. ``backends`` is the small interface the grammar libraries sit
behind, ``validation`` the front end's check before admission, ``manager`` the engine core's compiler,
cache and per-request grammar state. Nothing is imported here (the grammar libraries are heavy)."""
