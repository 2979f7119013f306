"""The Redis boundary: the only package that imports redis. Internal."""
