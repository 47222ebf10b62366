"""modelfs: an Ollama model store by name, kept in step across hosts.

Layers, each importing only those below it (checked by import-linter, see pyproject.toml):
cli, demo, fsd | sync, runtime, store. docs/architecture.md says what each holds.
"""
