#include "workload.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "model_config.h"  // InputError
#include "numerics.h"

namespace replay {
namespace {

int64_t lognormal_len(Rng& rng, double median, double sigma, int64_t lo, int64_t hi) {
  const double x = median * std::exp(sigma * rng.normal());
  const int64_t n = static_cast<int64_t>(std::llround(x));
  return std::clamp(n, lo, hi);
}

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

std::string lower(std::string s) {
  for (char& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

std::vector<std::string> split_csv(const std::string& line) {
  std::vector<std::string> out;
  std::string cur;
  for (char ch : line) {
    if (ch == ',') {
      out.push_back(trim(cur));
      cur.clear();
    } else {
      cur += ch;
    }
  }
  out.push_back(trim(cur));
  return out;
}

bool parse_count(const std::string& s, int64_t* out) {
  if (s.empty() || s.size() > 12) return false;
  int64_t v = 0;
  for (char ch : s) {
    if (ch < '0' || ch > '9') return false;
    v = v * 10 + (ch - '0');
  }
  *out = v;
  return true;
}

}  // namespace

Workload make_synthetic(const SyntheticParams& p) {
  Workload w;
  w.source = "synthetic (seed " + std::to_string(p.seed) + ")";
  Rng rng(mix_key(p.seed, 0x5EED, 0, 0, 0));
  for (int64_t i = 0; i < p.requests; ++i) {
    Request r;
    r.id = i;
    r.prompt_tokens = lognormal_len(rng, p.prompt_median, p.prompt_sigma, p.prompt_min, p.prompt_max);
    r.output_tokens = lognormal_len(rng, p.output_median, p.output_sigma, p.output_min, p.output_max);
    w.requests.push_back(r);
  }
  return w;
}

Workload load_azure_trace(const std::string& path, int64_t max_requests) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(path + ": cannot open the trace (--trace FILE)");
  Workload w;
  w.source = path;
  std::string line;
  int64_t lineno = 0;
  int col_ts = -1, col_ctx = -1, col_gen = -1;
  size_t ncols = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (lineno == 1 && line.size() >= 3 && line.compare(0, 3, "\xEF\xBB\xBF") == 0) line.erase(0, 3);
    if (trim(line).empty()) continue;
    const std::vector<std::string> cols = split_csv(line);
    if (col_ctx < 0) {  // header
      for (size_t i = 0; i < cols.size(); ++i) {
        const std::string n = lower(cols[i]);
        if (n == "timestamp") col_ts = static_cast<int>(i);
        if (n == "contexttokens") col_ctx = static_cast<int>(i);
        if (n == "generatedtokens") col_gen = static_cast<int>(i);
      }
      if (col_ts < 0 || col_ctx < 0 || col_gen < 0)
        throw InputError(path + ":" + std::to_string(lineno) +
                         ": expected the Azure LLM inference trace header "
                         "\"TIMESTAMP,ContextTokens,GeneratedTokens\", got \"" + line + "\"");
      ncols = cols.size();
      continue;
    }
    if (cols.size() != ncols)
      throw InputError(path + ":" + std::to_string(lineno) + ": expected " + std::to_string(ncols) +
                       " columns, got " + std::to_string(cols.size()) + ": \"" + line + "\"");
    Request r;
    r.timestamp = cols[col_ts];
    if (!parse_count(cols[col_ctx], &r.prompt_tokens) || r.prompt_tokens < 1)
      throw InputError(path + ":" + std::to_string(lineno) +
                       ": ContextTokens must be an integer >= 1, got \"" + cols[col_ctx] + "\"");
    if (!parse_count(cols[col_gen], &r.output_tokens))
      throw InputError(path + ":" + std::to_string(lineno) +
                       ": GeneratedTokens must be an integer >= 0, got \"" + cols[col_gen] + "\"");
    w.requests.push_back(r);
  }
  if (col_ctx < 0) throw InputError(path + ": empty trace (no header)");
  if (w.requests.empty()) throw InputError(path + ": the trace has a header but no requests");
  // Numbers (seconds, 9 before 10) sort by value when every timestamp is
  // one; ISO timestamps ("2023-11-16 18:15:46.6805900") sort as strings.
  std::vector<double> seconds(w.requests.size());
  bool numeric = true;
  for (size_t i = 0; i < w.requests.size() && numeric; ++i) {
    const std::string ts = trim(w.requests[i].timestamp);
    char* end = nullptr;
    seconds[i] = ts.empty() ? 0.0 : std::strtod(ts.c_str(), &end);
    numeric = !ts.empty() && end == ts.c_str() + ts.size() && std::isfinite(seconds[i]);
  }
  std::vector<size_t> order(w.requests.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return numeric ? seconds[a] < seconds[b] : w.requests[a].timestamp < w.requests[b].timestamp;
  });
  std::vector<Request> sorted;
  sorted.reserve(order.size());
  for (size_t i : order) sorted.push_back(w.requests[i]);
  w.requests = std::move(sorted);
  if (max_requests > 0 && static_cast<int64_t>(w.requests.size()) > max_requests)
    w.requests.resize(static_cast<size_t>(max_requests));
  for (size_t i = 0; i < w.requests.size(); ++i) w.requests[i].id = static_cast<int64_t>(i);
  return w;
}

}  // namespace replay
