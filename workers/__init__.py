"""Celery workers: thin tasks that call broker services (never the web UI)."""
