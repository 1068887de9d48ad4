"""Integrations with other libraries (HF transformers)."""
