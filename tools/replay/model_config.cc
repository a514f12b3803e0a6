#include "model_config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
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

/// A number of the rope_scaling object: `fallback` when absent or null (HF's
/// `get(key) or default`: 0 also means absent when `zero_is_absent`), an
/// error naming the type and the field when required.
double scaling_number(const ModelConfig& c, const json& s, const std::string& key, const std::string& type,
                      const char* name, bool required, double fallback = 0.0, bool zero_is_absent = false) {
  auto it = s.find(name);
  if (it == s.end() || it->is_null()) {
    if (required)
      fail(c, "\"" + key + "\" of type \"" + type + "\" needs the field \"" + name + "\": " + s.dump());
    return fallback;
  }
  const double v = get_number(c, *it, key + "." + name);
  if (zero_is_absent && v == 0.0) return fallback;
  return v;
}

/// Gemma-4 gives its full-attention layers a head of their own
/// (global_head_dim, 512 where absent in transformers' Gemma4TextConfig) and,
/// where attention_k_eq_v, kv heads of their own (num_global_key_value_heads):
/// a replay has one shape for every layer, so such a config is refused.
void check_one_shape(const ModelConfig& c, const json& j) {
  const bool gemma4 = c.model_type == "gemma4" || c.model_type == "gemma4_text";
  int64_t global = gemma4 ? 512 : c.head_dim;
  if (auto it = j.find("global_head_dim"); it != j.end() && !it->is_null())
    global = get_positive_int(c, *it, "global_head_dim");
  if (global != c.head_dim)
    fail(c, "the full-attention layers' head_dim " + std::to_string(global) +
                (j.contains("global_head_dim") ? " (\"global_head_dim\")"
                                               : " (Gemma-4's default global_head_dim)") +
                " differs from \"head_dim\" " + std::to_string(c.head_dim) +
                ": the replay takes one shape for every layer");
  auto k_eq_v = j.find("attention_k_eq_v");
  auto kv = j.find("num_global_key_value_heads");
  if (k_eq_v != j.end() && k_eq_v->is_boolean() && k_eq_v->get<bool>() && kv != j.end() &&
      !kv->is_null() && get_positive_int(c, *kv, "num_global_key_value_heads") != c.num_kv_heads)
    fail(c, "the full-attention layers' kv heads " + kv->dump() +
                " (\"num_global_key_value_heads\", with \"attention_k_eq_v\") differ from "
                "\"num_key_value_heads\" " + std::to_string(c.num_kv_heads) +
                ": the replay takes one shape for every layer");
}

/// The rope_type (or type) of a rope_scaling object, "" where neither is a
/// string (parse_rope_scaling reports that).
std::string rope_type_of(const json& s) {
  for (const char* k : {"rope_type", "type"})
    if (auto it = s.find(k); it != s.end() && it->is_string()) return *it;
  return "";
}

void parse_rope_scaling(ModelConfig& c, const json& s, const std::string& key, LayerRope& lr,
                        const json* partial, const std::string& partial_key) {
  std::string type;
  for (const char* k : {"rope_type", "type"}) {
    auto it = s.find(k);
    if (it == s.end() || it->is_null()) continue;
    if (!it->is_string()) fail(c, "\"" + key + "." + k + "\" must be a string, got " + it->dump());
    type = *it;
    break;
  }
  if (type.empty()) fail(c, "\"" + key + "\" has no \"rope_type\" (or \"type\"): " + s.dump());
  // Keys the replay does not read, named in a note (a misspelt optional key
  // keeps its default), as the Python layer warns and transformers logs.
  std::vector<std::string> read = {"rope_type", "type", "rope_theta", "partial_rotary_factor"};
  if (type == "linear") read.insert(read.end(), {"factor"});
  if (type == "llama3")
    read.insert(read.end(), {"factor", "low_freq_factor", "high_freq_factor",
                             "original_max_position_embeddings"});
  if (type == "yarn")
    read.insert(read.end(), {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                             "attention_factor", "mscale", "mscale_all_dim", "truncate"});
  if (type == "proportional") read.insert(read.end(), {"factor"});
  // (A type the replay does not compute is refused or replayed as default
  // RoPE by check_supported: its keys are not listed.)
  std::string unread;
  if (type == "default" || type == "linear" || type == "llama3" || type == "yarn" ||
      type == "proportional")
    for (const auto& item : s.items())
      if (std::find(read.begin(), read.end(), item.key()) == read.end())
        unread += (unread.empty() ? "\"" : ", \"") + item.key() + "\"";
  if (!unread.empty())
    c.notes.push_back(key + " " + unread + " ignored" +
                      (s.contains("mrope_section")
                           ? ": one position per token (multimodal RoPE's three agree for text tokens)"
                           : std::string(" (not read for type \"") + type + "\")"));
  if (type == "default") return;
  lr.rope_scaling_type = type;
  lr.rope_scaling_desc = s.dump();
  ropekv::RopeScaling& r = lr.rope_scaling;
  using T = ropekv::RopeScalingType;
  if (type == "linear") {
    r.type = T::kLinear;
    r.factor = scaling_number(c, s, key, type, "factor", true);
  } else if (type == "llama3") {
    r.type = T::kLlama3;
    r.factor = scaling_number(c, s, key, type, "factor", true);
    r.low_freq_factor = scaling_number(c, s, key, type, "low_freq_factor", true);
    r.high_freq_factor = scaling_number(c, s, key, type, "high_freq_factor", true);
    r.original_max_position_embeddings =
        scaling_number(c, s, key, type, "original_max_position_embeddings", true);
  } else if (type == "yarn") {
    // transformers (4.4x) and vLLM: original_max_position_embeddings from the
    // block, else the model's max_position_embeddings; factor as given.
    r.type = T::kYarn;
    r.factor = scaling_number(c, s, key, type, "factor", true);
    r.original_max_position_embeddings =
        scaling_number(c, s, key, type, "original_max_position_embeddings", false);
    if (r.original_max_position_embeddings == 0.0) {
      if (c.max_position_embeddings == 0)
        fail(c, "\"" + key + "\" of type \"yarn\" needs \"original_max_position_embeddings\" (or the "
                "model's \"max_position_embeddings\"): " + s.dump());
      r.original_max_position_embeddings = static_cast<double>(c.max_position_embeddings);
      c.notes.push_back("yarn without original_max_position_embeddings: using max_position_embeddings " +
                        std::to_string(c.max_position_embeddings));
    }
    r.beta_fast = scaling_number(c, s, key, type, "beta_fast", false, 32.0, true);
    r.beta_slow = scaling_number(c, s, key, type, "beta_slow", false, 1.0, true);
    // (Given, it is the factor, 0 too, which ropekv refuses below; absent,
    // the library makes it from mscale.)
    if (auto it = s.find("attention_factor"); it != s.end() && !it->is_null())
      r.attention_factor = get_number(c, *it, key + ".attention_factor");
    r.mscale = scaling_number(c, s, key, type, "mscale", false);
    r.mscale_all_dim = scaling_number(c, s, key, type, "mscale_all_dim", false);
    // (A null truncate does not truncate: transformers' get("truncate", True)
    // is then None, which its test takes as false.)
    if (auto it = s.find("truncate"); it != s.end()) {
      if (!it->is_boolean() && !it->is_null())
        fail(c, "\"" + key + ".truncate\" must be true, false or null, got " + it->dump());
      r.truncate = !it->is_null() && it->get<bool>();
    }
  } else if (type == "proportional") {
    // Gemma-4's full-attention layers: partial_rotary_factor here is the
    // fraction of the pairs that rotate (the rest are copied), not rotary_dim.
    r.type = T::kProportional;
    r.factor = scaling_number(c, s, key, type, "factor", false, 1.0);
    if (partial && !partial->is_null()) r.partial_rotary_factor = get_number(c, *partial, partial_key);
  }
  // Any other type (dynamic, longrope, ...) stays kNone with its name kept:
  // check_supported refuses it or replays it as default RoPE.
}

