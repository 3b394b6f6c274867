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


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """tiny_gguf(arch, ggml_type=F32, **knobs) -> path of a tiny random-weight model (cached per argument set)."""
    from juno_py.gguf import GGMLType
    from juno_py.testing.tiny_models import write_tiny_gguf

    made = {}
    folder = tmp_path_factory.mktemp("tiny_models")

    def make(arch, ggml_type=None, **knobs):
        ggml_type = GGMLType.F32 if ggml_type is None else ggml_type
        key = (arch, int(ggml_type), repr(sorted(knobs.items())))
        if key not in made:
            path = folder / f"{arch}-{ggml_type.name.lower()}-{len(made)}.gguf"
            made[key] = write_tiny_gguf(path, arch, ggml_type, **knobs)
        return made[key]

    return make
