#include "model_config.h"

#include <cmath>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

namespace replay {
namespace {

using nlohmann::json;

std::string fmt_num(double v) {
  std::ostringstream o;
  o << v;
  return o.str();
}

[[noreturn]] void fail(const ModelConfig& c, const std::string& what) {
  throw InputError(c.path + ": " + what);
}

/// The first of `names` present and not null, or nullptr.
const json* field(const json& j, std::initializer_list<const char*> names, std::string* which) {
  for (const char* n : names) {
    auto it = j.find(n);
    if (it != j.end() && !it->is_null()) {
      if (which) *which = n;
      return &*it;
    }
  }
  return nullptr;
}

double get_number(const ModelConfig& c, const json& v, const std::string& name) {
  if (!v.is_number()) fail(c, "field \"" + name + "\" must be a number, got " + v.dump());
  return v.get<double>();
}

int64_t get_positive_int(const ModelConfig& c, const json& v, const std::string& name) {
  const double d = get_number(c, v, name);
  if (!(d >= 1) || d != std::floor(d) || d > 1e12)
    fail(c, "field \"" + name + "\" must be a positive integer, got " + v.dump());
  return static_cast<int64_t>(d);
}

int64_t required_int(const ModelConfig& c, const json& j, std::initializer_list<const char*> names) {
  std::string which;
  const json* v = field(j, names, &which);
  if (!v) {
    std::string list;
    for (const char* n : names) list += (list.empty() ? "\"" : " or \"") + std::string(n) + "\"";
    fail(c, "missing field " + list);
  }
  return get_positive_int(c, *v, which);
}

}  // namespace

ModelConfig load_model_config(const std::string& path) {
  ModelConfig c;
  c.path = path;
  std::ifstream in(path);
  if (!in) throw InputError(path + ": cannot open the model config (--config FILE)");
  json j;
  try {
    j = json::parse(in);
  } catch (const json::parse_error& e) {
    fail(c, std::string("not valid JSON: ") + e.what());
  }
  if (!j.is_object()) fail(c, "a config.json must be a JSON object");
  // Multimodal configs nest the language model (Gemma 3, Llama 4, Qwen-VL ...).
  if (j.contains("text_config") && j["text_config"].is_object() &&
      !j.contains("num_attention_heads")) {
    c.notes.push_back("using the attention fields of \"text_config\"");
    const std::string mt = j.value("model_type", std::string());
    j = j["text_config"];
    if (!j.contains("model_type") && !mt.empty()) j["model_type"] = mt;
  }
  if (auto it = j.find("model_type"); it != j.end() && it->is_string()) c.model_type = *it;

  c.num_qo_heads = required_int(c, j, {"num_attention_heads", "n_head", "num_heads"});
  std::string which;
  if (const json* v = field(j, {"num_key_value_heads", "num_kv_heads"}, &which)) {
    c.num_kv_heads = get_positive_int(c, *v, which);
  } else if (j.value("multi_query", false)) {
    c.num_kv_heads = 1;
  } else {
    c.num_kv_heads = c.num_qo_heads;
    c.notes.push_back("no num_key_value_heads: multi-head attention, " +
                      std::to_string(c.num_kv_heads) + " kv heads");
  }
  if (c.num_qo_heads % c.num_kv_heads != 0)
    fail(c, "num_attention_heads " + std::to_string(c.num_qo_heads) +
                " is not a multiple of num_key_value_heads " + std::to_string(c.num_kv_heads));

  if (const json* v = field(j, {"head_dim"}, &which)) {
    c.head_dim = get_positive_int(c, *v, which);
  } else {
    const int64_t hidden = required_int(c, j, {"hidden_size", "n_embd", "d_model"});
    if (hidden % c.num_qo_heads != 0)
      fail(c, "no head_dim, and hidden_size " + std::to_string(hidden) +
                  " is not a multiple of num_attention_heads " + std::to_string(c.num_qo_heads));
    c.head_dim = hidden / c.num_qo_heads;
  }
  c.num_layers = required_int(c, j, {"num_hidden_layers", "n_layer", "num_layers"});

  if (const json* v = field(j, {"rope_theta", "rotary_emb_base", "rope_base"}, &which)) {
    c.rope_theta = get_number(c, *v, which);
    if (!(c.rope_theta > 0) || !std::isfinite(c.rope_theta))
      fail(c, "\"" + which + "\" must be a finite number > 0, got " + v->dump());
  } else {
    c.notes.push_back("no rope_theta: using the Hugging Face default 10000");
  }

  // Rotary dimension: an absolute rotary_dim (GPT-J, CodeGen) or a fraction
  // of the head (partial_rotary_factor in Phi/Phi-3/StableLM, rotary_pct in
  // GPT-NeoX). Hugging Face: int(head_dim * factor).
  c.rotary_dim = c.head_dim;
  if (const json* v = field(j, {"rotary_dim"}, &which)) {
    c.rotary_dim = get_positive_int(c, *v, which);
    c.partial_rotary_factor = static_cast<double>(c.rotary_dim) / static_cast<double>(c.head_dim);
  } else if (const json* f = field(j, {"partial_rotary_factor", "rotary_pct"}, &which)) {
    c.partial_rotary_factor = get_number(c, *f, which);
    if (!(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1))
      fail(c, "\"" + which + "\" must be in (0, 1], got " + f->dump());
    c.rotary_dim = static_cast<int64_t>(static_cast<double>(c.head_dim) * c.partial_rotary_factor);
  }
  if (c.rotary_dim > c.head_dim || c.rotary_dim < 2 || c.rotary_dim % 2 != 0)
    fail(c, "rotary dimension " + std::to_string(c.rotary_dim) + " must be even, >= 2 and <= head_dim " +
                std::to_string(c.head_dim));
  if (c.head_dim % 2 != 0) fail(c, "head_dim " + std::to_string(c.head_dim) + " must be even");

  // GPT-J (and CodeGen, which copies its attention) rotate interleaved pairs.
  c.interleaved = c.model_type == "gptj" || c.model_type == "codegen";

  if (const json* v = field(j, {"rope_scaling"}, &which)) {
    if (!v->is_object()) fail(c, "\"rope_scaling\" must be an object or null, got " + v->dump());
    std::string type;
    if (auto it = v->find("rope_type"); it != v->end() && it->is_string()) type = *it;
    else if (auto it2 = v->find("type"); it2 != v->end() && it2->is_string()) type = *it2;
    if (type.empty()) fail(c, "\"rope_scaling\" has no \"rope_type\" (or \"type\"): " + v->dump());
    if (type != "default") {
      c.rope_scaling_type = type;
      c.rope_scaling_desc = v->dump();
    }
  }
  return c;
}

void check_supported(ModelConfig& c, bool ignore_rope_scaling, bool lib_has_rotary_dim) {
  if (c.interleaved)
    fail(c, "model_type \"" + c.model_type +
                "\" rotates interleaved pairs (2i, 2i+1) (GPT-J style); this ropekv computes "
                "NeoX rotate-half pairs (i, i + R/2) only, so the replay cannot run it yet");
  if (c.rotary_dim != c.head_dim && !lib_has_rotary_dim)
    fail(c, "partial rotary (factor " + fmt_num(c.partial_rotary_factor) + ": rotary dim " +
                std::to_string(c.rotary_dim) + " of head_dim " + std::to_string(c.head_dim) +
                ") is not supported by this ropekv yet (ropekv::RopeConfig has no rotary_dim); "
                "use a config with partial_rotary_factor 1");
  if (c.rope_scaling_type.empty()) return;
  const bool known = c.rope_scaling_type == "llama3" || c.rope_scaling_type == "yarn";
  if (!known && !ignore_rope_scaling)
    fail(c, "rope_scaling type \"" + c.rope_scaling_type +
                "\" is not supported: ropekv computes default RoPE (inv_freq = theta^(-2i/R)); "
                "llama3 and yarn are replayed as default RoPE with a note; pass "
                "--ignore-rope-scaling to do the same for this type");
  c.notes.push_back("rope_scaling " + c.rope_scaling_desc + " ignored: the op is called with default " +
                    "RoPE frequencies (theta " + fmt_num(c.rope_theta) +
                    "), as ropekv's call has no scaling; cost per call is the same");
}

}  // namespace replay
