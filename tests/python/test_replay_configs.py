"""ropekv-replay reads a model's RoPE as transformers does: configs made by
transformers' own config classes (and its reading of older forms) replayed,
each layer's rope_theta and rope_scaling (the replay's JSON summary) checked
against the ones transformers gives that layer. The replay is the C++
tree's (scripts/setup.sh builds it; ROPEKV_REPLAY names another)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
REPLAY = pathlib.Path(os.environ.get("ROPEKV_REPLAY", ROOT / "build" / "tools" / "replay" / "ropekv-replay"))


def replay_model(config: dict, tmp_path) -> dict:
    """Replays `config` (two requests, every layer); its JSON summary's model."""
    if not REPLAY.exists():
        pytest.skip(f"no {REPLAY}: build the C++ tree (scripts/setup.sh) or set ROPEKV_REPLAY")
    path, out = tmp_path / "config.json", tmp_path / "summary.json"
    path.write_text(json.dumps(config))
    run = subprocess.run([str(REPLAY), "--no-progress", "--config", str(path), "--requests", "2",
                          "--json", str(out)], capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.rstrip().endswith("verified"), run.stdout
    return json.loads(out.read_text())["model"]


def replayed_layers(model: dict, num_layers: int) -> list:
    """(layer type, rope_theta, rope_scaling) of each layer, as replayed."""
    layers = {}
    for kind in model["rope_per_layer_type"]:
        for layer in kind["layers"]:
            layers[layer] = (kind["layer_type"], kind["rope_theta"], kind["rope_scaling"])
    return [layers[i] for i in range(num_layers)]


def transformers_layers(config) -> list:
    """(layer type, rope_theta, rope_scaling) of each layer, as transformers
    has them (rope_scaling None for default RoPE)."""
    out = []
    for kind in config.layer_types:
        params = dict(config.rope_parameters[kind])
        theta = params.pop("rope_theta")
        out.append((kind, theta, None if params["rope_type"] == "default" else params))
    return out


def without_rope_theta(layers: list) -> list:
    return [(k, t, None if s is None else {n: v for n, v in s.items() if n != "rope_theta"})
            for k, t, s in layers]


GEMMA3_SHAPE = dict(head_dim=64, hidden_size=640, num_attention_heads=4, num_key_value_heads=1)


@pytest.mark.parametrize("rope_parameters", [None, {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}],
    ids=["default", "linear-full"])
def test_gemma3_layer_types_as_transformers_saves_them(rope_parameters, tmp_path):
    transformers = pytest.importorskip("transformers")
    kw = {} if rope_parameters is None else {"rope_parameters": rope_parameters}
    config = transformers.Gemma3TextConfig(num_hidden_layers=13, **GEMMA3_SHAPE, **kw)
    model = replay_model(config.to_dict(), tmp_path)
    want = transformers_layers(config)
    assert {k for k, _, _ in want} == {"sliding_attention", "full_attention"}
    assert without_rope_theta(replayed_layers(model, 13)) == without_rope_theta(want)


@pytest.mark.parametrize("pattern", [6, 4])
def test_gemma3_transformers4_form(pattern, tmp_path):
    """A Gemma-3 config.json of transformers 4 (rope_local_base_freq,
    sliding_window_pattern): the layers transformers 5 reads from it."""
    transformers = pytest.importorskip("transformers")
    old = dict(GEMMA3_SHAPE, num_hidden_layers=11, rope_theta=1e6, rope_local_base_freq=10000.0,
               rope_scaling={"rope_type": "linear", "factor": 8.0}, sliding_window_pattern=pattern)
    config = transformers.Gemma3TextConfig(**old)
    model = replay_model(dict(old, model_type="gemma3_text"), tmp_path)
    want = transformers_layers(config)
    assert sum(k == "full_attention" for k, _, _ in want) == 11 // pattern
    assert without_rope_theta(replayed_layers(model, 11)) == without_rope_theta(want)
