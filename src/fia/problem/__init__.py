"""The normalized problem: frozen dataclasses, no Ascend argument names inside."""
