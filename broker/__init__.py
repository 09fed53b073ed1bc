"""Sandman broker: the domain core (settings, ledger, provider, pacing, pools, GC, client).

`broker` imports neither `workers` nor `web`; both of those build on it.
"""

__version__ = "0.1.0"
