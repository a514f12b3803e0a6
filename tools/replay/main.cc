// ropekv-replay: replays an LLM serving workload through ropekv's fused
// RoPE + KV-cache scatter, layer by layer, as an engine would, verifies every
// result against a float64 rotation of its own (and ropekv::reference),
// reports the op's effective bandwidth next to a memcpy of the same bytes.
// See tools/replay/README.md.
#include <ropekv/ropekv.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "model_config.h"
#include "numerics.h"
#include "replay.h"
#include "workload.h"

#ifndef ROPEKV_REPLAY_CONFIG_DIR
#define ROPEKV_REPLAY_CONFIG_DIR ""
#endif

namespace fs = std::filesystem;
using namespace replay;

namespace {

constexpr const char* kDefaultConfig = "llama-3.1-8b.json";

/// Where the shipped configs are: next to the executable's tree (a build
/// directory inside the source tree, or an install's share/ropekv/configs),
/// else the source directory the tool was built from.
std::vector<fs::path> config_dirs() {
  std::vector<fs::path> dirs;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    fs::path d = exe.parent_path();
    for (int up = 0; up < 5 && !d.empty(); ++up, d = d.parent_path()) {
      dirs.push_back(d / "configs");
      dirs.push_back(d / "share" / "ropekv" / "configs");
      if (d == d.parent_path()) break;
    }
  }
  if (std::strlen(ROPEKV_REPLAY_CONFIG_DIR) > 0) dirs.emplace_back(ROPEKV_REPLAY_CONFIG_DIR);
  return dirs;
}

/// A path as given (any that exists and is not a directory: a pipe too, as
/// a shell's --config <(jq ... config.json) makes), a model directory's
/// config.json (a Hugging Face snapshot), else NAME or NAME.json in the
/// shipped configs. A path that is there, or a link to nothing, is the
/// user's: an error there is reported, never replaced by a shipped config
/// of the same name.
std::string resolve_config(const std::string& given) {
  const std::string hint = "\n(pass --config FILE with a Hugging Face config.json)";
  std::error_code ec;
  if (!given.empty()) {
    const fs::path path(given);
    const fs::file_status st = fs::status(path, ec);  // (follows links)
    if (fs::exists(st)) {
      if (!fs::is_directory(st)) return given;
      const fs::path inner = path / "config.json";
      std::error_code inner_ec;
      const fs::file_status ist = fs::status(inner, inner_ec);
      if (fs::exists(ist) && !fs::is_directory(ist)) return inner.string();
      std::string why = "without a config.json file";
      if (inner_ec && inner_ec != std::errc::no_such_file_or_directory)
        why = "whose config.json cannot be read (" + inner_ec.message() + ")";
      throw InputError("the model config \"" + given + "\" is a directory " + why + hint);
    }
    if (fs::is_symlink(fs::symlink_status(path, ec)))
      throw InputError("the model config \"" + given + "\" is a symbolic link to nothing" + hint);
  }
  const std::string name = given.empty() ? kDefaultConfig : given;
  const bool bare = name.find('/') == std::string::npos;
  if (bare) {
    for (const fs::path& d : config_dirs()) {
      for (const std::string& n : {name, name + ".json"}) {
        if (fs::is_regular_file(d / n, ec)) return (d / n).string();
      }
    }
  }
  std::string msg = "cannot find the model config \"" + name + "\"";
  if (bare) {
    msg += "; looked in:";
    for (const fs::path& d : config_dirs()) msg += "\n  " + d.string();
  }
  throw InputError(msg + hint);
}

struct CopyBandwidth {
  double bytes = 0;
  int reps = 0;
  double best_gbps = 0, median_gbps = 0;
};