// NoPE layers rotate nothing: an engine writes their pool rows without a
// rotation, a call ropekv does not have (rotary_dim >= 2), so the replay
// rotates them like the others and says so. Llama-4 and SmolLM3 mark them
// with no_rope_layers[i] == 0 or, where that list is absent or empty, make
// every no_rope_layer_interval-th layer one (4 by default), as their config
// classes fill it; Cohere2's full-attention layers are NoPE. "" for none.
std::string nope_note(const json& j, const ModelConfig& c) {
  const std::string tail =
      " no RoPE (NoPE); replayed with RoPE (ropekv has no call without a rotation)";
  // Jamba's, Zamba's and Nemotron-H's attention has no rotary embedding (their Mamba
  // layers carry position), nor has Granite-4.0-H's unless its
  // position_embedding_type is "rope", nor Zamba2's unless use_mem_rope.
  const auto pe = j.find("position_embedding_type");
  if (c.model_type == "jamba" || c.model_type == "nemotron_h" || c.model_type == "zamba" ||
      (c.model_type == "granitemoehybrid" && !(pe != j.end() && *pe == "rope")) ||
      (c.model_type == "zamba2" && !(j.contains("use_mem_rope") && j["use_mem_rope"] == true)))
    return c.model_type + ": the attention layers use" + tail;
  std::vector<int64_t> nope;
  std::string how = "no_rope_layers";
  const auto it = j.find("no_rope_layers");
  const auto types = j.find("layer_types");
  const auto window = j.find("sliding_window");
  if (c.model_type == "cohere2" ||
      (c.model_type == "exaone4" && window != j.end() && !window->is_null())) {
    // Cohere2's full-attention layers, and EXAONE-4's where it has sliding
    // layers: by layer_types, else every sliding_window_pattern-th layer
    // (default 4; EXAONE-4 also takes a string such as "LLLG", G global), as
    // their config classes fill them.
    const auto p = j.find("sliding_window_pattern");
    if (types != j.end() && types->is_array()) {
      how = c.model_type + ": the full-attention layers of layer_types";
      for (size_t i = 0; i < types->size(); ++i)
        if ((*types)[i] == "full_attention") nope.push_back(static_cast<int64_t>(i));
    } else if (p != j.end() && p->is_string() && !p->get<std::string>().empty()) {
      const std::string pat = p->get<std::string>();
      how = c.model_type + ": the full-attention layers, the G of sliding_window_pattern \"" + pat + "\"";
      for (int64_t i = 0; i < c.num_layers; ++i)
        if (pat[static_cast<size_t>(i) % pat.size()] == 'G') nope.push_back(i);
    } else {
      int64_t pattern = 4;
      if (p != j.end() && p->is_number_integer()) pattern = p->get<int64_t>();
      how = c.model_type + ": the full-attention layers, every " + std::to_string(pattern) +
            "th (sliding_window_pattern)";
      for (int64_t i = pattern - 1; pattern > 0 && i < c.num_layers; i += pattern) nope.push_back(i);
    }
  } else if (it != j.end() && it->is_array() && !it->empty()) {
    for (size_t i = 0; i < it->size(); ++i)
      if ((*it)[i].is_number() && (*it)[i].get<double>() == 0.0)
        nope.push_back(static_cast<int64_t>(i));
  } else if (c.model_type == "llama4" || c.model_type == "llama4_text" ||
             c.model_type == "smollm3") {
    int64_t interval = 4;
    if (const auto iv = j.find("no_rope_layer_interval");
        iv != j.end() && iv->is_number_integer())
      interval = iv->get<int64_t>();
    how = "no_rope_layer_interval " + std::to_string(interval) + " (no no_rope_layers)";
    for (int64_t i = interval - 1; interval > 0 && i < c.num_layers; i += interval)
      nope.push_back(i);
  }
  if (nope.empty()) return "";
  std::string layers;
  for (size_t i = 0; i < nope.size() && i < 8; ++i)
    layers += (i ? ", " : "") + std::to_string(nope[i]);
  if (nope.size() > 8) layers += ", ...";
  return how + ": " + std::to_string(nope.size()) + " layer" + (nope.size() == 1 ? "" : "s") +
         " (" + layers + ")" + (nope.size() == 1 ? " uses" : " use") + tail;
}

