"""Shared fixtures: the real models from the model store (pulled once, cached in $JUNO_PY_HOME)."""

import pytest

from juno_py import store


def _store_model(name: str):
    try:
        return store.resolve_model(name)
    except store.ModelStoreError as e:  # no network and no cache: say so rather than pass silently
        pytest.fail(f"model store could not provide {name}: {e}")


@pytest.fixture(scope="session")
def smollm2_path():
    return _store_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_path():
    return _store_model("gemma3-270m")