/// memcpy of `bytes` from one buffer to another on `threads` threads (each
/// copies a contiguous share, as the op's threads share its work), repeated;
/// buffers are touched first. Best and median over the repetitions.
CopyBandwidth measure_memcpy(size_t bytes, int threads) {
  CopyBandwidth r;
  bytes = std::max<size_t>(bytes, 64);
  r.bytes = static_cast<double>(bytes);
  std::vector<uint8_t> src(bytes), dst(bytes);
  for (size_t i = 0; i < bytes; ++i) src[i] = static_cast<uint8_t>(i * 131 + 7);
  std::memset(dst.data(), 0, bytes);
  int nt = 1;
#ifdef _OPENMP
  nt = threads > 0 ? threads : omp_get_max_threads();
#else
  (void)threads;
#endif
  auto once = [&]() {
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(nt)
    {
#ifdef _OPENMP
      const int id = omp_get_thread_num(), n = omp_get_num_threads();
#else
      const int id = 0, n = 1;
#endif
      const size_t chunk = (bytes / n + 63) / 64 * 64;
      const size_t b = std::min(bytes, chunk * id), e = std::min(bytes, b + chunk);
      if (e > b) std::memcpy(dst.data() + b, src.data() + b, e - b);
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  once();
  once();  // warm-up: pages and threads
  std::vector<double> t;
  double total = 0;
  while ((t.size() < 200 && total < 0.25) || t.size() < 11) {
    const double s = once();
    t.push_back(s);
    total += s;
  }
  std::sort(t.begin(), t.end());
  r.reps = static_cast<int>(t.size());
  r.best_gbps = r.bytes / t.front() / 1e9;
  r.median_gbps = r.bytes / t[t.size() / 2] / 1e9;
  // Defeat dead-store elimination of the copies.
  volatile uint8_t sink = dst[bytes / 2];
  (void)sink;
  return r;
}

int effective_threads(int threads) {
#ifdef _OPENMP
  return threads > 0 ? threads : omp_get_max_threads();
#else
  (void)threads;
  return 1;
#endif
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = static_cast<size_t>(std::min<double>(v.size() - 1, std::floor(p * (v.size() - 1) + 0.5)));
  return v[i];
}

// The shortest %g form that reads back as v (1.0000001 is not "1").
std::string fmt_g(double v) {
  char buf[32];
  for (int digits = 6; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

std::string human_bytes(double b) {
  char buf[32];
  if (b >= 1e9) std::snprintf(buf, sizeof buf, "%.2f GB", b / 1e9);
  else if (b >= 1e6) std::snprintf(buf, sizeof buf, "%.2f MB", b / 1e6);
  else std::snprintf(buf, sizeof buf, "%.1f kB", b / 1e3);
  return buf;
}

/// The 1-minute load average (Linux), or -1: other work on the machine
/// slows OpenMP calls down, so the summary says how busy it was.
double load_average() {
  std::ifstream f("/proc/loadavg");
  double l = -1;
  if (!(f >> l)) return -1;
  return l;
}

/// Writes `text` to `path`; false where any of it did not get there (a full
/// disk, an I/O error): the stream is checked after the close, which flushes.
bool write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
  f.close();
  return !f.fail();
}

/// CLI11 validators its own checks lack. A seed is an unsigned 64-bit
/// decimal: "-1" and values past 2^64 - 1 were read as 2^64 - 1.
const CLI::Validator kUint64(
    [](std::string& s) -> std::string {
      if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos)
        return "must be an unsigned integer, got " + s;
      errno = 0;
      std::strtoull(s.c_str(), nullptr, 10);
      return errno == ERANGE ? "must be at most 2^64 - 1, got " + s : std::string();
    },
    "UINT64");
/// A finite number >= 0 (CLI::NonNegativeNumber lets NaN through).
const CLI::Validator kFiniteNonNegative(
    [](std::string& s) -> std::string {
      char* end = nullptr;
      const double v = std::strtod(s.c_str(), &end);
      if (end == s.c_str() || *end != '\0' || !std::isfinite(v) || v < 0)
        return "must be a finite number >= 0, got " + s;
      return std::string();
    },
    "NUMBER >= 0");

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "ropekv-replay: replays an LLM serving workload through ropekv::rope_pool_fused, one call per "
      "layer per step, with continuous batching over a KV pool and chunked prefill; verifies every "
      "result against a float64 rotation of its own (and ropekv::reference) and reports the op's "
      "effective bandwidth (SPEC section 7) "
      "next to a memcpy of the same bytes.\nWith no arguments: configs/llama-3.1-8b.json, a seeded "
      "synthetic run, bf16.",
      "ropekv-replay"};
  std::string config_arg, trace, json_out, dtype_s = "bf16", qkv_s = "fused", fault, kv_s = "auto",
              qk_norm_s = "auto";
  ReplayOptions opt;
  SyntheticParams syn;
  int64_t requests = 0, layers = 0, inject_at = 100;
  bool progress = false, no_progress = false, ignore_scaling = false;
  app.add_option("--config", config_arg,
                 "model config.json (Hugging Face form), a model directory holding one, "
                 "or the name of a shipped one (e.g. qwen3-8b) "
                 "[default: configs/llama-3.1-8b.json]");
  app.add_option("--trace", trace,
                 "CSV of requests in the Azure LLM inference trace format "
                 "(TIMESTAMP,ContextTokens,GeneratedTokens) [default: synthetic workload]")
      ->check(CLI::ExistingFile);
  app.add_option("--dtype", dtype_s, "element type of q/k/v and the pools [default: bf16]")
      ->check(CLI::IsMember({"f32", "f16", "bf16"}));
  app.add_option("--kv-cache-dtype", kv_s,
                 "format of k_pool and v_pool: auto = the dtype of q/k/v, float32 = float32 pools for any "
                 "dtype, fp8_e4m3 / fp8_e5m2 = 8-bit pools (uint8 storage) holding encode(x / scale)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "float32", "fp8_e4m3", "fp8_e5m2"}));
  app.add_option("--qk-norm", qk_norm_s,
                 "QK-norm (RMSNorm of each q and k head before RoPE, fused into the call): auto = as the "
                 "model's attention has it (Qwen3 and Qwen3.5 families, Gemma-3, LFM2, EXAONE-4 and more; "
                 "GLM-4.5 and Llama-4 with use_qk_norm: README), on = "
                 "for any model, off = never; weights random per layer, eps the config's rms_norm_eps (else a per-model default: README)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "on", "off"}));
  app.add_option("--k-scale", opt.k_scale, "fp8 pools: the per-tensor key scale (k_pool = encode(k_rot / "
                 "k_scale)); finite, > 0; must stay 1 for other pools")
      ->capture_default_str();
  app.add_option("--v-scale", opt.v_scale, "fp8 pools: the per-tensor value scale (v_pool = encode(v / "
                 "v_scale)); finite, > 0; must stay 1 for other pools")
      ->capture_default_str();
  app.add_option("--threads", opt.threads, "CPU threads of the op (ExecOptions::num_threads), also used "
                 "for data generation, checks and the memcpy baseline; 0 = OpenMP default")
      ->check(CLI::Range(0, 1024));
  app.add_option("--layers", layers, "replay at most N layers, the first N of the model's attention "
                 "layers (default: all of them)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 20));
  app.add_option("--seed", opt.seed, "seed of the synthetic workload and of all q/k/v data")
      ->capture_default_str()
      ->check(kUint64);
  app.add_option("--requests", requests, "number of requests (synthetic: how many to make, default "
                 + std::to_string(syn.requests) + "; trace: the first N)")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 30));
  app.add_option("--pool-size", opt.pool_size, "KV slots (tokens) per layer; default: the largest "
                 "request, at least min(all KV tokens, 4096)")
      ->check(CLI::Range(int64_t{1}, int64_t{2147483647}));
  app.add_option("--max-batch-tokens", opt.max_batch_tokens,
                 "token budget of one step: decode tokens plus prefill chunks (chunked prefill)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  app.add_option("--max-running", opt.max_running, "most requests in flight at once")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 24));
  app.add_option("--qkv", qkv_s, "q/k/v layout: fused = strided views of one [T, (Hq+2Hk)*D] QKV "
                 "projection output (as engines have it), separate = three compact arrays")
      ->capture_default_str()
      ->check(CLI::IsMember({"fused", "separate"}));
  app.add_flag("--pad-decode", opt.pad_decode, "pad decode-only steps to CUDA-graph batch sizes "
               "(1, 2, 4, 8k) with tokens whose slot is -1 (not written)");
  app.add_option("--spot-checks", opt.spot_checks,
                 "(layer, token, head) samples of q_rot and of k_rot checked per step against ropekv::reference::rope_head (unscaled frequencies) or the "
                 "tool's float64 rotation")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 20));
  app.add_flag("--check-all", opt.check_all, "check every element of q_rot and k_rot of every call");
  app.add_flag("--ignore-rope-scaling", ignore_scaling,
               "replay a rope_scaling type ropekv does not have (dynamic, longrope, ...) as default RoPE "
               "instead of refusing the config (linear, llama3, yarn and proportional are computed)");
  app.add_option("--json", json_out, "write the summary as JSON to FILE");
  double max_rss_growth_mb = -1;
  app.add_option("--max-rss-growth-mb", max_rss_growth_mb,
                 "fail if resident memory grows by more than N MB between warm-up and the end")
      ->check(kFiniteNonNegative);
  app.add_flag("--progress", progress, "progress bar on stderr even when it is not a terminal");
  app.add_flag("--no-progress", no_progress, "no progress bar");
  app.add_option("--inject-fault", fault, "testing: corrupt one result to prove the checks fail")
      ->check(CLI::IsMember({"pool-k", "pool-v", "k-rot", "q-rot", "stray", "rope-type", "qk-norm"}))
      ->group("");
  app.add_option("--inject-at", inject_at, "testing: first call index eligible for the fault")
      ->check(CLI::NonNegativeNumber)
      ->group("");
  app.set_version_flag("--version", std::string("ropekv-replay (ropekv ") + ropekv::version() + ")");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }

  // The tool's own parallel loops (data, checks, the memcpy baseline) run
  // OpenMP's default team: --threads, else OMP_NUM_THREADS capped as the
  // library caps a call's threads, so that a huge OMP_NUM_THREADS cannot make
  // libgomp start (and fail to start) that many threads.
  bool threads_capped = false;