// Whether the model normalises each q and k head before RoPE, and how
// (transformers' attention classes). Qwen3's (Qwen3-Next, Qwen3.5, Qwen3-VL),
// Gemma-3's, Gemma-3n's and Gemma-4's (which normalise v too: a note),
// dots.llm1's, EXAONE-4's, Apertus' and LFM2's attention always do (an
// RMSNorm of head_dim with learned weights; Gemma's and Qwen3-Next's scale
// by 1 + w, which ropekv takes as the weight); GLM-4.5 (glm4_moe)
// where use_qk_norm; Llama-4 where use_qk_norm (true by default) with a
// weightless norm after RoPE, which is the same as before it with weights of
// ones (a rotation of the whole head keeps its norm). Cohere's use_qk_norm is
// a LayerNorm, and another model's use_qk_norm a form the tool does not know:
// notes, no norm. (A multimodal config's text_config may lack its own
// model_type: the outer one, e.g. qwen3_vl, then stands for it.)
void read_qk_norm(ModelConfig& c, const json& j) {
  static const char* const kAlways[] = {
      "qwen3",   "qwen3_moe",    "qwen3_next",  "qwen3_vl",         "qwen3_vl_text", "qwen3_vl_moe",
      "qwen3_vl_moe_text",       "qwen3_5",     "qwen3_5_text",     "qwen3_5_moe",   "qwen3_5_moe_text",
      "gemma3",  "gemma3_text",  "gemma3n",     "gemma3n_text",     "gemma4",        "gemma4_text",
      "dots1",   "exaone4",      "apertus",     "lfm2",             "lfm2_moe"};
  const bool llama4 = c.model_type == "llama4" || c.model_type == "llama4_text";
  const bool reads_flag = llama4 || c.model_type == "glm4_moe" || c.model_type == "cohere";
  bool use = llama4;  // Llama4TextConfig's default
  const json* flag = field(j, {"use_qk_norm"}, nullptr);
  if (flag && reads_flag) {
    if (!flag->is_boolean()) fail(c, "\"use_qk_norm\" must be true or false, got " + flag->dump());
    use = flag->get<bool>();
  }
  if (std::find(std::begin(kAlways), std::end(kAlways), c.model_type) != std::end(kAlways)) {
    c.qk_norm = QkNorm::kWeighted;
    c.qk_norm_from = "model_type " + c.model_type;
    if (c.model_type.rfind("gemma3n", 0) == 0 || c.model_type.rfind("gemma4", 0) == 0)
      c.notes.push_back(c.model_type + " also normalises v (an RMSNorm without weights) before "
                        "caching it, which ropekv leaves to the engine: replayed with v as drawn");
  } else if (use && (llama4 || c.model_type == "glm4_moe")) {
    c.qk_norm = llama4 ? QkNorm::kUnit : QkNorm::kWeighted;
    c.qk_norm_from = flag ? "use_qk_norm" : "use_qk_norm, " + c.model_type + "'s default true";
  } else if (use && c.model_type == "cohere") {
    c.notes.push_back("use_qk_norm: cohere's QK-norm is a LayerNorm (mean subtracted), not ropekv's "
                      "RMSNorm; replayed without it");
  } else if (!reads_flag && flag && *flag == true) {
    c.notes.push_back("use_qk_norm of model_type \"" + c.model_type +
                      "\": its form is not known to the tool; replayed without a QK-norm (--qk-norm on "
                      "replays ropekv's RMSNorm of each head)");
  }
  const bool lfm2 = c.model_type == "lfm2" || c.model_type == "lfm2_moe";
  const char* key = lfm2 ? "norm_eps" : "rms_norm_eps";
  if (llama4 || lfm2 || c.model_type == "glm4_moe" || c.model_type == "exaone4" || c.model_type == "apertus")
    c.norm_eps = 1e-5;  // their config classes' defaults
  if (const json* v = field(j, {key}, nullptr)) {
    if (v->is_number()) c.norm_eps = v->get<double>();
    if (!v->is_number() || !(std::isfinite(c.norm_eps) && c.norm_eps >= 0 &&
                             std::isfinite(static_cast<float>(c.norm_eps))))
      c.norm_eps_error = "\"" + std::string(key) + "\" must be a number, finite and >= 0 as a float32 for the "
                         "QK-norm, got " + v->dump();
  }
}

