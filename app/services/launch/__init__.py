"""Launching: a request, its checks, the plans, and the Popen of a job's supervisor."""
