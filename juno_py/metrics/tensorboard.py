"""`--report-to tensorboard`: the training metrics as TensorBoard scalars, written by the `tensorboard` package's
writer (through `torch.utils.tensorboard`). Tags: `train/loss`, `train/lr` (A's rate; `train/lr_b` when B's
differs), `train/tokens_per_s`, `train/grad_norm`, `validation/loss`; the x axis is the optimizer step."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

from juno_py.errors import JunoError

TAGS = {
    "train_step": {
        "loss": "train/loss",
        "lr_a": "train/lr",
        "tokens_per_s": "train/tokens_per_s",
        "grad_norm": "train/grad_norm",
    },
    "validation": {"loss": "validation/loss"},
}


class TensorBoardSink:
    """A MetricsRecorder sink writing the events of TAGS into an event file under `log_dir`."""

    def __init__(self, log_dir: Union[str, Path]):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise JunoError(
                "--report-to tensorboard needs the tensorboard package: pip install 'juno-py[tensorboard]'"
            ) from None
        self.log_dir = Path(log_dir)
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def __call__(self, kind: str, values: dict[str, Any]) -> None:
        step = values.get("step")
        if step is None or kind not in TAGS:
            return
        for field, tag in TAGS[kind].items():
            value = values.get(field)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(tag, float(value), int(step))
        if kind == "train_step" and values.get("lr_b") and values.get("lr_b") != values.get("lr_a"):
            self.writer.add_scalar("train/lr_b", float(values["lr_b"]), int(step))

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
