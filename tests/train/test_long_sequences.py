"""Long sequences: activation checkpointing switched on where a micro-batch's activations would not fit, and
CUDA graphs left to short micro-batches."""

from juno_py.gguf import GGMLType
from juno_py.lora import attach
from juno_py.models import load_model
from juno_py.testing.tiny_models import sample_ids
from juno_py.train.cuda_graph import MAX_GRAPH_TOKENS, step_blocker
from juno_py.train.data import Example
from juno_py.train.loop import TrainConfig, train
from juno_py.train.steps import free_memory_bytes, resolve_checkpointing, saved_activation_bytes


def test_checkpointing_auto_follows_the_activation_estimate(tiny_gguf):
    model = load_model(tiny_gguf("llama", GGMLType.Q8_0))
    a = model.args
    per_token = saved_activation_bytes(model, 1)
    assert per_token >= a.n_layer * (a.n_embd + a.n_ff) * 4  # at least the residual stream and the MLP, fp32
    assert saved_activation_bytes(model, 1000) == 1000 * per_token
    free = free_memory_bytes(model.embed.device)
    assert free > 0
    fits, too_long = 16, 2 * free // per_token  # tokens whose activations take far less / twice the free memory
    assert resolve_checkpointing(model, None, fits) is False
    assert resolve_checkpointing(model, None, too_long) is True
    assert resolve_checkpointing(model, None, too_long, bptt_window=64) is False  # windows read a K/V cache
    assert resolve_checkpointing(model, True, fits) is True and resolve_checkpointing(model, False, too_long) is False


def test_training_leaves_checkpointing_off_for_short_sequences_and_on_when_asked(tiny_gguf):
    model = load_model(tiny_gguf("llama", GGMLType.Q8_0))
    aset = attach(model, "qv", rank=2, alpha=4, seed=0)
    examples = [Example(sample_ids(12, seed=i), [True] * 12) for i in range(4)]
    for asked, expected in ((None, False), (True, True)):
        cfg = TrainConfig(batch_size=2, max_steps=1, epochs=None, grad_checkpoint=asked, max_seq_len=32)
        train(model, aset, examples, cfg)
        assert model.checkpoint_blocks is expected


def test_graphs_are_left_to_short_micro_batches():
    long_cfg = TrainConfig(batch_size=2, max_seq_len=MAX_GRAPH_TOKENS // 2)
    assert "micro-batches of 2 x" in step_blocker(long_cfg, checkpointing=False)
    assert step_blocker(TrainConfig(batch_size=2, max_seq_len=512), checkpointing=False) is None
    assert "--grad-checkpoint" in step_blocker(TrainConfig(batch_size=2, max_seq_len=512), checkpointing=True)
