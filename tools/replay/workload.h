// The requests of a replay: a seeded synthetic serving run, or a CSV trace in
// the public Azure LLM inference trace format.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace replay {

struct Request {
  int64_t id = 0;              ///< index in arrival order, 0-based
  std::string timestamp;       ///< as in the trace ("" for synthetic)
  int64_t prompt_tokens = 0;   ///< ContextTokens, >= 1
  int64_t output_tokens = 0;   ///< GeneratedTokens, >= 0
  /// KV rows the request writes: the prompt, then one per decode step. The
  /// prefill produces the first output token; each of the remaining
  /// output_tokens - 1 is produced by a decode step that writes the previous
  /// token's K/V. The last output token's K/V is never written.
  int64_t kv_tokens() const { return prompt_tokens + (output_tokens > 1 ? output_tokens - 1 : 0); }
};

struct Workload {
  std::string source;  ///< "synthetic (seed N)" or the trace path
  std::vector<Request> requests;
};

/// Parameters of the synthetic run: log-normal prompt and output lengths.
struct SyntheticParams {
  uint64_t seed = 1;
  int64_t requests = 32;
  double prompt_median = 256, prompt_sigma = 0.8;
  int64_t prompt_min = 8, prompt_max = 2048;
  double output_median = 64, output_sigma = 0.8;
  int64_t output_min = 1, output_max = 512;
};

Workload make_synthetic(const SyntheticParams& p);

/// Reads `TIMESTAMP,ContextTokens,GeneratedTokens` (header required, column
/// order free, extra columns ignored, CRLF accepted). Requests are replayed
/// in timestamp order (stable): by value where every timestamp is a number,
/// else as strings (ISO dates); `max_requests` > 0 keeps the first N.
/// Throws InputError with file:line for a malformed row.
Workload load_azure_trace(const std::string& path, int64_t max_requests);

}  // namespace replay
