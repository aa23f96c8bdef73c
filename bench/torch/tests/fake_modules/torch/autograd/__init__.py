"""Filled in by the fake torch package."""
