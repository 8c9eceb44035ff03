"""The ``quire`` command line."""
