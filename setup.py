"""Package discovery that pyproject.toml cannot express: the migrations ride inside the wheel.

Alembic's script directory stays top-level in the repository (``alembic.ini`` and developers
use it there), but an installed package must carry it, so ``sandman db upgrade`` works from a
wheel. setuptools can map a directory to a package name only when the package is listed, and
``[tool.setuptools.packages.find]`` cannot list a mapped one; so discovery lives here, and
every other piece of metadata stays in pyproject.toml.
"""

from setuptools import find_packages, setup

MIGRATIONS = "broker.ledger.migrations"

setup(
    packages=[*find_packages(include=["broker*", "workers*", "execd*", "web*"]), MIGRATIONS],
    package_dir={MIGRATIONS: "migrations"},
)