// A hybrid model's layers without attention (Qwen3-Next and Qwen3.5's Gated
// DeltaNet, Mamba, short-convolution, recurrent, MoE-only and MLP-only
// layers) have no KV cache and no RoPE: an engine calls the op for the other
// layers only. Their kinds as the config gives them, read as the config
// classes read them: transformers' layer_types (with its older names);
// Nemotron-H's layers_block_type or hybrid_override_pattern (M Mamba, *
// attention, E MoE, - MLP), whose length is the number of layers; Bamba's
// attn_layer_indices; LFM2's full_attn_idxs; RecurrentGemma's block_types
// (cycled); Jamba's attn_layer_period and attn_layer_offset (default 8, 4)
// and Zamba's (default 6, 4, after two Mamba layers and a hybrid one);
// Qwen3-Next's and Qwen3.5's full_attention_interval (default 4); OLMo-hybrid's
// default (every 4th layer). Keeps the attention layers' entries in
// j["layer_types"], counts only them in num_layers, and names them in
// attention_layers. `given` is whether the config gave num_hidden_layers.
void drop_layers_without_attention(ModelConfig& c, json& j, bool given) {
  static const char* const kNoAttention[] = {"linear_attention", "mamba", "mamba2", "conv",
                                             "moe",              "mlp",   "recurrent"};
  // The kinds with attention that transformers knows (its allowed layer
  // types and their older names); another name is refused, as transformers
  // refuses it, rather than guessed.
  static const char* const kAttention[] = {
      "full_attention",    "sliding_attention", "chunked_attention",           "window_attention",
      "indexed_attention", "hybrid",            "hybrid_sliding",              "attention",
      "minimax_m3_sparse", "deepseek_sparse_attention", "qwen_sparse_attention", "compressed_sparse_attention",
      "heavily_compressed_attention", "reference_sliding_attention"};
  std::string source;
  json kinds;
  bool sets_count = false;  // the kinds give the number of layers (Nemotron-H)
  // Layer i is full attention where it is in the list `key` (a list of indices).
  auto from_indices = [&](const char* key, const char* other) {
    const json* v = field(j, {key}, &source);
    if (!v->is_array()) fail(c, "\"" + std::string(key) + "\" must be a list of layer indices, got " + v->dump());
    for (int64_t i = 0; i < c.num_layers; ++i)
      kinds.push_back(std::find(v->begin(), v->end(), json(i)) != v->end() ? "full_attention" : other);
  };
  if (const json* v = field(j, {"layer_types"}, &source)) {
    kinds = *v;
  } else if (const json* b = field(j, {"layers_block_type"}, &source)) {
    kinds = *b;
    sets_count = true;
  } else if (const json* p = field(j, {"hybrid_override_pattern"}, &source)) {
    if (!p->is_string()) fail(c, "\"hybrid_override_pattern\" must be a string, got " + p->dump());
    kinds = json::array();
    for (char ch : p->get<std::string>()) {
      const char* kind = ch == 'M' ? "linear_attention" : ch == '*' ? "full_attention"
                         : ch == 'E' ? "moe" : ch == '-' ? "mlp" : nullptr;
      if (!kind)
        fail(c, "\"hybrid_override_pattern\" has '" + std::string(1, ch) + "': M, *, E and - are its layer kinds");
      kinds.push_back(kind);
    }
    sets_count = true;
  } else if (field(j, {"attn_layer_indices"}, nullptr)) {
    from_indices("attn_layer_indices", "linear_attention");
  } else if (field(j, {"full_attn_idxs"}, nullptr)) {
    from_indices("full_attn_idxs", "conv");
  } else if (const json* bt = field(j, {"block_types"}, &source)) {
    if (!bt->is_array() || bt->empty()) fail(c, "\"block_types\" must be a list of block types, got " + bt->dump());
    for (int64_t i = 0; i < c.num_layers; ++i) {
      const json& t = (*bt)[static_cast<size_t>(i) % bt->size()];
      kinds.push_back(t == "recurrent" ? "recurrent" : "sliding_attention");
    }
  } else if (c.model_type == "jamba" || c.model_type == "zamba") {
    // Jamba: layer i has attention where i % period == offset (default 8,
    // 4); Zamba: two Mamba layers, a hybrid one, then the same rule over the
    // rest (default 6, 4).
    const bool jamba = c.model_type == "jamba";
    const json* per = field(j, {"attn_layer_period"}, nullptr);
    const json* off = field(j, {"attn_layer_offset"}, nullptr);
    const int64_t period = per ? get_positive_int(c, *per, "attn_layer_period") : jamba ? 8 : 6;
    const double offset = off ? get_number(c, *off, "attn_layer_offset") : 4;
    if (!(offset >= 0 && offset < static_cast<double>(period) && offset == std::floor(offset)))
      fail(c, "\"attn_layer_offset\" must be an integer in [0, attn_layer_period " + std::to_string(period) +
                  "), got " + fmt_num(offset));
    source = "attn_layer_period " + std::to_string(period) + ", attn_layer_offset " + fmt_num(offset);
    const int64_t first = jamba ? 0 : 3, o = static_cast<int64_t>(offset);
    const char* attention = jamba ? "full_attention" : "hybrid";
    for (int64_t i = 0; i < c.num_layers; ++i)
      kinds.push_back(i < first ? (i == 2 ? "hybrid" : "linear_attention")
                                : (i - first) % period == o ? attention : "linear_attention");
  } else if (c.model_type == "qwen3_next" || c.model_type == "qwen3_5" || c.model_type == "qwen3_5_text" ||
             c.model_type == "qwen3_5_moe" || c.model_type == "qwen3_5_moe_text") {
    const json* v = field(j, {"full_attention_interval"}, nullptr);
    const int64_t interval = v ? get_positive_int(c, *v, "full_attention_interval") : 4;
    source = "full_attention_interval " + std::to_string(interval);
    for (int64_t i = 0; i < c.num_layers; ++i)
      kinds.push_back((i + 1) % interval ? "linear_attention" : "full_attention");
  } else if (c.model_type == "olmo_hybrid") {
    source = "olmo_hybrid's default layers";
    for (int64_t i = 0; i < c.num_layers; ++i)
      kinds.push_back(i % 4 == 3 || (c.num_layers < 4 && i == c.num_layers - 1) ? "full_attention"
                                                                                 : "linear_attention");
  }
  if (kinds.is_null()) return;
  if (!kinds.is_array() || !std::all_of(kinds.begin(), kinds.end(), [](const json& t) { return t.is_string(); }))
    fail(c, "\"" + source + "\" must be a list of layer type names, got " + kinds.dump());
  const int64_t n_kinds = static_cast<int64_t>(kinds.size());
  if (sets_count) {
    if (given && c.num_layers != n_kinds)
      c.notes.push_back("num_hidden_layers " + std::to_string(c.num_layers) + " ignored: " + source + " gives " +
                        std::to_string(n_kinds) + " layers (as transformers reads it)");
    c.num_layers = n_kinds;
  } else if (n_kinds != c.num_layers) {
    fail(c, "\"" + source + "\" has " + std::to_string(n_kinds) + " entries, but num_hidden_layers is " +
                std::to_string(c.num_layers));
  }
  if (c.num_layers == 0) fail(c, "\"" + source + "\" gives no layers");
  json kept = json::array();
  std::string dropped_types;
  for (size_t i = 0; i < kinds.size(); ++i) {
    const std::string t = kinds[i].get<std::string>();
    if (std::find(std::begin(kAttention), std::end(kAttention), t) == std::end(kAttention) &&
        std::find(std::begin(kNoAttention), std::end(kNoAttention), t) == std::end(kNoAttention)) {
      std::string known;
      for (const char* k : kAttention) known += std::string(known.empty() ? "" : ", ") + k;
      for (const char* k : kNoAttention) known += std::string(", ") + k;
      fail(c, "\"" + source + "\" names the layer type \"" + t + "\", which the tool does not know (" + known +
                  "): it cannot tell whether the layer has attention");
    }
    if (std::find(std::begin(kNoAttention), std::end(kNoAttention), t) == std::end(kNoAttention)) {
      kept.push_back(t);
      c.attention_layers.push_back(static_cast<int64_t>(i));
    } else if (dropped_types.find("\"" + t + "\"") == std::string::npos) {
      dropped_types += (dropped_types.empty() ? "\"" : ", \"") + t + "\"";
    }
  }
  if (c.attention_layers.size() == kinds.size()) {
    c.attention_layers.clear();
    return;
  }
  if (c.attention_layers.empty())
    fail(c, source + " gives no attention layer (" + dropped_types +
                " only): no layer has a KV cache for the op to fill");
  std::string which;
  for (size_t i = 0; i < c.attention_layers.size() && i < 8; ++i)
    which += (i ? ", " : "") + std::to_string(c.attention_layers[i]);
  if (c.attention_layers.size() > 8) which += ", ...";
  const int64_t all = c.num_layers, n = static_cast<int64_t>(c.attention_layers.size());
  c.notes.push_back(source + ": " + std::to_string(all - n) + " of " + std::to_string(all) + " layers (" +
                    dropped_types + ") have no attention, no KV cache and no RoPE: only " +
                    (n == 1 ? "the attention layer (" + which + ") calls"
                            : "the " + std::to_string(n) + " attention layers (" + which + ") call") +
                    " the op, and the replay's layer i is the i-th of them");
  c.num_layers = n;
  j["layer_types"] = kept;
}

}  // namespace