#ifdef _OPENMP
  const int thread_cap = std::max(64, 4 * omp_get_num_procs());
  threads_capped = opt.threads == 0 && omp_get_max_threads() > thread_cap;
  omp_set_num_threads(opt.threads > 0 ? opt.threads : std::min(omp_get_max_threads(), thread_cap));
#endif

  try {
    opt.dtype = dtype_s == "f32" ? Dtype::kF32 : dtype_s == "f16" ? Dtype::kF16 : Dtype::kBF16;
    opt.fused_qkv = qkv_s == "fused";
    opt.kv_dtype = kv_s == "float32"    ? KvDtype::kFloat32
                   : kv_s == "fp8_e4m3" ? KvDtype::kFp8E4M3
                   : kv_s == "fp8_e5m2" ? KvDtype::kFp8E5M2
                                        : KvDtype::kAuto;
    for (auto [name, v] : {std::pair<const char*, double>{"--k-scale", opt.k_scale}, {"--v-scale", opt.v_scale}}) {
      // (The op divides by the scale in float32: it must be finite and > 0 there too.)
      if (!(v > 0) || !std::isfinite(v) || !(static_cast<float>(v) > 0) ||
          !std::isfinite(static_cast<float>(v)))
        throw InputError(std::string(name) + " must be a finite number > 0 as a float32, got " + fmt_g(v));
      if (!is_fp8(opt.kv_dtype) && v != 1.0)
        throw InputError(std::string(name) + " applies to fp8 pools only (--kv-cache-dtype fp8_e4m3 or "
                         "fp8_e5m2), got " + fmt_g(v) + " with --kv-cache-dtype " + kv_s);
    }
    if (app.count("--json") > 0 && json_out.empty())  // (an unset variable in a script, as a rule)
      throw InputError("--json is empty: pass the file to write the summary to");
    if (!json_out.empty()) {  // a path it cannot write is a bad argument, before the run
      const bool existed = std::filesystem::exists(json_out);
      if (!std::ofstream(json_out, std::ios::app)) throw InputError("--json: cannot write " + json_out);
      if (!existed) std::filesystem::remove(json_out);  // (no empty file if the run stops early)
    }
    opt.layers = layers;
    opt.progress = !no_progress && (progress || isatty(STDERR_FILENO));
    opt.inject_fault = fault;
    opt.inject_at = inject_at;
    if (fault == "q-rot" && opt.spot_checks < 1)
      throw InputError("--inject-fault q-rot needs --spot-checks >= 1");

    if (app.count("--config") > 0 && config_arg.empty())  // (not the default's silent stand-in)
      throw InputError("--config is empty: pass a config.json, a model directory or a shipped "
                       "config's name");
    const std::string config_path = resolve_config(config_arg);
    ModelConfig model = load_model_config(config_path);
    check_supported(model, ignore_scaling);
    set_qk_norm(model, qk_norm_s);
    if (fault == "rope-type" && model.ropes.size() < 2)
      throw InputError("--inject-fault rope-type needs a config with RoPE per layer type");
    if (fault == "qk-norm" && model.qk_norm != QkNorm::kWeighted)
      throw InputError(std::string("--inject-fault qk-norm needs a QK-norm with weights") +
                       (model.qk_norm == QkNorm::kUnit ? ": this model's (Llama-4's) has none"
                                                       : " (a model with one, or --qk-norm on)"));

    Workload wl;
    if (!trace.empty()) {
      wl = load_azure_trace(trace, requests);
    } else {
      syn.seed = opt.seed;
      if (requests > 0) syn.requests = requests;
      wl = make_synthetic(syn);
    }

    const int64_t L = layers > 0 ? std::min(layers, model.num_layers) : model.num_layers;
    std::printf("ropekv-replay  ropekv %s, CPU target %s, %d thread%s%s\n", ropekv::version(),
                ropekv::cpu_target().c_str(), effective_threads(opt.threads),
                effective_threads(opt.threads) == 1 ? "" : "s",
                opt.threads > 0 ? "" : threads_capped ? " (OpenMP default, capped)" : " (OpenMP default)");
    // One type's RoPE: "rope_theta 500000, rope_scaling llama3".
    auto rope_desc = [](const LayerRope& lr) {
      return "rope_theta " + fmt_g(lr.rope_theta) + ", rope_scaling " +
             (lr.rope_scaling.type == ropekv::RopeScalingType::kNone ? std::string("none")
                                                                    : lr.rope_scaling_type);
    };
    std::printf("model     %s%s%s: Hq %lld, Hk %lld, head_dim %lld, rotary %lld (%s), %s, "
                "layers %lld of %lld, %s, q/k/v %s\n",
                config_path.c_str(), model.model_type.empty() ? "" : " (",
                model.model_type.empty() ? "" : (model.model_type + ")").c_str(),
                static_cast<long long>(model.num_qo_heads), static_cast<long long>(model.num_kv_heads),
                static_cast<long long>(model.head_dim), static_cast<long long>(model.rotary_dim),
                model.is_neox ? "neox" : "interleaved",
                model.ropes.size() == 1 ? rope_desc(model.ropes[0]).c_str() : "RoPE per layer type",
                static_cast<long long>(L), static_cast<long long>(model.num_layers), dtype_name(opt.dtype),
                opt.fused_qkv ? "fused (strided views)" : "separate");
    if (model.ropes.size() > 1)
      for (size_t i = 0; i < model.ropes.size(); ++i) {
        const std::vector<int64_t> layers_i = model.layers_of(i, L);
        std::string which;  // the first 8 of them
        for (size_t k = 0; k < layers_i.size() && k < 8; ++k)
          which += (k == 0 ? ": " : ", ") + std::to_string(layers_i[k]);
        if (layers_i.size() > 8) which += ", ...";
        std::printf("rope      %s: %s; %zu of the replayed layers%s\n", model.ropes[i].layer_type.c_str(),
                    rope_desc(model.ropes[i]).c_str(), layers_i.size(), which.c_str());
      }
    if (opt.kv_dtype != KvDtype::kAuto)
      std::printf("kv cache  %s pools%s\n", kv_dtype_name(opt.kv_dtype),
                  is_fp8(opt.kv_dtype)
                      ? (", k_scale " + fmt_g(opt.k_scale) + ", v_scale " + fmt_g(opt.v_scale)).c_str()
                      : "");
    if (model.qk_norm != QkNorm::kNone)
      std::printf("qk-norm   RMSNorm of each q and k head before RoPE (%s), eps %s, %s\n",
                  model.qk_norm_from.c_str(), fmt_g(model.norm_eps).c_str(),
                  model.qk_norm == QkNorm::kUnit
                      ? "weights of ones (Llama-4's weightless norm after RoPE: the same, as the rotation "
                        "keeps a head's norm; on its NoPE layers too, which are replayed like the others)"
                      : "random weights in [0.5, 1.5) per layer (a config has no weights)");
    for (const std::string& n : model.notes) std::printf("note      %s\n", n.c_str());
    if (layers > model.num_layers)
      std::printf("note      --layers %lld > the model's %lld layers: using %lld\n",
                  static_cast<long long>(layers), static_cast<long long>(model.num_layers),
                  static_cast<long long>(model.num_layers));
    {
      int64_t p = 0, g = 0;
      for (const Request& r : wl.requests) p += r.prompt_tokens, g += r.output_tokens;
      std::printf("workload  %s: %zu requests, %lld prompt tokens, %lld output tokens\n", wl.source.c_str(),
                  wl.requests.size(), static_cast<long long>(p), static_cast<long long>(g));
    }
    std::fflush(stdout);

    const double load_before = load_average();
    ReplayResult r;
    bool verified = true;
    std::string failure;
    try {
      r = run_replay(model, wl, opt);
    } catch (const VerifyError& e) {
      verified = false;
      failure = e.what();
    }
    if (!verified) {
      std::fflush(stdout);
      std::fprintf(stderr, "\nropekv-replay: %s\nropekv-replay: NOT verified\n", failure.c_str());
      std::printf("NOT verified\n");
      if (!json_out.empty()) {
        nlohmann::ordered_json j;
        j["tool"] = "ropekv-replay";
        j["verified"] = false;
        j["error"] = failure;
        if (!write_file(json_out, j.dump(2) + "\n"))
          std::fprintf(stderr, "ropekv-replay: error: --json: writing %s failed (disk full or I/O error)\n",
                       json_out.c_str());
      }
      return 1;
    }

    const double mean_bytes = r.calls ? r.bytes / static_cast<double>(r.calls) : 0;
    const CopyBandwidth mc = measure_memcpy(static_cast<size_t>(mean_bytes), opt.threads);
    const double op_gbps = r.op_seconds > 0 ? r.bytes / r.op_seconds / 1e9 : 0;
    const double dec_gbps =
        r.decode_only_op_seconds > 0 ? r.decode_only_bytes / r.decode_only_op_seconds / 1e9 : 0;
    const double other_s = r.op_seconds - r.decode_only_op_seconds;
    const int64_t other_calls = r.calls - r.decode_only_calls;
    const double other_gbps = other_s > 0 ? (r.bytes - r.decode_only_bytes) / other_s / 1e9 : 0;
    const double ratio = mc.best_gbps > 0 ? op_gbps / mc.best_gbps : 0;
    const double mean_us = r.calls ? r.op_seconds * 1e6 / static_cast<double>(r.calls) : 0;
    const double p50 = percentile(r.call_us, 0.5), p99 = percentile(r.call_us, 0.99);
    const double dec_mean_us =
        r.decode_only_calls ? r.decode_only_op_seconds * 1e6 / static_cast<double>(r.decode_only_calls) : 0;
    const double pool_bytes = 2.0 * r.layers * r.pool_size * model.num_kv_heads * model.head_dim *
                              pool_elem_size(opt.kv_dtype, opt.dtype);

    std::printf("pool      %lld slots x %lld layers (k + v: %s, %s), max batch tokens %lld, max running %lld%s\n",
                static_cast<long long>(r.pool_size), static_cast<long long>(r.layers),
                human_bytes(pool_bytes).c_str(),
                opt.kv_dtype == KvDtype::kAuto ? dtype_name(opt.dtype) : kv_dtype_name(opt.kv_dtype),
                static_cast<long long>(opt.max_batch_tokens),
                static_cast<long long>(opt.max_running), opt.pad_decode ? ", decode padded" : "");
    std::printf("\nsummary\n");
    std::printf("  requests        %lld (%lld prompt + %lld output tokens)\n", static_cast<long long>(r.requests),
                static_cast<long long>(r.prompt_tokens), static_cast<long long>(r.output_tokens));
    std::printf("  steps           %lld (%lld decode-only)\n", static_cast<long long>(r.steps),
                static_cast<long long>(r.decode_only_steps));
    std::printf("  calls           %lld (%lld decode-only), %lld tokens, %lld KV rows written, "
                "%lld slot reuses\n",
                static_cast<long long>(r.calls), static_cast<long long>(r.decode_only_calls),
                static_cast<long long>(r.tokens), static_cast<long long>(r.rows_written),
                static_cast<long long>(r.slot_reuses));
    std::printf("  wall time       %.3f s (replay, data generation and verification)\n", r.wall_seconds);
    std::printf("  op time         %.3f s (the rope_pool_fused calls alone, %.1f%% of wall)\n", r.op_seconds,
                r.wall_seconds > 0 ? 100.0 * r.op_seconds / r.wall_seconds : 0.0);
    std::printf("  bytes moved     %s (SPEC section 7), %s per call on average\n", human_bytes(r.bytes).c_str(),
                human_bytes(mean_bytes).c_str());
    std::printf("  op bandwidth    %.2f GB/s effective (prefill/mixed calls %.2f GB/s, decode-only %.2f GB/s)\n",
                op_gbps, other_gbps, dec_gbps);
    std::printf("  per call        %.1f us mean, %.1f us p50, %.1f us p99; decode-only %.1f us mean "
                "(%lld calls), others %.1f us mean\n",
                mean_us, p50, p99, dec_mean_us, static_cast<long long>(r.decode_only_calls),
                other_calls ? other_s * 1e6 / static_cast<double>(other_calls) : 0.0);
    std::printf("  memcpy          %.2f GB/s best, %.2f GB/s median (%s, %d reps, same threads)\n",
                mc.best_gbps, mc.median_gbps, human_bytes(mc.bytes).c_str(), mc.reps);
    std::printf("  ratio           %.2f of memcpy (op GB/s / best memcpy GB/s)\n", ratio);
    std::printf("  checks          %lld q_rot/k_rot heads spot-checked%s, %lld pool rows (token x layer) "
                "checked, %lld untouched rows\n",
                static_cast<long long>(r.spot_checked_heads), opt.check_all ? " (+ all, --check-all)" : "",
                static_cast<long long>(r.pool_rows_checked), static_cast<long long>(r.untouched_rows_checked));
    std::printf("  memory          %.1f MB resident after warm-up, %.1f MB at the end\n", r.rss_warm_mb,
                r.rss_end_mb);
    if (load_before >= 0)
      std::printf("  machine         load average %.2f at the start, %.2f at the end (%d CPUs online)\n",
                  load_before, load_average(), static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)));
    if (max_rss_growth_mb >= 0 && r.rss_end_mb - r.rss_warm_mb > max_rss_growth_mb) {
      std::fprintf(stderr, "ropekv-replay: resident memory grew by %.1f MB after warm-up (limit %.1f MB)\n",
                   r.rss_end_mb - r.rss_warm_mb, max_rss_growth_mb);
      return 1;
    }
    std::printf("verified\n");
    std::fflush(stdout);

    if (!json_out.empty()) {
      nlohmann::ordered_json j;
      j["tool"] = "ropekv-replay";
      j["ropekv_version"] = ropekv::version();
      j["date"] = utc_now();
      j["cpu_target"] = ropekv::cpu_target();
      j["threads"] = opt.threads;
      j["threads_effective"] = effective_threads(opt.threads);
      j["config"] = config_path;
      j["model"] = {{"model_type", model.model_type},
                    {"num_qo_heads", model.num_qo_heads},
                    {"num_kv_heads", model.num_kv_heads},
                    {"head_dim", model.head_dim},
                    {"rotary_dim", model.rotary_dim},
                    {"is_neox", model.is_neox},
                    {"num_layers", model.num_layers},
                    {"attention_layers", model.attention_layers},
                    {"notes", model.notes}};
      // One type's RoPE as JSON: its rope_theta and rope_scaling (null: none).
      auto rope_json = [](const LayerRope& lr, nlohmann::ordered_json& o) {
        o["rope_theta"] = lr.rope_theta;
        o["rope_scaling"] = lr.rope_scaling.type == ropekv::RopeScalingType::kNone
                                ? nlohmann::ordered_json(nullptr)
                                : nlohmann::ordered_json::parse(lr.rope_scaling_desc);
      };
      if (model.ropes.size() == 1) {
        rope_json(model.ropes[0], j["model"]);
      } else {
        for (size_t i = 0; i < model.ropes.size(); ++i) {
          nlohmann::ordered_json t{{"layer_type", model.ropes[i].layer_type}};
          rope_json(model.ropes[i], t);
          t["layers"] = model.layers_of(i, model.num_layers);
          j["model"]["rope_per_layer_type"].push_back(t);
        }
      }
      j["dtype"] = dtype_name(opt.dtype);
      j["kv_cache_dtype"] = kv_dtype_name(opt.kv_dtype);
      j["qk_norm"] = model.qk_norm == QkNorm::kNone
                         ? nlohmann::ordered_json(nullptr)
                         : nlohmann::ordered_json{
                               {"weights", model.qk_norm == QkNorm::kUnit ? "ones" : "random"},
                               {"norm_eps", model.norm_eps},
                               {"from", model.qk_norm_from}};
      j["k_scale"] = opt.k_scale;
      j["v_scale"] = opt.v_scale;
      j["qkv"] = qkv_s;
      j["workload"] = wl.source;
      j["seed"] = opt.seed;
      j["layers"] = r.layers;
      j["pool_size"] = r.pool_size;
      j["max_batch_tokens"] = opt.max_batch_tokens;
      j["max_running"] = opt.max_running;
      j["pad_decode"] = opt.pad_decode;
      j["requests"] = r.requests;
      j["prompt_tokens"] = r.prompt_tokens;
      j["output_tokens"] = r.output_tokens;
      j["steps"] = r.steps;
      j["decode_only_steps"] = r.decode_only_steps;
      j["calls"] = r.calls;
      j["decode_only_calls"] = r.decode_only_calls;
      j["tokens"] = r.tokens;
      j["rows_written"] = r.rows_written;
      j["slot_reuses"] = r.slot_reuses;
      j["wall_s"] = r.wall_seconds;
      j["op_s"] = r.op_seconds;
      j["bytes"] = r.bytes;
      j["op_gbps"] = op_gbps;
      j["op_gbps_prefill_mixed"] = other_gbps;
      j["op_gbps_decode_only"] = dec_gbps;
      j["call_us"] = {{"mean", mean_us}, {"p50", p50}, {"p99", p99}, {"decode_only_mean", dec_mean_us}};
      j["memcpy"] = {{"bytes", mc.bytes},
                     {"reps", mc.reps},
                     {"best_gbps", mc.best_gbps},
                     {"median_gbps", mc.median_gbps}};
      j["ratio_to_memcpy"] = ratio;
      j["loadavg_1min_start"] = load_before;
      j["rss_mb"] = {{"after_warmup", r.rss_warm_mb}, {"end", r.rss_end_mb}};
      j["checks"] = {{"spot_checked_heads", r.spot_checked_heads},
                     {"check_all", opt.check_all},
                     {"pool_rows_checked", r.pool_rows_checked},
                     {"untouched_rows_checked", r.untouched_rows_checked}};
      j["verified"] = true;
      if (!write_file(json_out, j.dump(2) + "\n"))
        throw InputError("--json: writing " + json_out + " failed (disk full or I/O error); the run "
                         "itself was verified");
    }
    return 0;
  } catch (const InputError& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "ropekv-replay: error: %s\n", e.what());
    return 2;
  } catch (const std::bad_alloc&) {
    std::fflush(stdout);
    std::fprintf(stderr, "ropekv-replay: error: out of memory (the pools grow with --layers, --pool-size "
                         "and the config's kv heads, the step's buffers with --max-batch-tokens and "
                         "--max-running)\n");
    return 2;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "ropekv-replay: internal error: %s\n", e.what());
    return 3;
  }
}
