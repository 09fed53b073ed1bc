"""The Flask admin UI and its JSON API (imports ``broker``, never ``workers``).

``create_app(settings)`` lives in ``web.app``; ``web.wsgi`` builds the app for gunicorn.
Importing this package builds nothing and reads no environment.
"""
