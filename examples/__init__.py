"""Example programs for torch-distribute (not part of the installed package)."""
