"""The WSGI entry point for gunicorn: ``gunicorn web.wsgi:app``.

Settings are read here, at the entry point, when gunicorn imports this module (and only
then): importing ``web`` or ``web.app`` builds nothing.
"""

from __future__ import annotations

from broker.settings import Settings
from web.app import create_app

app = create_app(Settings.from_env())
