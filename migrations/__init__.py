"""Alembic's script directory, shipped in the wheel as ``broker.ledger.migrations``.

It is a package only so that ``importlib.resources`` can find it in every install (see
setup.py and broker/ledger/migrate.py); nothing imports it as code.
"""
