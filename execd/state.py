"""Baseline, state check and restore (stub, filled in below)."""


class StateKeeper:
    def __init__(self, shell, workdir, rundir) -> None:
        self.shell = shell

    def baseline(self, doc):
        return {}

    def check(self, doc):
        return {}

    def restore(self, doc):
        return {}
