"""The Flask admin UI and its JSON API (never the workers)."""
