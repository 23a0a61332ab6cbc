"""Renderers: turn analysis results into text, JSON and other outputs. No analysis happens here."""
