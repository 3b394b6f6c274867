"""Flags are checked when parsed, before any model or data loads: non-finite floats and unknown targets are one
click error naming the flag."""

import click
import pytest
from click.testing import CliRunner

from juno_py.cli.common import FiniteFloatRange
from juno_py.cli.main import COMMANDS, cli


def run(*args):
    return CliRunner().invoke(cli, list(map(str, args)), catch_exceptions=False)


@pytest.mark.parametrize(
    "command, flag, value",
    [
        ("lora", "--lora-alpha", "nan"),
        ("lora", "--lora-alpha", "inf"),
        ("lora", "--lora-dropout", "nan"),
        ("lora", "--lora-lr", "nan"),
        ("lora", "--lora-lr", "inf"),
        ("lora", "--validation-split", "nan"),
        ("lora", "--lora-max-grad-norm", "inf"),
        ("full", "--lr", "nan"),
        ("full", "--lr", "inf"),
        ("full", "--max-grad-norm", "nan"),
        ("full", "--lora-lr", "nan"),
        ("full", "--lora-min-lr", "inf"),
        ("full", "--galore-scale", "nan"),
        ("lora", "--lora-plus-ratio", "nan"),
        ("lora", "--lora-weight-decay", "inf"),
        ("merge", "--min-retention", "nan"),
    ],
)
def test_non_finite_float_flags_are_refused_naming_the_flag(command, flag, value, tmp_path):
    missing = tmp_path / "no-such-model.gguf"  # reached only if the flag check did not stop the command first
    r = run(command, "--model-path", missing, flag, value)
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert f"Invalid value for '{flag}': '{value}' is not a finite number." in r.stderr
    assert str(missing) not in r.stderr


@pytest.mark.parametrize(
    "command, flag", [("lora", "--lora-targets"), ("full", "--targets"), ("full", "--lora-targets")]
)
def test_unknown_target_is_refused_before_the_model_loads(command, flag, tmp_path):
    missing = tmp_path / "no-such-model.gguf"
    r = run(command, "--model-path", missing, flag, "qv,foo")
    assert r.exit_code == 2, r.output
    assert "'foo'" in r.stderr and "wq, wk, wv, wo, wgate, wup, wdown" in r.stderr and str(missing) not in r.stderr


def test_every_float_flag_is_finite_checked():
    ctx = click.Context(cli)
    floats = []
    for name in COMMANDS:
        command = cli.get_command(ctx, name)
        for p in command.params:
            if isinstance(p.type, click.types.FloatParamType):
                floats.append((name, p.name, type(p.type)))
    assert floats and all(t is FiniteFloatRange for _, _, t in floats), [
        f for f in floats if f[2] is not FiniteFloatRange
    ]


def test_groups_expand_inside_a_comma_list():
    from juno_py.lora import parse_targets

    assert parse_targets("qv,mlp") == ("wq", "wv", "wgate", "wup", "wdown")
    with pytest.raises(ValueError, match="unknown target 'foo'"):
        parse_targets("qv,foo")