void set_qk_norm(ModelConfig& c, const std::string& mode) {
  if (mode == "off") {
    if (c.qk_norm != QkNorm::kNone)
      c.notes.push_back("--qk-norm off: replayed without the model's QK-norm (" + c.qk_norm_from + ")");
    c.qk_norm = QkNorm::kNone;
  } else if (mode == "on" && c.qk_norm == QkNorm::kNone) {
    c.qk_norm = QkNorm::kWeighted;
    c.qk_norm_from = "--qk-norm on";
  }
  if (c.qk_norm != QkNorm::kNone && !c.norm_eps_error.empty()) fail(c, c.norm_eps_error);
  // Llama-4's norm after RoPE divides out yarn's attention factor m; ropekv's
  // before it keeps m (its results m times Llama-4's).
  if (c.qk_norm == QkNorm::kUnit)
    for (const LayerRope& lr : c.ropes)
      if (lr.rope_scaling.type != ropekv::RopeScalingType::kNone &&
          ropekv::rope_attention_factor(lr.rope_scaling) != 1.0)
        c.notes.push_back("Llama-4's weightless norm after RoPE divides out the attention factor " +
                          fmt_num(ropekv::rope_attention_factor(lr.rope_scaling)) +
                          " of its rope_scaling; ropekv's QK-norm before RoPE keeps it (results that "
                          "many times the model's): replayed as ropekv computes it");
}

static ModelConfig load_model_config_json(const std::string& path);

ModelConfig load_model_config(const std::string& path) {
  // A field of an unexpected JSON type that the readers below take as it is
  // (e.g. "multi_query": "yes"): a config error naming the file, as the
  // readers' own checks are.
  try {
    return load_model_config_json(path);
  } catch (const json::exception& e) {
    throw InputError(path + ": a field has an unexpected type or value: " + e.what());
  }
}

