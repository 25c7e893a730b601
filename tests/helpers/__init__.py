"""Shared test helpers (tiny models, runners); imported by tests, never by the product."""
