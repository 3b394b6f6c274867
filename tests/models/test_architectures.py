"""The architecture table: every entry carries the facts the exchange with Hugging Face reads from it."""

import dataclasses

import pytest

from juno_py.models import ARCHITECTURES, TARGETS, ModelArgs


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