static ModelConfig load_model_config_json(const std::string& path) {
  ModelConfig c;
  c.path = path;
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path + ": cannot open the model config (--config FILE)");
  const std::string text{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  // (The parser stops at a NUL byte as at the end of input, and would take
  // whatever follows it as absent.)
  if (const size_t nul = text.find('\0'); nul != std::string::npos)
    fail(c, "not valid JSON: a NUL byte at offset " + std::to_string(nul));
  json j;
  try {
    // Nesting is bounded: printing a value (the scaling's summary, an error
    // message) recurses once per level, and 100000 levels overflowed the
    // stack. Hugging Face configs nest a few levels.
    constexpr int kMaxDepth = 64;
    j = json::parse(text, [&](int depth, json::parse_event_t, json&) {
      if (depth > kMaxDepth)
        fail(c, "JSON nested more than " + std::to_string(kMaxDepth) + " levels deep");
      return true;
    });
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

  // Multi-head latent attention (DeepSeek-V2/V3 and configs of their
  // model_type): RoPE rotates the qk_rope_head_dim part of each head, and
  // transformers' configs set head_dim to it whatever hidden_size says.
  if (const json* r = field(j, {"qk_rope_head_dim"}, &which)) {
    c.head_dim = get_positive_int(c, *r, which);
    if (const json* v = field(j, {"head_dim"}, &which)) {
      if (const int64_t given = get_positive_int(c, *v, which); given != c.head_dim)
        fail(c, "\"head_dim\" " + std::to_string(given) + " differs from \"qk_rope_head_dim\" " +
                    std::to_string(c.head_dim) +
                    " (multi-head latent attention rotates qk_rope_head_dim dims of each head, "
                    "which transformers takes as head_dim)");
    }
  } else if (const json* v = field(j, {"head_dim"}, &which)) {
    c.head_dim = get_positive_int(c, *v, which);
  } else {
    const int64_t hidden = required_int(c, j, {"hidden_size", "n_embd", "d_model"});
    if (hidden % c.num_qo_heads != 0)
      fail(c, "no head_dim, and hidden_size " + std::to_string(hidden) +
                  " is not a multiple of num_attention_heads " + std::to_string(c.num_qo_heads));
    c.head_dim = hidden / c.num_qo_heads;
  }
  check_one_shape(c, j);
  // (Nemotron-H's configs may give the layers by their kinds alone.)
  const bool layers_given = field(j, {"num_hidden_layers", "n_layer", "num_layers"}, nullptr) != nullptr;
  if (layers_given || !field(j, {"layers_block_type", "hybrid_override_pattern"}, nullptr))
    c.num_layers = required_int(c, j, {"num_hidden_layers", "n_layer", "num_layers"});
  drop_layers_without_attention(c, j, layers_given);

  if (const json* v = field(j, {"max_position_embeddings", "n_positions", "max_sequence_length"}, &which))
    c.max_position_embeddings = get_positive_int(c, *v, which);

  // rope_scaling, or transformers 5's rope_parameters (the same keys plus
  // rope_theta and partial_rotary_factor, one flat object, or one such object
  // per layer type: {"sliding_attention": {...}, "full_attention": {...}}).
  const json* scaling = field(j, {"rope_scaling"}, &which);
  std::string scaling_key = which;
  if (!scaling) {
    scaling = field(j, {"rope_parameters"}, &which);
    scaling_key = which;
  }
  if (scaling && !scaling->is_object())
    fail(c, "\"" + scaling_key + "\" must be an object or null, got " + scaling->dump());
  const bool per_type = scaling && !scaling->empty() && !scaling->contains("rope_type") &&
                        !scaling->contains("type") &&
                        std::all_of(scaling->begin(), scaling->end(),
                                    [](const json& v) { return v.is_object(); });
  if (scaling_key == "rope_parameters" && scaling && !per_type && !scaling->contains("rope_type") &&
      !scaling->contains("type"))
    fail(c, "\"rope_parameters\" has no \"rope_type\" (or \"type\"), nor an object of RoPE "
            "parameters per layer type: " + scaling->dump());

  // The layer types and the object of RoPE parameters of each ("" and the
  // whole rope_scaling for a model of one type). Gemma-3's configs of
  // transformers 4 give the sliding-window layers' theta apart
  // (rope_local_base_freq, default RoPE there) and the layer types by
  // layer_types or sliding_window_pattern (a layer is full attention where
  // (i + 1) % pattern == 0, as transformers' Gemma3 reads it).
  struct TypeRope {
    std::string name, key;
    const json* params;  // nullptr: no rope_scaling
    const json* theta;   // nullptr: the top-level keys
  };
  std::vector<TypeRope> types;
  const json* local_theta = field(j, {"rope_local_base_freq"}, &which);
  if (per_type) {
    for (const auto& item : scaling->items())
      types.push_back({item.key(), scaling_key + "." + item.key(), &item.value(), nullptr});
  } else if (local_theta) {
    types.push_back({"full_attention", scaling_key, scaling, nullptr});
    types.push_back({"sliding_attention", "rope_local_base_freq", nullptr, local_theta});
    c.notes.push_back("rope_local_base_freq: sliding_attention layers rotate with rope_theta " +
                      local_theta->dump() + " and no rope_scaling, full_attention layers with the "
                      "model's (as transformers' Gemma-3 does)");
  } else {
    types.push_back({"", scaling_key, scaling, nullptr});
  }

  // rope_theta and partial_rotary_factor inside rope_parameters (or
  // rope_scaling) win over the top-level keys, as transformers 5 ranks them
  // (convert_rope_params_to_dict: the top-level value only fills a gap).
  // Returns the field, its name in messages in *key.
  auto rope_field = [&](const TypeRope& t, const char* inside, std::initializer_list<const char*> top,
                        std::string* key) -> const json* {
    std::string name;
    if (const json* v = t.params ? field(*t.params, {inside}, &name) : nullptr) {
      *key = t.key + "." + name;
      return v;
    }
    const json* v = field(j, top, &name);
    *key = name;
    return v;
  };
  c.ropes.assign(types.size(), LayerRope{});
  for (size_t i = 0; i < types.size(); ++i) {
    LayerRope& lr = c.ropes[i];
    lr.layer_type = types[i].name;
    std::string theta_key = types[i].theta ? types[i].key : std::string();
    const json* theta_v = types[i].theta ? types[i].theta
                                         : rope_field(types[i], "rope_theta",
                                                      {"rope_theta", "rotary_emb_base", "rope_base"},
                                                      &theta_key);
    if (theta_v) {
      lr.rope_theta = get_number(c, *theta_v, theta_key);
      if (!(lr.rope_theta > 0) || !std::isfinite(lr.rope_theta))
        fail(c, "\"" + theta_key + "\" must be a finite number > 0, got " + theta_v->dump());
    } else {
      c.notes.push_back("no rope_theta" + (lr.layer_type.empty() ? "" : " for " + lr.layer_type) +
                        ": using the Hugging Face default 10000");
    }
  }
  if (types.size() > 1) {
    const json* lt = field(j, {"layer_types"}, &which);
    if (lt) {
      if (!lt->is_array() || static_cast<int64_t>(lt->size()) != c.num_layers)
        fail(c, "\"layer_types\" must be a list of " + std::to_string(c.num_layers) +
                    " layer types (num_hidden_layers), got " + lt->dump());
      for (const json& name : *lt) {
        int found = -1;
        for (size_t i = 0; i < types.size(); ++i)
          if (name.is_string() && name.get<std::string>() == types[i].name) found = static_cast<int>(i);
        if (found < 0) {
          std::string names;
          for (const TypeRope& t : types) names += (names.empty() ? "\"" : ", \"") + t.name + "\"";
          fail(c, "\"layer_types\" names " + name.dump() + ", which has no RoPE parameters (" +
                      names + ")");
        }
        c.layer_rope.push_back(found);
      }
    } else if (!per_type) {
      int64_t pattern = 6;
      if (const json* v = field(j, {"sliding_window_pattern", "_sliding_window_pattern"}, &which))
        pattern = get_positive_int(c, *v, which);
      else
        c.notes.push_back("no layer_types or sliding_window_pattern: every 6th layer is full attention "
                          "(transformers' Gemma-3 default)");
      for (int64_t i = 0; i < c.num_layers; ++i) c.layer_rope.push_back((i + 1) % pattern == 0 ? 0 : 1);
    } else {
      fail(c, "\"" + scaling_key + "\" gives RoPE parameters per layer type, but the config has no "
              "\"layer_types\" to say which layer is of which type");
    }
  }

  // Pair layout: GPT-J and CodeGen (which copies GPT-J's attention) rotate
  // interleaved pairs, as do transformers' GLM-4 models (glm, glm4),
  // DeepSeek-V2/V3 (whose transformers 5 configs say so in rope_interleave,
  // true by default), Cohere's (cohere, cohere2: their rotate_half takes
  // x[::2] and x[1::2]) and Llama-4 (llama4_text: a complex view of
  // consecutive pairs); every other model here rotates NeoX halves.
  c.is_neox = !(c.model_type == "gptj" || c.model_type == "codegen" || c.model_type == "glm" ||
                c.model_type == "glm4" || c.model_type == "deepseek_v2" ||
                c.model_type == "deepseek_v3" || c.model_type == "cohere" ||
                c.model_type == "cohere2" || c.model_type == "llama4" ||
                c.model_type == "llama4_text");
  if (const json* v = field(j, {"rope_interleave"}, &which)) {
    if (!v->is_boolean()) fail(c, "\"rope_interleave\" must be true or false, got " + v->dump());
    c.is_neox = !v->get<bool>();
  }
  if (std::string note = nope_note(j, c); !note.empty()) c.notes.push_back(note);
  read_qk_norm(c, j);
  if (field(j, {"kv_lora_rank"}, &which))
    c.notes.push_back("multi-head latent attention (kv_lora_rank): replayed as " +
                      std::to_string(c.num_kv_heads) + " key heads of head_dim " +
                      std::to_string(c.head_dim) +
                      " in the pool; an MLA engine caches a latent and one shared rope key instead");

  // Rotary dimension: an absolute rotary_dim (GPT-J, CodeGen) or a fraction
  // of the head (partial_rotary_factor in Phi/Phi-3/StableLM/GLM, rotary_pct
  // in GPT-NeoX). Hugging Face: int(head_dim * factor). Absent, the config
  // classes' defaults apply (GPT-J 64 dims; GPT-NeoX 0.25; Phi, GLM 0.5).
  // Each type's factor is its block's, else the top level's (transformers 5's
  // standardize_rope_params). A proportional type's is the fraction of the
  // pairs that rotate, read by parse_rope_scaling; its rotary dimension is
  // the head's.
  c.rotary_dim = c.head_dim;
  std::vector<const json*> factors(types.size());
  std::vector<std::string> factor_keys(types.size());
  const json* factor_v = nullptr;
  std::string factor_key;
  int first = -1;  // the first type whose factor is a rotary dimension
  auto factor_of = [&](size_t i) {
    const std::string name = types[i].name.empty() ? "the model" : types[i].name;
    return name + ": " + (factors[i] ? "\"" + factor_keys[i] + "\" " + factors[i]->dump() : "none");
  };
  for (size_t i = 0; i < types.size(); ++i) {
    factors[i] = rope_field(types[i], "partial_rotary_factor", {"partial_rotary_factor", "rotary_pct"},
                            &factor_keys[i]);
    if (types[i].params && rope_type_of(*types[i].params) == "proportional") continue;
    if (first < 0) {
      first = static_cast<int>(i);
      factor_v = factors[i];
      factor_key = factor_keys[i];
    } else if ((factors[i] == nullptr) != (factor_v == nullptr) || (factor_v && *factors[i] != *factor_v)) {
      fail(c, "the layer types rotate different dimensions (" + factor_of(first) + ", " + factor_of(i) +
                  "): the replay takes one rotary_dim");
    }
  }
  if (const json* v = field(j, {"rotary_dim"}, &which)) {
    c.rotary_dim = get_positive_int(c, *v, which);
    c.partial_rotary_factor = static_cast<double>(c.rotary_dim) / static_cast<double>(c.head_dim);
  } else if (factor_v) {
    c.partial_rotary_factor = get_number(c, *factor_v, factor_key);
    if (!(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1))
      fail(c, "\"" + factor_key + "\" must be in (0, 1], got " + factor_v->dump());
    c.rotary_dim = static_cast<int64_t>(static_cast<double>(c.head_dim) * c.partial_rotary_factor);
  } else if (c.model_type == "gptj" || c.model_type == "codegen") {
    c.rotary_dim = 64;
    c.partial_rotary_factor = 64.0 / static_cast<double>(c.head_dim);
    c.notes.push_back("no rotary_dim: using the " + c.model_type + " default 64");
  } else if (c.model_type == "gpt_neox" || c.model_type == "phi" || c.model_type == "glm" ||
             c.model_type == "glm4") {
    c.partial_rotary_factor = c.model_type == "gpt_neox" ? 0.25 : 0.5;
    c.rotary_dim = static_cast<int64_t>(static_cast<double>(c.head_dim) * c.partial_rotary_factor);
    c.notes.push_back("no partial_rotary_factor: using the " + c.model_type + " default " +
                      fmt_num(c.partial_rotary_factor));
  }
  // (head_dim first: an odd one makes the default rotary dimension odd too.)
  if (c.head_dim % 2 != 0) fail(c, "head_dim " + std::to_string(c.head_dim) + " must be even");
  if (c.rotary_dim > c.head_dim || c.rotary_dim < 2 || c.rotary_dim % 2 != 0)
    fail(c, "rotary dimension " + std::to_string(c.rotary_dim) + " must be even, >= 2 and <= head_dim " +
                std::to_string(c.head_dim));

  // (transformers' proportional RoPE spans the whole head, whatever the
  // other layer types or a rotary_dim field say)
  for (size_t i = 0; i < types.size(); ++i)
    if (types[i].params && rope_type_of(*types[i].params) == "proportional" && c.rotary_dim != c.head_dim)
      fail(c, "the " + (types[i].name.empty() ? std::string("model's") : types[i].name + " layers'") +
                  " proportional RoPE spans the whole head_dim " + std::to_string(c.head_dim) +
                  ", but the rotary dimension is " + std::to_string(c.rotary_dim) + " (" +
                  (j.contains("rotary_dim") ? std::string("\"rotary_dim\"")
                   : factor_v              ? "\"" + factor_key + "\" " + factor_v->dump()
                                           : "the " + c.model_type + " default") +
                  "): the replay takes one rotary_dim");
  for (size_t i = 0; i < types.size(); ++i)
    if (types[i].params)
      parse_rope_scaling(c, *types[i].params, types[i].key, c.ropes[i], factors[i], factor_keys[i]);
  return c;
}

void check_supported(ModelConfig& c, bool ignore_rope_scaling) {
  for (LayerRope& lr : c.ropes) {
    const std::string of = lr.layer_type.empty() ? "" : " (" + lr.layer_type + " layers)";
    if (!lr.rope_scaling_type.empty() && lr.rope_scaling.type == ropekv::RopeScalingType::kNone) {
      if (!ignore_rope_scaling)
        fail(c, "rope_scaling type \"" + lr.rope_scaling_type + "\"" + of +
                    " is not supported: ropekv computes default, linear, llama3, yarn and proportional "
                    "frequencies; "
                    "pass --ignore-rope-scaling to replay it as default RoPE (same cost per call, other "
                    "angles)");
      c.notes.push_back("rope_scaling " + lr.rope_scaling_desc + of + " ignored (--ignore-rope-scaling): " +
                        "the op is called with default RoPE frequencies (theta " + fmt_num(lr.rope_theta) +
                        "); cost per call is the same");
    }
    // The values ropekv would reject (e.g. high_freq_factor <= low_freq_factor),
    // as a config error rather than a failed call.
    std::vector<float> inv_freq;
    try {
      inv_freq = ropekv::rope_inv_freq(rope_config(c, lr));
    } catch (const ropekv::Error& e) {
      fail(c, std::string("ropekv rejects this model's RoPE parameters") + of + ": " + e.what());
    }
    if (lr.rope_scaling.type != ropekv::RopeScalingType::kNone) {
      const double m = ropekv::rope_attention_factor(lr.rope_scaling);
      const auto rotating =
          std::count_if(inv_freq.begin(), inv_freq.end(), [](float f) { return f != 0.0f; });
      c.notes.push_back("rope_scaling " + lr.rope_scaling_type + " " + lr.rope_scaling_desc + of +
                        ": scaled frequencies (ropekv::rope_inv_freq)" +
                        (m != 1.0 ? ", cos and sin times the attention factor " + fmt_num(m) : std::string()) +
                        (lr.rope_scaling.type == ropekv::RopeScalingType::kProportional
                             ? ", " + std::to_string(rotating) + " of " + std::to_string(inv_freq.size()) +
                                   " pairs rotating (partial_rotary_factor " +
                                   fmt_num(lr.rope_scaling.partial_rotary_factor) + ")"
                             : std::string()));
    }
  }
}

ropekv::RopeConfig rope_config(const ModelConfig& c, const LayerRope& lr) {
  ropekv::RopeConfig r;
  r.head_dim = c.head_dim;
  r.num_qo_heads = c.num_qo_heads;
  r.num_kv_heads = c.num_kv_heads;
  r.rope_base = lr.rope_theta;
  r.rotary_dim = c.rotary_dim;
  r.is_neox = c.is_neox;
  r.rope_scaling = lr.rope_scaling;
  return r;
}

}  // namespace replay
