"""Constrained decoding: grammar backends that turn regexes, JSON schemas and choices into
token masks (`grammar`), compiled in worker processes under a time limit (`compiler`).
Torch-free."""
