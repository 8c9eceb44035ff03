"""The engine core, its clients, and the front-end processing around them."""
