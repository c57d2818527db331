"""Stacks for the chaos tests: one ``maskserve up`` shared by the tests of a module, replaced only
when a fault left it unable to recover (so one failure does not cascade into the next test)."""

from __future__ import annotations

import pytest

from tests.chaos.harness import UpStack

RECOVER_S = 90.0  # a healthy stack's roles are back well within this after a fault


class SharedStack:
    def __init__(self, tmp_path_factory, models_dir, env=None):
        self.factory, self.models_dir, self.env = tmp_path_factory, models_dir, env
        self.stack: UpStack | None = None

    def healthy(self) -> UpStack:
        """The running stack once healthy again, or a fresh one if it cannot recover."""
        if self.stack is not None and self.stack.alive():
            try:
                self.stack.wait_healthy(RECOVER_S)
                return self.stack
            except AssertionError:
                pass
        self.close()
        self.stack = UpStack(self.factory.mktemp("up"), self.models_dir, self.env).start()
        self.stack.wait_healthy()
        return self.stack

    def close(self) -> None:
        if self.stack is not None:
            self.stack.stop()
            self.stack = None


def warm_models(models_dir, tmp_path_factory) -> None:
    """Build the tiny model once, before the stack's processes load it."""
    from tests.factories import make_engine

    make_engine("sd2-inpaint", models_dir, tmp_path_factory.mktemp("warm"))


@pytest.fixture(scope="module")
def shared_stacks(models_dir, tmp_path_factory):
    warm_models(models_dir, tmp_path_factory)
    holder = SharedStack(tmp_path_factory, models_dir)
    try:
        yield holder
    finally:
        holder.close()


@pytest.fixture
def stack(shared_stacks) -> UpStack:
    return shared_stacks.healthy()
