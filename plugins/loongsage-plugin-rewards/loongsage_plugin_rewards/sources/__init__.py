"""Procedural task generators (data sources): each returns a list of ``{"prompt", "label", "metadata"}`` rows."""
