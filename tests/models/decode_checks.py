"""What the decoder tests share: a decoder's logits step by step, the forward's, the closeness check, and adapters
made non-trivial (their B and magnitudes randomised) so that playing them changes the logits."""

import torch

from juno_py.models.generate import decode_one_token, prefill

# a tiny model wide enough for the native and Triton kernels' blocks (256-value K-quant rows, 64-wide heads)
WIDE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}


def forward_steps(model, prompt, tokens):
    """Logits after the prompt and after each token, through the model's forward."""
    with torch.no_grad():
        cache = model.new_cache(batch=1, max_len=len(prompt) + len(tokens))
        out = [prefill(model, torch.tensor([prompt]), cache)]
        out += [decode_one_token(model, t, cache) for t in tokens]
    return torch.stack(out)


def decoder_steps(decoder_cls, model, prompt, tokens, **build):
    """The same logits through `decoder_cls.build(model, cache, **build)` after the forward's prefill."""
    with torch.no_grad():
        cache = model.new_cache(batch=1, max_len=len(prompt) + len(tokens))
        first = prefill(model, torch.tensor([prompt]), cache)
        decoder = decoder_cls.build(model, cache, **build)
        assert decoder is not None, decoder_cls.unsupported(model, cache)
        return torch.stack([first] + [decoder.step(t).clone() for t in tokens])


def assert_logits_close(got, ref):
    # float32 rounding of a few ulp of the logits' range (sums regrouped, attention over a whole masked cache); a
    # wrong element, scale, position, mask or cache slot is orders of magnitude more
    scale = ref.abs().max().item()
    err = (got - ref).abs().max().item()
    assert err <= 2e-6 * scale, f"max |Δlogit| {err:.3g} against a range of {scale:.3g}"


def randomize(aset, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for ad in aset.adapters.values():
            ad.lora_B.normal_(0, 0.3, generator=g)
            if ad.magnitude is not None:
                ad.magnitude.mul_(1 + 0.2 * torch.randn(ad.magnitude.shape, generator=g))


def two_loras_played(path, tmp_path):
    """The model at `path` playing two saved LoRAs of different targets and ranks at scales 0.7 and -1.3 (their B
    randomised), as `load_adapters` plays a user's list."""
    from juno_py.lora import attach, load_adapters
    from juno_py.models import load_model

    files = []
    for i, targets in enumerate(["all", "qv"]):
        aset = attach(load_model(path), targets, rank=3 + i, alpha=4.0, seed=i)
        randomize(aset, seed=10 + i)
        files.append(aset.save(tmp_path / f"a{i}.bin"))
    model = load_model(path)
    load_adapters(model, [f"{files[0]}:0.7", f"{files[1]}:-1.3"])
    return model
