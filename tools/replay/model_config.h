// A model's attention shape and RoPE parameters, read from a Hugging Face
// config.json (the fields every engine reads to size its KV cache).
#pragma once

#include <ropekv/ropekv.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace replay {

/// Thrown for a config, trace or argument the tool cannot run; the message
/// is printed as is and the tool exits with status 2.
class InputError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The RoPE parameters of one type of layer. A model has one; Gemma-3 has
/// two (sliding-window layers: rope_theta 10000, no scaling; full-attention
/// layers: rope_theta 1e6 and its rope_scaling).
struct LayerRope {
  std::string layer_type;     ///< "" for a model of one type; else e.g. "sliding_attention"
  double rope_theta = 10000;  ///< rope_theta | rotary_emb_base (default 10000)
  /// rope_scaling (or transformers 5's rope_parameters) as ropekv takes it:
  /// type kNone for none, "default", or a type replayed as default RoPE
  /// (--ignore-rope-scaling).
  ropekv::RopeScaling rope_scaling;
  std::string rope_scaling_type;  ///< "" when none; else rope_scaling.rope_type|type
  std::string rope_scaling_desc;  ///< the rope_scaling object, compact JSON
};

/// The model's normalisation of each q and k head before RoPE (QK-norm), as
/// ropekv's q_norm_weight / k_norm_weight compute it.
enum class QkNorm {
  kNone,
  kWeighted,  ///< RMSNorm with learned weights (Qwen3, Gemma-3, GLM-4.5 with use_qk_norm)
  kUnit,      ///< Llama-4's weightless norm: weights of ones
};

struct ModelConfig {
  std::string path;        ///< file it was read from
  std::string model_type;  ///< "llama", "qwen2", ... ("" when absent)
  int64_t num_qo_heads = 0;   ///< num_attention_heads | n_head
  int64_t num_kv_heads = 0;   ///< num_key_value_heads (default: num_qo_heads)
  int64_t head_dim = 0;       ///< head_dim, else hidden_size / num_attention_heads
  /// The layers that call the op: num_hidden_layers | n_layer, less a hybrid
  /// model's layers without attention (attention_layers).
  int64_t num_layers = 0;
  /// A hybrid model's attention layers (Qwen3-Next: every 4th), as indices
  /// of all its layers; empty when every layer has attention. The replay's
  /// layer i is the model's layer attention_layers[i].
  std::vector<int64_t> attention_layers;
  double partial_rotary_factor = 1.0;  ///< partial_rotary_factor | rotary_pct
  int64_t rotary_dim = 0;     ///< rotated dims per head (rotary_dim, else int(D * factor))
  /// false: GPT-J / CodeGen / GLM interleaved pairs (2i, 2i+1); true: NeoX
  /// rotate-half pairs (i, i + R/2).
  bool is_neox = true;
  int64_t max_position_embeddings = 0;  ///< 0 when absent
  /// The layer types' RoPE parameters (one entry but for models whose layer
  /// types differ in them), and each layer's entry (empty: the first for all).
  std::vector<LayerRope> ropes = {LayerRope{}};
  std::vector<int> layer_rope;
  QkNorm qk_norm = QkNorm::kNone;
  /// The QK-norm's epsilon: rms_norm_eps (LFM2: norm_eps), else the model's
  /// default (1e-6, or 1e-5 for Llama-4, GLM-4.5, EXAONE-4, Apertus, LFM2).
  double norm_eps = 1e-6;
  std::string norm_eps_error;  ///< why the config's epsilon is unusable ("" when it is)
  std::string qk_norm_from;  ///< what set qk_norm: "model_type qwen3", "use_qk_norm", "--qk-norm on"
  std::vector<std::string> notes;  ///< defaults taken, fields ignored (printed)

  /// The index in `ropes` of layer `layer` (0-based), and its parameters.
  size_t rope_index(int64_t layer) const {
    return layer_rope.empty() ? 0 : static_cast<size_t>(layer_rope[static_cast<size_t>(layer)]);
  }
  const LayerRope& rope(int64_t layer) const { return ropes[rope_index(layer)]; }
  /// The layers, among the first `layers`, whose parameters are ropes[i].
  std::vector<int64_t> layers_of(size_t i, int64_t layers) const {
    std::vector<int64_t> out;
    for (int64_t l = 0; l < layers; ++l)
      if (rope_index(l) == i) out.push_back(l);
    return out;
  }
};

/// Reads and checks a config.json. Throws InputError with the file name and
/// the field for anything missing or malformed (a rope_scaling of a known
/// type without a field it needs included). Does not judge whether the
/// library can run it: see check_supported.
ModelConfig load_model_config(const std::string& path);

/// Applies --qk-norm: "auto" keeps what the config says, "off" replays
/// without a QK-norm, "on" with one (the config's kind, else weighted).
void set_qk_norm(ModelConfig& config, const std::string& mode);

/// Throws InputError (naming the config file) when the op cannot compute
/// what the config asks for: a rope_scaling type ropekv does not have
/// (dynamic, longrope, ...) unless `ignore_rope_scaling`, which replays it as
/// default RoPE with a note; or values ropekv rejects (checked through
/// ropekv::rope_inv_freq).
void check_supported(ModelConfig& config, bool ignore_rope_scaling);

/// The RopeConfig of one call of this model with the RoPE parameters `rope`
/// (shape, rope_base, rotary_dim, is_neox, rope_scaling); the pool format is
/// the caller's.
ropekv::RopeConfig rope_config(const ModelConfig& config, const LayerRope& rope);

}  // namespace replay
