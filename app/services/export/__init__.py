"""Curves of a job exported as CSV and PNG (a small PNG writer, no numpy)."""
