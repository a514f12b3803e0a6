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
    return replay_summary(config, tmp_path)["model"]


def replay_summary(config: dict, tmp_path, *args: str) -> dict:
    """Replays `config` (two requests, every layer unless `args` say
    otherwise); its JSON summary."""
    if not REPLAY.exists():
        pytest.skip(f"no {REPLAY}: build the C++ tree (scripts/setup.sh) or set ROPEKV_REPLAY")
    path, out = tmp_path / "config.json", tmp_path / "summary.json"
    path.write_text(json.dumps(config))
    run = subprocess.run([str(REPLAY), "--no-progress", "--config", str(path), "--requests", "2",
                          "--json", str(out), *args], capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.rstrip().endswith("verified"), run.stdout
    return json.loads(out.read_text())


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


QK_SHAPE = dict(hidden_size=256, head_dim=64, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=2, rms_norm_eps=3e-6)


@pytest.mark.parametrize("module, config_class, attention_class, extra", [
    ("qwen3", "Qwen3Config", "Qwen3Attention", {}),
    ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeAttention", {}),
    ("qwen3_next", "Qwen3NextConfig", "Qwen3NextAttention", {"num_hidden_layers": 4}),
    ("qwen3_vl", "Qwen3VLTextConfig", "Qwen3VLTextAttention", {}),
    ("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5Attention", {"num_hidden_layers": 4}),
    ("gemma3", "Gemma3TextConfig", "Gemma3Attention", {}),
    ("dots1", "Dots1Config", "Dots1Attention", {}),
    ("exaone4", "Exaone4Config", "Exaone4Attention", {}),
    ("apertus", "ApertusConfig", "ApertusAttention", {}),
    ("lfm2", "Lfm2Config", "Lfm2Attention", {"norm_eps": 3e-6}),
    ("glm4_moe", "Glm4MoeConfig", "Glm4MoeAttention", {"use_qk_norm": True}),
    ("glm4_moe", "Glm4MoeConfig", "Glm4MoeAttention", {}),
    ("llama4", "Llama4TextConfig", "Llama4TextAttention", {}),
    ("llama4", "Llama4TextConfig", "Llama4TextAttention", {"use_qk_norm": False}),
    ("cohere", "CohereConfig", "CohereAttention", {"use_qk_norm": True}),
    ("olmo2", "Olmo2Config", "Olmo2Attention", {}),
    ("llama", "LlamaConfig", "LlamaAttention", {}),
], ids=["qwen3", "qwen3_moe", "qwen3_next", "qwen3_vl_text", "qwen3_5_text", "gemma3", "dots1",
        "exaone4", "apertus", "lfm2", "glm4_moe-qk-norm", "glm4_moe", "llama4", "llama4-no-qk-norm",
        "cohere-layernorm", "olmo2-whole-projection", "llama"])
def test_qk_norm_as_transformers_attention_has_it(module, config_class, attention_class, extra, tmp_path):
    """The replay's QK-norm (its JSON summary's qk_norm) is the one the
    model's attention layer has in transformers: an RMSNorm of head_dim with
    weights (q_norm / k_norm: "random" weights in the replay), Llama-4's
    weightless norm ("ones"), or none, where the norm is over more than one
    head (OLMo-2) or a LayerNorm (Cohere); with the same epsilon."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    import importlib
    config = getattr(transformers, config_class)(**{**QK_SHAPE, **extra})
    try:
        modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    except ImportError as e:  # this transformers lacks a dependency of the model's code
        pytest.skip(str(e))
    attention = getattr(modeling, attention_class)(config, layer_idx=0)
    q_norm = next((getattr(attention, name) for name in ("q_norm", "qk_norm", "q_layernorm")
                   if getattr(attention, name, None) is not None), None)
    weight = getattr(q_norm, "weight", None)
    eps = getattr(q_norm, "variance_epsilon", getattr(q_norm, "eps", None))
    if q_norm is None or type(q_norm).__name__.endswith("LayerNorm") or (
            weight is not None and tuple(weight.shape) != (QK_SHAPE["head_dim"],)):
        want = None
    else:
        want = {"weights": "random" if weight is not None else "ones", "norm_eps": eps}
    summary = replay_summary(config.to_dict(), tmp_path)
    got = summary["qk_norm"]
    assert (None if got is None else {k: got[k] for k in ("weights", "norm_eps")}) == want


@pytest.mark.parametrize("config_class", [
    "Qwen3NextConfig", "Qwen3_5TextConfig", "Qwen3_5MoeTextConfig", "JambaConfig", "MiniMaxConfig",
    "NemotronHConfig", "Gemma3TextConfig", "Qwen3Config"])
def test_attention_layers_as_transformers_caches_them(config_class, tmp_path):
    """A hybrid model calls the op on its attention layers only: the
    replay's attention_layers (all layers: []) are the layers for which
    transformers' DynamicCache holds keys and values (a CacheLayerMixin), not
    the Gated DeltaNet, Mamba or MoE-only layers' states (or none)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from transformers import cache_utils
    config_type = getattr(transformers, config_class, None)
    if config_type is None:
        pytest.skip(f"this transformers has no {config_class}")
    config = config_type(num_hidden_layers=12) if config_class == "Qwen3NextConfig" else config_type()
    layers = cache_utils.DynamicCache(config=config).layers
    with_kv = [i for i, layer in enumerate(layers) if isinstance(layer, cache_utils.CacheLayerMixin)]
    assert 0 < len(with_kv) <= len(layers)
    saved = json.loads(config.to_json_string(use_diff=False))  # as a config.json has it (no Infinity)
    model = replay_summary(saved, tmp_path, "--layers", "1")["model"]
    assert model["attention_layers"] == ([] if len(with_kv) == len(layers) else with_kv)
    assert model["num_layers"] == len(with_kv)


@pytest.mark.parametrize("module, config_class, attention_class", [
    ("cohere2", "Cohere2Config", "Cohere2Attention"),
    ("exaone4", "Exaone4Config", "Exaone4Attention"),
])
def test_sliding_models_nope_layers_as_transformers_attention_has_them(module, config_class, attention_class,
                                                                       tmp_path):
    """Cohere2's and EXAONE-4's attention rotates only in its sliding-window
    layers; the replay's note names the others (layer_types' full-attention
    layers)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    import importlib
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    config = getattr(transformers, config_class)(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                                 num_hidden_layers=10, sliding_window_pattern=3)
    attention = [getattr(modeling, attention_class)(config, layer_idx=i) for i in range(10)]
    if module == "cohere2":
        nope = [i for i, a in enumerate(attention) if a.sliding_window is None]
    else:  # rotates where `self.sliding_window is None or self.is_sliding`
        nope = [i for i, a in enumerate(attention) if a.sliding_window is not None and not a.is_sliding]
    assert nope == [2, 5, 8]
    notes = replay_summary(config.to_dict(), tmp_path, "--layers", "1")["model"]["notes"]
    want = (f"{module}: the full-attention layers of layer_types: {len(nope)} layers "
            f"({', '.join(map(str, nope))}) use no RoPE (NoPE)")
    assert any(n.startswith(want) for n in notes), notes


# Hybrid configs as a model's config.json gives them (the fields the config
# classes derive layer_types from, without layer_types): each made by
# transformers from the same fields, whose DynamicCache is the oracle.
HYBRID_BASE = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   intermediate_size=512, vocab_size=1000)


@pytest.mark.parametrize("fields", [
    dict(model_type="qwen3_next", num_hidden_layers=8, full_attention_interval=2),
    dict(model_type="qwen3_5_text", num_hidden_layers=8),
    dict(model_type="nemotron_h", hybrid_override_pattern="M-M*-E"),
    dict(model_type="nemotron_h", hybrid_override_pattern="M*M*", num_hidden_layers=6),
    dict(model_type="jamba", num_hidden_layers=16),
    dict(model_type="jamba", num_hidden_layers=8, attn_layer_period=4, attn_layer_offset=1),
    dict(model_type="bamba", num_hidden_layers=8, attn_layer_indices=[2, 5]),
    dict(model_type="lfm2", num_hidden_layers=6, full_attn_idxs=[2, 5]),
    dict(model_type="recurrent_gemma", num_hidden_layers=6, block_types=["recurrent", "recurrent", "attention"]),
    dict(model_type="zamba", num_hidden_layers=8, attn_layer_period=2, attn_layer_offset=1),
    dict(model_type="olmo_hybrid", num_hidden_layers=8),
], ids=lambda f: "-".join(str(v) for k, v in f.items() if k in ("model_type", "hybrid_override_pattern")))
def test_attention_layers_from_a_config_json_as_transformers_reads_it(fields, tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from transformers import cache_utils
    config = dict(HYBRID_BASE, **fields)
    kwargs = {k: v for k, v in config.items() if k != "model_type"}
    try:
        made = transformers.AutoConfig.for_model(config["model_type"], **kwargs)
    except ValueError as e:  # this transformers lacks the model
        pytest.skip(str(e))
    layers = cache_utils.DynamicCache(config=made).layers
    with_kv = [i for i, layer in enumerate(layers) if isinstance(layer, cache_utils.CacheLayerMixin)]
    assert 0 < len(with_kv) < len(layers)
    model = replay_summary(config, tmp_path, "--layers", "1")["model"]
    assert (model["attention_layers"], model["num_layers"]) == (with_kv, len(with_kv))


def replay_error(config: dict, tmp_path) -> str:
    """Runs the replay on `config`, which must be refused (exit 2); its message."""
    if not REPLAY.exists():
        pytest.skip(f"no {REPLAY}: build the C++ tree (scripts/setup.sh) or set ROPEKV_REPLAY")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    run = subprocess.run([str(REPLAY), "--no-progress", "--config", str(path), "--requests", "2"],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 2, run.stdout + run.stderr
    return run.stderr


@pytest.mark.parametrize("fields, message", [
    (dict(model_type="qwen3_next", num_hidden_layers=8, layer_types=["linear_attention", "full_attention"] * 3),
     '"layer_types" has 6 entries, but num_hidden_layers is 8'),
    (dict(model_type="nemotron_h", hybrid_override_pattern=""), '"hybrid_override_pattern" gives no layers'),
    (dict(model_type="nemotron_h", layers_block_type="M*M*"), '"layers_block_type" must be a list of layer type names'),
    (dict(model_type="nemotron_h", hybrid_override_pattern="M-M-"), "gives no attention layer"),
    (dict(model_type="qwen3_next", num_hidden_layers=2, layer_types=["linear_atention", "full_attention"]),
     '"layer_types" names the layer type "linear_atention", which the tool does not know'),
    (dict(model_type="jamba", num_hidden_layers=8, attn_layer_period=4, attn_layer_offset=1.5),
     '"attn_layer_offset" must be an integer in [0, attn_layer_period 4), got 1.5'),
    (dict(model_type="qwen3", num_hidden_layers=2, rms_norm_eps=1e39),
     '"rms_norm_eps" must be a number, finite and >= 0 as a float32 for the QK-norm, got 1e+39'),
])
def test_hybrid_and_qk_norm_config_errors(fields, message, tmp_path):
    assert message in replay_error(dict(HYBRID_BASE, **fields), tmp_path)


def test_rms_norm_eps_is_read_only_for_a_qk_norm(tmp_path):
    """A model without a QK-norm does not judge rms_norm_eps or use_qk_norm
    (LlamaConfig keeps what it does not read)."""
    config = dict(HYBRID_BASE, model_type="llama", num_hidden_layers=2, rms_norm_eps="small", use_qk_norm=1)
    assert replay_summary(config, tmp_path)["qk_norm"] is None


def test_llama4_yarn_attention_factor_note(tmp_path):
    """Llama-4's norm after RoPE divides out yarn's attention factor; ropekv's
    before it does not: the replay says so."""
    config = dict(HYBRID_BASE, model_type="llama4_text", num_hidden_layers=2, max_position_embeddings=65536,
                  rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192})
    summary = replay_summary(config, tmp_path)
    assert summary["qk_norm"]["weights"] == "ones"
    assert any(n.startswith("Llama-4's weightless norm after RoPE divides out the attention factor 1.13")
               for n in summary["model"]["notes"]), summary["model"]["notes"]


# A value for each rope_scaling key either reader reads, valid for every type
# that reads it (a Llama config of max_position_embeddings 131072).
SCALING_VALUES = dict(factor=2.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=8192, beta_fast=32.0, beta_slow=1.0,
                      attention_factor=1.0, mscale=1.0, mscale_all_dim=1.0, truncate=True,
                      rope_theta=500000.0, partial_rotary_factor=1.0)


def scaling_reads(rope_scaling: dict, tmp_path) -> tuple:
    """(the keys the Python layer warns it ignores, the replay's notes of
    ignored keys) for one rope_scaling dict of a Llama config."""
    import warnings

    import ropekv

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ropekv._rope_parameters(rope_scaling)
    python = [str(w.message) for w in caught if "ignores" in str(w.message)]
    config = dict(HYBRID_BASE, model_type="llama", num_hidden_layers=2, max_position_embeddings=131072,
                  rope_theta=500000.0, rope_scaling=rope_scaling)
    notes = replay_summary(config, tmp_path, "--layers", "1")["model"]["notes"]
    return python, [n for n in notes if "ignored" in n]


@pytest.mark.parametrize("kind", ["linear", "llama3", "yarn", "proportional"])
def test_scaling_keys_read_alike(kind, tmp_path):
    """The Python layer (_SCALING_KEYS, _BASE_KEYS) and the replay's reader
    (model_config.cc) each list the rope_scaling keys a type reads, in two
    languages: every key the Python layer reads, the replay reads too (no note
    of it ignored), and a key neither reads draws a warning from one and a
    note from the other. A key of SCALING_VALUES added to or dropped from one
    list alone fails here (a new key belongs in SCALING_VALUES too)."""
    import ropekv

    required, optional = ropekv._SCALING_KEYS[kind]
    keys = (*[k for k in ropekv._BASE_KEYS if k != "type"], *required, *optional)
    full = {k: SCALING_VALUES[k] for k in keys if k != "rope_type"}
    full["rope_type"] = kind
    if kind == "proportional":  # (its partial_rotary_factor: the fraction of pairs that rotate)
        full["partial_rotary_factor"] = 0.5
    assert scaling_reads(full, tmp_path) == ([], [])
    unread = [k for k in SCALING_VALUES if k not in keys] + ["beta_fst"]
    python, replay = scaling_reads(dict(full, **{k: SCALING_VALUES.get(k, 1.0) for k in unread}), tmp_path)
    assert len(python) == 1 and len(replay) == 1, (python, replay)
    for k in unread:
        assert repr(k) in python[0] and f'"{k}"' in replay[0], (k, python, replay)
