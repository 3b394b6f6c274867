"""The functions that turn `juno-py lora` / `juno-py full` options into the configs the library takes, and full's
deprecated --lora-* spellings."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from click.testing import CliRunner

from juno_py.cli import full_cmd, lora_cmd
from juno_py.cli.main import cli
from juno_py.lora import Init, Mode, Scaling
from juno_py.train.loop import TrainConfig


def options(command, *args) -> dict:
    return dict(command.make_context(command.name, [str(a) for a in args]).params)


def test_lora_defaults_give_the_library_defaults_but_where_the_command_differs():
    cfg = lora_cmd.train_config_from_options(options(lora_cmd.lora), pad_id=7, lora_path=Path("a.bin"))
    assert cfg == dataclasses.replace(TrainConfig(), pad_id=7, lora_path=Path("a.bin"))


def test_lora_every_option_reaches_its_field():
    o = options(
        lora_cmd.lora,
        "--lora-lr",
        3e-4,
        "--batch-size",
        3,
        "--lora-gradient-accumulation",
        5,
        "--lora-max-grad-norm",
        0.5,
        "--lora-weight-decay",
        0.2,
        "--lora-plus-ratio",
        4,
        "--lora-schedule",
        "constant",
        "--lora-warmup-steps",
        6,
        "--lora-min-lr",
        1e-6,
        "--max-steps",
        9,
        "--epochs",
        2,
        "--lora-loss-target",
        0.3,
        "--validation-every",
        11,
        "--lora-validation-patience",
        4,
        "--lora-validation-min-delta",
        0.01,
        "--lora-overfit-ratio",
        1.5,
        "--bptt-window",
        64,
        "--grad-checkpoint",
        "--cuda-graphs",
        "off",
        "--pack",
        "--max-seq-len",
        256,
        "--seed",
        13,
        "--save-every",
        10,
    )
    cfg = lora_cmd.train_config_from_options(o, pad_id=2, lora_path=Path("b.bin"))
    assert cfg == TrainConfig(
        lr=3e-4,
        batch_size=3,
        accumulation=5,
        max_grad_norm=0.5,
        weight_decay=0.2,
        plus_ratio=4.0,
        schedule="constant",
        warmup_steps=6,
        min_lr=1e-6,
        max_steps=9,
        epochs=2,
        loss_target=0.3,
        validation_every=11,
        patience=4,
        min_delta=0.01,
        overfit_ratio=1.5,
        bptt_window=64,
        grad_checkpoint=True,
        cuda_graphs="off",
        pack=True,
        max_seq_len=256,
        pad_id=2,
        seed=13,
        save_every=10,
        lora_path=Path("b.bin"),
    )


def test_lora_adapter_config():
    cfg = lora_cmd.adapter_config_from_options(
        options(
            lora_cmd.lora,
            "--lora-rank",
            8,
            "--lora-alpha",
            16,
            "--lora-mode",
            "dora",
            "--lora-scaling",
            "rslora",
            "--lora-init",
            "legacy-normal",
            "--lora-dropout",
            0.1,
        )
    )
    assert (cfg.rank, cfg.alpha, cfg.mode, cfg.scaling, cfg.init, cfg.dropout) == (
        8,
        16.0,
        Mode.DORA,
        Scaling.RSLORA,
        Init.LEGACY_NORMAL,
        0.1,
    )


FULL_ARGS = [
    "--output",
    "o.gguf",
    "--weight-decay",
    0.1,
    "--schedule",
    "constant",
    "--warmup-steps",
    3,
    "--min-lr",
    1e-7,
    "--batch-size",
    2,
    "--gradient-accumulation",
    4,
    "--max-steps",
    8,
    "--epochs",
    3,
    "--loss-target",
    0.2,
    "--validation-every",
    5,
    "--validation-patience",
    2,
    "--validation-min-delta",
    0.05,
    "--overfit-ratio",
    2.0,
    "--bptt-window",
    32,
    "--grad-checkpoint",
    "--pack",
    "--max-seq-len",
    128,
    "--seed",
    5,
    "--save-every",
    4,
]
FULL_CONFIG = TrainConfig(
    lr=1e-3,
    batch_size=2,
    accumulation=4,
    max_grad_norm=0.0,
    weight_decay=0.1,
    schedule="constant",
    warmup_steps=3,
    min_lr=1e-7,
    max_steps=8,
    epochs=3,
    loss_target=0.2,
    validation_every=5,
    patience=2,
    min_delta=0.05,
    overfit_ratio=2.0,
    bptt_window=32,
    grad_checkpoint=True,
    pack=True,
    max_seq_len=128,
    pad_id=1,
    seed=5,
    save_every=4,
    lora_path=Path("o.gguf"),
)


def full_config(*args) -> TrainConfig:
    o = full_cmd.take_deprecated_aliases(options(full_cmd.full, *args))
    return full_cmd.train_config_from_options(o, lr=1e-3, max_grad_norm=0.0, pad_id=1, output=Path("o.gguf"))


def test_full_every_option_reaches_its_field():
    assert full_config(*FULL_ARGS) == FULL_CONFIG


def test_full_deprecated_lora_spellings_give_the_same_config():
    old = [
        f"--lora-{a[2:]}" if isinstance(a, str) and a[2:].replace("-", "_") in full_cmd.RENAMED else a
        for a in FULL_ARGS
    ]
    assert old != FULL_ARGS and "--lora-gradient-accumulation" in old
    assert full_config(*old) == FULL_CONFIG
    o = full_cmd.take_deprecated_aliases(
        options(
            full_cmd.full, "--output", "o.gguf", "--lora-targets", "qv", "--lora-lr", 0.5, "--lora-max-grad-norm", 2
        )
    )
    assert (o["targets"], o["lr"], o["max_grad_norm"]) == ("qv", 0.5, 2.0)
    assert not any(k.startswith("lora_") for k in o)


def test_full_help_shows_the_new_names_only_and_an_old_one_prints_a_note(tmp_path):
    help_text = CliRunner().invoke(cli, ["full", "--help"], terminal_width=200).output
    assert "--targets" in help_text and "--gradient-accumulation" in help_text and "--lr " in help_text
    assert "--lora-" not in help_text
    r = CliRunner().invoke(cli, ["full", "--output", tmp_path / "o.gguf", "--lora-gradient-accumulation", 2])
    assert r.exit_code == 1
    assert (
        "juno-py: note: juno-py full: --lora-gradient-accumulation is deprecated; use --gradient-accumulation"
        in r.stderr
    )
    assert "gradient accumulation (--gradient-accumulation 2) cannot add up" in r.stderr
