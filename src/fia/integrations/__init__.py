"""Integrations of FIA into other libraries. Each one is a client of FIA's public API only (``import fia``).

- ``fia.integrations.transformers``: ``attn_implementation="fia"`` for Hugging Face transformers models
  (``import fia.integrations.transformers`` registers it; needs ``pip install fia[transformers]``).
"""
