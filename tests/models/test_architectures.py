"""The architecture table: every entry carries the facts the exchange with Hugging Face reads from it."""

import dataclasses

import pytest

from juno_py.models import ARCHITECTURES, TARGETS, ModelArgs
from juno_py.models.layout import MOE_TARGETS
from juno_py.testing.tiny_models import GGUF_ARCH, MOE_ARCHS, hf_tiny_model


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_every_target_has_a_hugging_face_module_and_fused_targets_are_adjacent(arch):
    modules = ARCHITECTURES[arch].hf_modules
    assert set(modules) == set(TARGETS)
    for module in set(modules.values()):
        assert module.count(".") == 1, module  # '<block part>.<projection>' inside model.layers.N
        members = [TARGETS.index(t) for t in TARGETS if modules[t] == module]
        # a fused module holds its targets' rows in target order, one after the other
        assert members == list(range(members[0], members[0] + len(members))), (module, members)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_permuted_rows_name_a_target_and_a_head_count(arch):
    fields = {f.name for f in dataclasses.fields(ModelArgs)}
    for target, heads in ARCHITECTURES[arch].hf_permuted_rows.items():
        assert target in TARGETS and heads in fields and heads.startswith("n_head"), (target, heads)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_expert_parameters_are_transformers_own_in_registration_order(arch):
    """PEFT wraps a module's adapted parameters in the order transformers registers them, which decides the names
    it saves them under: the table lists them in that order."""
    spec = ARCHITECTURES[GGUF_ARCH.get(arch, arch)]
    assert set(spec.hf_parameters) == set(MOE_TARGETS)
    layer = hf_tiny_model(arch).model.layers[0]
    names = list(dict.fromkeys(spec.hf_parameters.values()))
    for module in {n.rpartition(".")[0] for n in names}:
        mine = [n for n in names if n.rpartition(".")[0] == module]
        registered = [f"{module}.{p}" for p, _ in layer.get_submodule(module).named_parameters(recurse=False)]
        assert [n for n in registered if n in mine] == mine, (module, registered)
    for name in spec.hf_interleaved:
        assert name in names or name in spec.hf_modules.values(), name
