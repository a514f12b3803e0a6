// The CPU backend against the float64 reference, on every Highway target
// compiled into the library that this CPU supports (dispatch forced with
// hwy::SetSupportedTargetsForTest), for f32, f16 and bf16, the SPEC section 6
// models whose rotary dim equals head_dim, odd token counts, int32 and int64
// indices, strided layouts, thread counts, and special values.
//
// Every call: outputs poisoned with NaN bit patterns beforehand (an unwritten
// element fails), every element within one rounding of the output dtype plus
// the fp32 arithmetic bound (test_util.h, element_tolerance), the named pool
// rows equal to k_rot / v bit for bit, every other byte of every buffer
// untouched.
#include <gtest/gtest.h>
#include <sys/mman.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cpu/host.h"
#include "test_util.h"

namespace ropekv_test {
namespace {

const DType kFloatTypes[] = {DType::kF32, DType::kF16, DType::kBF16};

std::mt19937_64& rng_for_golden() {
  static std::mt19937_64 rng(20240229);
  return rng;
}

// Runs the case on every target and checks each result.
void check_on_all_targets(Case& c, const Expected& e, const ropekv::ExecOptions& opt = {}) {
  for_each_target([&](int64_t) { run_and_check(c, e, opt); });
}

TEST(Cpu, HighwayTargets) {
  const std::string names = target_names();
  std::printf("[ targets ] compiled and supported here: %s; dispatcher picks %s\n", names.c_str(),
              ropekv::cpu_target().c_str());
  int n = 0;
  for_each_target([&](int64_t) { ++n; });
  EXPECT_GE(n, 1);
  // Dispatch is back to the best target afterwards.
  hwy::SetSupportedTargetsForTest(0);
  EXPECT_EQ(ropekv::cpu_target(), std::string(hwy::TargetName(hwy::SupportedAndGeneratedTargets()[0])));
}

// ------------------------------------------------------------ real models

struct ModelParam {
  ModelConfig model;
  DType dtype;
};

void PrintTo(const ModelParam& p, std::ostream* os) {
  *os << p.model.name << " (Hq " << p.model.hq << ", Hk " << p.model.hk << ", D " << p.model.d
      << ", base " << p.model.base << ") " << dtype_name(p.dtype);
}

std::string model_param_name(const ::testing::TestParamInfo<ModelParam>& info) {
  return std::string(info.param.model.name) + "_" + dtype_name(info.param.dtype);
}

std::vector<ModelParam> model_params() {
  std::vector<ModelParam> out;
  for (const ModelConfig& m : full_rotary_models())
    for (DType dt : kFloatTypes) out.push_back({m, dt});
  return out;
}

class Models : public ::testing::TestWithParam<ModelParam> {};

// T in {1, 19, 99}, positions up to 2^24 (2^24 - 1 and negatives included),
// int32 and int64 indices, every target.
TEST_P(Models, MatchesReferenceOnEveryTarget) {
  const ModelParam& p = GetParam();
  std::mt19937_64 rng(test_seed());
  const struct {
    int64_t T;
    DType pos, slot;
  } runs[] = {{1, DType::kI32, DType::kI32},
              {19, DType::kI64, DType::kI32},
              {99, DType::kI32, DType::kI64},
              {19, DType::kI64, DType::kI64}};
  for (const auto& r : runs) {
    CaseSpec s;
    s.T = r.T;
    s.Hq = p.model.hq;
    s.Hk = p.model.hk;
    s.D = p.model.d;
    s.P = 2 * r.T + 7;
    s.base = p.model.base;
    s.dtype = p.dtype;
    s.pos_type = r.pos;
    s.slot_type = r.slot;
    s.layout.compact_null_strides = r.T == 19 && r.pos == DType::kI64 && r.slot == DType::kI32;
    Case c = make_case(s, rng);
    if (r.T == 99) {  // a few fixed positions on top of the random ones
      c.positions.set_index(1, (1 << 24) - 1);
      c.positions.set_index(2, -1);
      c.positions.set_index(3, -((1 << 24) - 1));
      c.positions.set_index(4, 0);
      c.positions.set_index(5, 500000);
    }
    const Expected e = expect(c);
    SCOPED_TRACE(describe(s));
    check_on_all_targets(c, e);
  }
}

INSTANTIATE_TEST_SUITE_P(Cpu, Models, ::testing::ValuesIn(model_params()), model_param_name);

// ------------------------------------------------------------ odd shapes (SIMD tails)

// Head dims whose half is not a multiple of any vector width, odd head counts.
TEST(Cpu, OddShapesOnEveryTarget) {
  std::mt19937_64 rng(test_seed());
  const struct {
    int64_t Hq, Hk, D;
    double base;
  } shapes[] = {{1, 1, 2, 10000.0},   {3, 1, 4, 10000.0},  {5, 5, 6, 500000.0},
                {7, 3, 10, 1e6},      {2, 1, 18, 10000.0}, {3, 3, 34, 10000.0},
                {4, 2, 40, 1e6},      {5, 1, 80, 10000.0}, {1, 1, 200, 500000.0},
                {2, 2, 258, 10000.0}, {9, 3, 50, 1.5}};
  int n = 0;
  for (const auto& sh : shapes)
    for (DType dt : kFloatTypes) {
      CaseSpec s;
      s.T = 5 + 2 * (n++ % 4);
      s.Hq = sh.Hq;
      s.Hk = sh.Hk;
      s.D = sh.D;
      s.P = s.T + 3;
      s.base = sh.base;
      s.dtype = dt;
      s.slot_type = n % 2 ? DType::kI64 : DType::kI32;
      Case c = make_case(s, rng);
      const Expected e = expect(c);
      SCOPED_TRACE(describe(s));
      check_on_all_targets(c, e);
    }
}

// ------------------------------------------------------------ special calls

CaseSpec small_spec(DType dt, int64_t T, int64_t P) {
  CaseSpec s;
  s.T = T;
  s.Hq = 4;
  s.Hk = 2;
  s.D = 64;
  s.P = P;
  s.base = 500000.0;
  s.dtype = dt;
  return s;
}

TEST(Cpu, ZeroTokensWritesNothing) {
  std::mt19937_64 rng(test_seed());
  for (DType dt : kFloatTypes) {
    Case c = make_case(small_spec(dt, 0, 5), rng);
    const Snapshot before(c);
    ropekv::rope_pool_fused(c.tensors(), c.config());
    for (const auto& [st, snap] : before.bytes)
      EXPECT_TRUE(st->snapshot() == snap) << "a T = 0 call changed memory";
  }
}

TEST(Cpu, OneToken) {
  std::mt19937_64 rng(test_seed());
  for (DType dt : kFloatTypes)
    for (int64_t slot : {int64_t{0}, int64_t{6}, int64_t{-1}}) {
      Case c = make_case(small_spec(dt, 1, 7), rng);
      c.slots.set_index(0, slot);
      const Expected e = expect(c);
      check_on_all_targets(c, e);
    }
}

TEST(Cpu, AllSlotsNegativeLeavesPoolsAlone) {
  std::mt19937_64 rng(test_seed());
  for (DType dt : kFloatTypes) {
    Case c = make_case(small_spec(dt, 17, 9), rng);
    for (int64_t t = 0; t < 17; ++t)
      c.slots.set_index(t, t % 3 == 0 ? -1 : -static_cast<int64_t>(rng() % 1000000) - 2);
    c.slots.set_index(16, std::numeric_limits<int32_t>::min());
    const Expected e = expect(c);
    check_on_all_targets(c, e);  // check_call: the pools may not change at all
  }
}

TEST(Cpu, SlotsWithGapsAndReversedOrder) {
  std::mt19937_64 rng(test_seed());
  for (DType dt : kFloatTypes) {
    CaseSpec s = small_spec(dt, 12, 100);
    s.slot_type = DType::kI64;
    Case c = make_case(s, rng);
    for (int64_t t = 0; t < 12; ++t) c.slots.set_index(t, 99 - 8 * t);  // 99, 91, ..., 11
    c.slots.set_index(5, -1);
    const Expected e = expect(c);
    check_on_all_targets(c, e);
  }
}

TEST(Cpu, LargePositions) {
  // int64 positions beyond 2^24 and 2^31: fp32(pos) rounds, angles reach the
  // double fallback of the sincos; lanes of one vector mix both paths.
  std::mt19937_64 rng(test_seed());
  for (DType dt : kFloatTypes) {
    CaseSpec s = small_spec(dt, 9, 12);
    s.D = 128;
    s.pos_type = DType::kI64;
    Case c = make_case(s, rng);
    const int64_t special[] = {(int64_t{1} << 24) + 1, (int64_t{1} << 28) + 3,
                               int64_t{1} << 31,       (int64_t{1} << 33) + 12345,
                               -(int64_t{1} << 35),    int64_t{421657440},
                               int64_t{1} << 40,       std::numeric_limits<int64_t>::max(),
                               std::numeric_limits<int64_t>::min()};
    for (int64_t t = 0; t < 9; ++t) c.positions.set_index(t, special[t]);
    const Expected e = expect(c);
    check_on_all_targets(c, e);
  }
}

// ------------------------------------------------------------ layouts

TEST(Cpu, FusedQkvViews) {
  std::mt19937_64 rng(test_seed());
  for (DType dt : kFloatTypes) {
    CaseSpec s;
    s.T = 19;
    s.Hq = 32;
    s.Hk = 8;
    s.D = 128;
    s.P = 40;
    s.base = 500000.0;
    s.dtype = dt;
    s.layout.fused_qkv = true;    // token stride (Hq + 2 Hk) D > H D
    s.layout.fused_out = true;    // q_rot, k_rot also share one buffer
    s.layout.in_row_pad = 24;     // and the rows have padding
    s.layout.pool_row_pad = 16;   // pool rows with padding
    s.layout.lead = 3;
    Case c = make_case(s, rng);
    const Expected e = expect(c);
    check_on_all_targets(c, e);
    // The same with the offsets in the data pointer instead of byte_offset.
    s.layout.byte_offset = false;
    Case c2 = make_case(s, rng);
    check_on_all_targets(c2, expect(c2));
  }
}

TEST(Cpu, StridedLastDimension) {
  std::mt19937_64 rng(test_seed());
  const struct {
    int64_t in, out, pool;
  } strides[] = {{2, 1, 1}, {1, 2, 1}, {1, 1, 2}, {2, 2, 2}, {3, 1, 2}};
  int n = 0;
  for (const auto& st : strides)
    for (DType dt : kFloatTypes) {
      CaseSpec s;
      s.T = 7;
      s.Hq = 3;
      s.Hk = 2;
      s.D = n % 2 ? 96 : 34;
      s.P = 11;
      s.base = 10000.0;
      s.dtype = dt;
      s.layout.in_last_stride = st.in;
      s.layout.out_last_stride = st.out;
      s.layout.pool_last_stride = st.pool;
      s.layout.fused_qkv = n % 3 == 0;
      s.layout.pool_head_pad = n % 2;
      ++n;
      Case c = make_case(s, rng);
      const Expected e = expect(c);
      SCOPED_TRACE(describe(s) + " last strides " + std::to_string(st.in) + "/" +
                   std::to_string(st.out) + "/" + std::to_string(st.pool));
      check_on_all_targets(c, e);
    }
}

TEST(Cpu, StridedIndexArrays) {
  std::mt19937_64 rng(test_seed());
  int n = 0;
  for (DType dt : kFloatTypes)
    for (int64_t stride : {2, 3}) {
      CaseSpec s = small_spec(dt, 13, 20);
      s.pos_type = n % 2 ? DType::kI64 : DType::kI32;
      s.slot_type = n % 2 ? DType::kI32 : DType::kI64;
      s.layout.index_stride = stride;
      s.layout.byte_offset = (n++ % 3) != 0;
      Case c = make_case(s, rng);
      check_on_all_targets(c, expect(c));
    }
}

TEST(Cpu, PaddedHeadsAndNegativeTokenStride) {
  std::mt19937_64 rng(test_seed());
  for (DType dt : kFloatTypes) {
    CaseSpec s = small_spec(dt, 6, 10);
    s.layout.in_head_pad = 5;
    s.layout.out_head_pad = 3;
    s.layout.pool_head_pad = 7;
    Case c = make_case(s, rng);
    check_on_all_targets(c, expect(c));

    // q read through a view with the token order reversed (negative stride).
    Case r = make_case(small_spec(dt, 6, 10), rng);
    const Tensor& q = r.q;
    r.q = Tensor::view(q.storage(), dt, q.shape(),
                       {-q.strides()[0], q.strides()[1], q.strides()[2]},
                       q.off(q.shape()[0] - 1, 0, 0));
    check_on_all_targets(r, expect(r));
  }
}

// A pool whose element offsets pass 2^31 (and byte offsets 2^32): rows
// 2^30 + 64 elements apart in a 12 GiB virtual mapping that is never
// committed (MAP_NORESERVE; only the touched pages get memory); then a pool
// of more than 2^31 rows named by int64 slots. Skipped where the address
// space cannot be reserved.
struct Mapping {
  void* p = MAP_FAILED;
  size_t n = 0;
  explicit Mapping(size_t bytes) : n(bytes) {
    p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
             -1, 0);
  }
  ~Mapping() {
    if (p != MAP_FAILED) munmap(p, n);
  }
  StoragePtr storage() {
    auto s = std::make_shared<Storage>();
    s->base = static_cast<uint8_t*>(p);
    s->size = n;
    return s;
  }
};

void big_pool_case(DType dt, int64_t P, int64_t row_stride, const std::vector<int64_t>& slots,
                   std::mt19937_64& rng) {
  const int64_t T = static_cast<int64_t>(slots.size()), Hq = 3, Hk = 2, D = 8;
  const size_t bytes = static_cast<size_t>(((P - 1) * row_stride + Hk * D + 64) * dtype_size(dt));
  Mapping km(bytes), vm(bytes);
  if (km.p == MAP_FAILED || vm.p == MAP_FAILED)
    GTEST_SKIP() << "cannot reserve " << bytes << " bytes of address space";
  Case c;
  c.spec.T = T;
  c.spec.Hq = Hq;
  c.spec.Hk = Hk;
  c.spec.D = D;
  c.spec.P = P;
  c.spec.base = 10000.0;
  c.spec.dtype = dt;
  c.spec.slot_type = DType::kI64;
  c.q = Tensor::compact(dt, {T, Hq, D});
  c.k = Tensor::compact(dt, {T, Hk, D});
  c.v = Tensor::compact(dt, {T, Hk, D});
  c.q_rot = Tensor::compact(dt, {T, Hq, D});
  c.k_rot = Tensor::compact(dt, {T, Hk, D});
  c.k_pool = Tensor::view(km.storage(), dt, {P, Hk, D}, {row_stride, D, 1}, 0);
  c.v_pool = Tensor::view(vm.storage(), dt, {P, Hk, D}, {row_stride, D, 1}, 0);
  c.positions = Tensor::compact(DType::kI32, {T});
  c.slots = Tensor::compact(DType::kI64, {T});
  for (Tensor* t : {&c.q, &c.k, &c.v}) fill_random(*t, rng);
  poison_storage(c.q_rot);
  poison_storage(c.k_rot);
  // The rows around the named ones get random values (the rest of the
  // mapping stays untouched zero pages).
  std::set<int64_t> rows;
  for (int64_t s : slots)
    for (int64_t r = s - 1; r <= s + 1; ++r)
      if (r >= 0 && r < P) rows.insert(r);
  for (int64_t r : rows)
    for (int64_t h = 0; h < Hk; ++h)
      for (int64_t d = 0; d < D; ++d) {
        c.k_pool.set_value(c.k_pool.off(r, h, d), random_value(rng));
        c.v_pool.set_value(c.v_pool.off(r, h, d), random_value(rng));
      }
  std::map<int64_t, std::vector<uint64_t>> k_before, v_before;
  for (int64_t r : rows)
    for (int64_t h = 0; h < Hk; ++h)
      for (int64_t d = 0; d < D; ++d) {
        k_before[r].push_back(c.k_pool.raw(c.k_pool.off(r, h, d)));
        v_before[r].push_back(c.v_pool.raw(c.v_pool.off(r, h, d)));
      }
  for (int64_t t = 0; t < T; ++t) {
    c.positions.set_index(t, random_position(rng));
    c.slots.set_index(t, slots[t]);
  }
  ropekv::rope_pool_fused(c.tensors(), c.config());
  Expected e = expect(c);
  EXPECT_EQ(check_rotated(c.q_rot, e.q, e.q_tol, "q_rot", 8), 0);
  EXPECT_EQ(check_rotated(c.k_rot, e.k, e.k_tol, "k_rot", 8), 0);
  std::printf("[ big pool ] %s pool of %lld rows, row stride %lld elements: largest element "
              "offset written %lld\n",
              dtype_name(dt), static_cast<long long>(P), static_cast<long long>(row_stride),
              static_cast<long long>(c.k_pool.off(*std::max_element(slots.begin(), slots.end()),
                                                  Hk - 1, D - 1)));
  std::map<int64_t, int64_t> token_of;
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] >= 0) token_of[slots[t]] = t;
  for (int64_t r : rows) {
    int64_t i = 0;
    for (int64_t h = 0; h < Hk; ++h)
      for (int64_t d = 0; d < D; ++d, ++i) {
        const uint64_t kp = c.k_pool.raw(c.k_pool.off(r, h, d));
        const uint64_t vp = c.v_pool.raw(c.v_pool.off(r, h, d));
        auto it = token_of.find(r);
        if (it != token_of.end()) {
          EXPECT_EQ(kp, c.k_rot.raw(c.k_rot.off(it->second, h, d))) << "row " << r;
          EXPECT_EQ(vp, c.v.raw(c.v.off(it->second, h, d))) << "row " << r;
        } else {
          EXPECT_EQ(kp, k_before[r][i]) << "untouched row " << r << " changed";
          EXPECT_EQ(vp, v_before[r][i]) << "untouched row " << r << " changed";
        }
      }
  }
}

TEST(Cpu, PoolOffsetsBeyond32Bits) {
  std::mt19937_64 rng(test_seed());
  // 4 rows, 2^30 + 64 elements apart (f32: 4 GiB apart).
  big_pool_case(DType::kF32, 4, (int64_t{1} << 30) + 64, {3, -1, 1, 2}, rng);
  if (HasFatalFailure() || IsSkipped()) return;
  // More than 2^31 rows of one head of 8 bf16 (compact rows of 16 elements).
  const int64_t P = (int64_t{1} << 31) + 9;
  big_pool_case(DType::kBF16, P, 16, {P - 1, (int64_t{1} << 31) + 1, 5, -3, (int64_t{1} << 31) - 1},
                rng);
}

// P whole rows of a row stride past 2^62 bytes overflow 64 bits where the
// pool's span, (P - 1) rows and one head, does not: validation takes the
// layout, and the choice of stored or streamed pool rows must not multiply
// it out (signed overflow: UBSan stopped the call). No token names a row, so
// no row is touched and a small storage backs the view.
TEST(Cpu, PoolRowStrideWhoseWholeRowsPass64Bits) {
  std::mt19937_64 rng(test_seed());
  for (DType dt : kFloatTypes) {
    Case c = make_case(small_spec(dt, 4, 2), rng);
    const int64_t row_stride = (int64_t{1} << 62) / dtype_size(dt);
    for (Tensor* pool : {&c.k_pool, &c.v_pool})
      *pool = Tensor::view(pool->storage(), dt, {2, c.spec.Hk, c.spec.D},
                           {row_stride, c.spec.D, 1}, 0);
    for (int64_t t = 0; t < c.spec.T; ++t) c.slots.set_index(t, -1 - t);
    const Expected e = expect(c);
    check_on_all_targets(c, e);
  }
}

// ------------------------------------------------------------ threads

// The team a call starts: num_threads (or OpenMP's default), but at most
// max(64, 4 x processors) (a million made OpenMP abort the process) and one
// per 64 KiB moved.
TEST(Cpu, ThreadTeamIsCapped) {
  namespace host = ropekv::cpu::host;
  ropekv::ExecOptions o;
  const int64_t huge = int64_t{1} << 40;  // bytes: no per-64-KiB limit in the way
#ifdef _OPENMP
  EXPECT_GE(host::max_threads(), 64);
  o.num_threads = 1000000;
  EXPECT_EQ(host::plan_threads(o, huge), host::max_threads());
  o.num_threads = 3;
  EXPECT_EQ(host::plan_threads(o, huge), 3);
  EXPECT_EQ(host::plan_threads(o, 2 * host::kMinBytesPerThread), 2);
  // The default count (num_threads 0: OMP_NUM_THREADS, here set as
  // omp_set_num_threads does) has the same cap.
  const int before = omp_get_max_threads();
  o.num_threads = 0;
  omp_set_num_threads(5000);
  EXPECT_EQ(host::plan_threads(o, huge), std::min<int64_t>(5000, host::max_threads()));
  omp_set_num_threads(3);
  EXPECT_EQ(host::plan_threads(o, huge), 3);
  omp_set_num_threads(before);
#endif
  o.num_threads = 3;
  EXPECT_EQ(host::plan_threads(o, 100), 1);
}

TEST(Cpu, ThreadCountsGiveBitIdenticalResults) {
  std::mt19937_64 rng(test_seed());
  const struct {
    int64_t T, Hq, Hk, D;
  } shapes[] = {{99, 32, 8, 128}, {2, 32, 8, 128}, {3, 28, 4, 128}, {5, 16, 8, 256}, {1, 64, 8, 256}};
  for (DType dt : kFloatTypes)
    for (const auto& sh : shapes) {
      CaseSpec s;
      s.T = sh.T;
      s.Hq = sh.Hq;
      s.Hk = sh.Hk;
      s.D = sh.D;
      s.P = 2 * sh.T + 1;
      s.base = 1000000.0;
      s.dtype = dt;
      Case c = make_case(s, rng);
      const Expected e = expect(c);
      SCOPED_TRACE(describe(s));
      std::vector<uint8_t> first;
      for (int threads : {1, 2, 3, 0}) {
        ropekv::ExecOptions opt;
        opt.num_threads = threads;
        run_and_check(c, e, opt);
        const std::vector<uint8_t> got = result_bytes(c);
        if (threads == 1)
          first = got;
        else
          EXPECT_TRUE(got == first) << "num_threads " << threads << " differs from 1 thread";
      }
    }
}

#ifdef _OPENMP
// Callers that are themselves threads of their program's OpenMP team (their
// omp_get_thread_num() not 0), each with its own call, on one thread or
// asking for a team (nested, so one thread where nesting is off): every
// result has the bits of the same call made alone.
TEST(Cpu, CallsFromThreadsOfAnOpenMPTeam) {
  std::mt19937_64 rng(test_seed());
  constexpr int kCallers = 4;
  std::vector<Case> cases;
  std::vector<std::vector<uint8_t>> want;
  for (int i = 0; i < kCallers; ++i) {
    CaseSpec s;
    s.T = 3 + 20 * i;
    s.Hq = 32;
    s.Hk = 8;
    s.D = 64 << (i % 2);
    s.P = 2 * s.T + 1;
    s.dtype = kFloatTypes[i % 3];
    cases.push_back(make_case(s, rng));
    ropekv::ExecOptions one;
    one.num_threads = 1;
    cases.back().reset();
    ropekv::rope_pool_fused(cases.back().tensors(), cases.back().config(), one);
    want.push_back(result_bytes(cases.back()));
  }
  for (int threads : {1, 2}) {
    for (Case& c : cases) c.reset();
    int ran = 0;
#pragma omp parallel num_threads(kCallers) reduction(+ : ran)
    {
      const int i = omp_get_thread_num();
      ropekv::ExecOptions opt;
      opt.num_threads = threads;
      ropekv::rope_pool_fused(cases[i].tensors(), cases[i].config(), opt);
      ran = 1;
    }
    EXPECT_EQ(ran, kCallers);
    for (int i = 0; i < kCallers; ++i)
      EXPECT_TRUE(result_bytes(cases[i]) == want[i]) << "caller " << i << ", num_threads " << threads;
  }
}
#endif

#if defined(__x86_64__) || defined(__i386__)
// A caller's flush-to-zero and denormals-are-zero (PyTorch's
// torch.set_flush_denormal(True) sets both on its thread) change nothing:
// the call computes with subnormals on its own thread and on every thread of
// its team, so the bits are those of a call in the default mode, for any
// thread count, and the caller's mode is as it was after the call. Inputs
// and results mostly subnormal (2^-132 .. 2^-125), which flushing zeroes.
TEST(Cpu, CallersFlushToZeroChangesNothing) {
  std::mt19937_64 rng(test_seed());
  // (T = 64: each thread takes tokens; T = 2: (token, head-group) units.)
  const struct {
    int64_t T, Hq, D;
  } shapes[] = {{64, 32, 128}, {2, 64, 256}};
  for (const auto& sh : shapes)
  for (bool options : {false, true}) {
    CaseSpec s;
    s.T = sh.T;
    s.Hq = sh.Hq;
    s.Hk = 8;
    s.D = sh.D;
    s.P = 2 * s.T + 1;
    s.dtype = DType::kF32;
    Case c = make_case(s, rng);
    for (Tensor* t : {&c.q, &c.k, &c.v})
      t->for_each_offset([&](int64_t o) { t->set_value(o, std::ldexp(t->value(o), -129)); });
    ropekv::RopeConfig cfg = c.config();
    if (options) cfg.is_neox = false;  // the options path
    SCOPED_TRACE(describe(s) + (options ? ", options path" : ", plain path"));
    ropekv::ExecOptions one;
    one.num_threads = 1;
    c.reset();
    ropekv::rope_pool_fused(c.tensors(), cfg, one);
    const std::vector<uint8_t> want = result_bytes(c);
    // Some results are subnormal and nonzero (flushing would zero them).
    int64_t subnormal = 0;
    c.q_rot.for_each_offset([&](int64_t o) {
      const double x = std::fabs(c.q_rot.value(o));
      subnormal += x > 0.0 && x < std::ldexp(1.0, -126);
    });
    EXPECT_GT(subnormal, c.q_rot.numel() / 2);
    const unsigned int mode = _mm_getcsr();
    const unsigned int ftz_daz = (mode | 0x8040u) & ~0x3Fu;
    for (int threads : {1, 2, 0}) {
      c.reset();
      ropekv::ExecOptions opt;
      opt.num_threads = threads;
      _mm_setcsr(ftz_daz);
      ropekv::rope_pool_fused(c.tensors(), cfg, opt);
      const unsigned int after = _mm_getcsr() & ~0x3Fu;
      _mm_setcsr(mode);
      EXPECT_EQ(after, ftz_daz) << "the caller's mode after the call";
      EXPECT_TRUE(result_bytes(c) == want) << "num_threads " << threads;
    }
  }
}
#endif

// Small calls into pools of at least 8 MiB, whose rows the plain path stores
// non-temporally when they are 16-byte aligned (lead 0) and with ordinary
// stores when not (lead 1): decode and small prefill shapes, the token and
// the (token, head-group) thread plans, every target.
TEST(Cpu, SmallCallsIntoLargePools) {
  std::mt19937_64 rng(test_seed());
  const struct {
    int64_t T, Hq, Hk, D;
    int threads;
  } shapes[] = {{1, 32, 8, 128, 1}, {16, 32, 8, 128, 2}, {3, 64, 8, 256, 2}};
  for (DType dt : kFloatTypes)
    for (const auto& sh : shapes)
      for (int64_t lead : {0, 1}) {
        if (lead == 1 && sh.T != 1) continue;  // one unaligned case per dtype
        CaseSpec s;
        s.T = sh.T;
        s.Hq = sh.Hq;
        s.Hk = sh.Hk;
        s.D = sh.D;
        s.P = (int64_t{8} << 20) / (sh.Hk * sh.D * dtype_size(dt)) + sh.T;
        s.base = 500000.0;
        s.dtype = dt;
        s.layout.lead = lead;
        Case c = make_case(s, rng);
        const Expected e = expect(c);
        SCOPED_TRACE(describe(s) + " lead=" + std::to_string(lead) +
                     " threads=" + std::to_string(sh.threads));
        ropekv::ExecOptions opt;
        opt.num_threads = sh.threads;
        check_on_all_targets(c, e, opt);
      }
}

// Calls from several user threads at once, each with its own head_dim and
// base, alternating, with and without OpenMP threads of their own: per-thread
// caches (inv_freq table, scratch) must never leak between calls.
TEST(Cpu, ConcurrentCallsWithDifferentConfigs) {
  const struct {
    int64_t D;
    double base;
    DType dt;
  } configs[] = {{128, 500000.0, DType::kBF16}, {64, 10000.0, DType::kF32},
                 {96, 1000000.0, DType::kF16}, {256, 10000.0, DType::kF32}};
  std::vector<Case> cases;
  std::vector<Expected> expected;
  for (int i = 0; i < 4; ++i) {
    std::mt19937_64 rng(test_seed(i));
    CaseSpec s;
    s.T = 23;
    s.Hq = 8;
    s.Hk = 2;
    s.D = configs[i].D;
    s.P = 30;
    s.base = configs[i].base;
    s.dtype = configs[i].dt;
    cases.push_back(make_case(s, rng));
    expected.push_back(expect(cases.back()));
  }
  // Each thread works on its own copy of the arrays, so the calls overlap in time.
  std::vector<std::thread> threads;
  std::vector<int> failures(3, 0);
  for (int th = 0; th < 3; ++th) {
    threads.emplace_back([&, th] {
      std::mt19937_64 rng(test_seed(100 + th));
      std::vector<Case> mine;
      for (int i = 0; i < 4; ++i) {
        std::mt19937_64 r2(test_seed(i));
        mine.push_back(make_case(cases[i].spec, r2));  // same seed: same contents
      }
      for (int rep = 0; rep < 12; ++rep) {
        const int i = static_cast<int>(rng() % 4);
        ropekv::ExecOptions opt;
        opt.num_threads = 1 + static_cast<int>(rng() % 2);
        Case& c = mine[i];
        c.reset();
        ropekv::rope_pool_fused(c.tensors(), c.config(), opt);
        const Expected& e = expected[i];
        if (check_rotated(c.q_rot, e.q, e.q_tol, "q_rot", 2) +
                check_rotated(c.k_rot, e.k, e.k_tol, "k_rot", 2) !=
            0)
          ++failures[th];
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int th = 0; th < 3; ++th) EXPECT_EQ(failures[th], 0) << "thread " << th;
}

// ------------------------------------------------------------ special values

// NaN or Inf in one token's q reach that token's q_rot only (the pair it
// belongs to), and NaN in one token's k reaches its k_rot and pool row only.
TEST(Cpu, NonFiniteInputsStayInTheirToken) {
  std::mt19937_64 rng(test_seed());
  const double specials[] = {std::numeric_limits<double>::quiet_NaN(),
                             std::numeric_limits<double>::infinity(),
                             -std::numeric_limits<double>::infinity()};
  for (DType dt : kFloatTypes)
    for (double bad : specials) {
      CaseSpec s = small_spec(dt, 9, 12);
      Case c = make_case(s, rng);
      const int64_t t_bad = 4, h_bad = 2, d_bad = 5;  // q token 4, head 2, dim 5 (pair 5 / 37)
      c.q.set_value(c.q.off(t_bad, h_bad, d_bad), bad);
      c.k.set_value(c.k.off(t_bad, 1, 40), bad);  // k token 4, head 1, dim 40 (pair 8 / 40)
      c.positions.set_index(t_bad, 12345);
      // Token t_bad writes pool row 7 (slots stay distinct: swap with its owner).
      for (int64_t t = 0; t < s.T; ++t)
        if (c.slots.index(t) == 7) c.slots.set_index(t, c.slots.index(t_bad));
      c.slots.set_index(t_bad, 7);
      const Expected e = expect(c);
      for_each_target([&](int64_t) {
        c.reset();
        const Snapshot before(c);
        ropekv::rope_pool_fused(c.tensors(), c.config());
        check_call(c, e, before, /*skip_tokens=*/{t_bad});
        // Token t_bad: every element that does not depend on the bad one is
        // still right; the two that do are not finite.
        const int64_t half = s.D / 2;
        for (int64_t h = 0; h < s.Hq; ++h)
          for (int64_t d = 0; d < s.D; ++d) {
            const double g = c.q_rot.value(c.q_rot.off(t_bad, h, d));
            if (h == h_bad && d % half == d_bad % half) {
              EXPECT_FALSE(std::isfinite(g)) << dtype_name(dt) << " input " << bad << ": q_rot[" << t_bad << ", " << h << ", " << d << "] = " << g;
            } else {
              const int64_t i = (t_bad * s.Hq + h) * s.D + d;
              EXPECT_LE(std::fabs(g - e.q[i]), e.q_tol[i]) << "q_rot[" << t_bad << ", " << h
                                                            << ", " << d << "] = " << g;
            }
          }
        for (int64_t h = 0; h < s.Hk; ++h)
          for (int64_t d = 0; d < s.D; ++d) {
            const double g = c.k_rot.value(c.k_rot.off(t_bad, h, d));
            if (h == 1 && d % half == 40 % half) {
              EXPECT_FALSE(std::isfinite(g)) << dtype_name(dt) << " input " << bad << ": k_rot = " << g;
            } else {
              const int64_t i = (t_bad * s.Hk + h) * s.D + d;
              EXPECT_LE(std::fabs(g - e.k[i]), e.k_tol[i]);
            }
          }
      });
    }
}

// Every 16-bit pattern (and 300000 random f32 patterns) through the
// kernel at position 0, where cos = 1 and sin = 0 exactly: the first element
// of each pair comes back as it went in, Inf, subnormals and signed zeros
// included, and NaN stays NaN. This pins the loads and stores of every
// format on every target.
TEST(Cpu, EveryBitPatternRoundTripsAtPositionZero) {
  std::mt19937_64 rng(test_seed());
  for (DType dt : kFloatTypes) {
    const int64_t T = dt == DType::kF32 ? 300000 : 65536;
    CaseSpec s;
    s.T = T;
    s.D = 2;
    s.P = 1;
    s.dtype = dt;
    Case c = make_case(s, rng);
    for (int64_t t = 0; t < T; ++t) {
      const uint64_t bits = dt == DType::kF32 ? (rng() & 0xFFFFFFFFu) : static_cast<uint64_t>(t);
      c.q.set_raw(c.q.off(t, 0, 0), bits);
      c.q.set_value(c.q.off(t, 0, 1), 1.0);
      c.k.set_value(c.k.off(t, 0, 0), -2.0);
      c.k.set_raw(c.k.off(t, 0, 1), bits);
      c.positions.set_index(t, 0);
      c.slots.set_index(t, -1);
    }
    for_each_target([&](int64_t) {
      c.reset();
      ropekv::rope_pool_fused(c.tensors(), c.config());
      int64_t bad = 0;
      for (int64_t t = 0; t < T; ++t) {
        const uint64_t in = c.q.raw(c.q.off(t, 0, 0));
        const double x = c.q.value(c.q.off(t, 0, 0));
        const double oq = c.q_rot.value(c.q_rot.off(t, 0, 0));
        const double ok = c.k_rot.value(c.k_rot.off(t, 0, 1));
        const double oq2 = c.q_rot.value(c.q_rot.off(t, 0, 1));
        const double ok1 = c.k_rot.value(c.k_rot.off(t, 0, 0));
        bool good;
        if (std::isnan(x)) {
          good = std::isnan(oq) && std::isnan(ok);
        } else {
          // Bit-exact, except that -0 may come back as +0 (x - 0 * s).
          good = (c.q_rot.raw(c.q_rot.off(t, 0, 0)) == in || (x == 0 && oq == 0)) &&
                 (c.k_rot.raw(c.k_rot.off(t, 0, 1)) == in || (x == 0 && ok == 0));
          // The partner: x * sin(0) = 0 (NaN for Inf: Inf * 0).
          good = good && (std::isinf(x) ? std::isnan(oq2) && std::isnan(ok1)
                                        : oq2 == 1.0 && ok1 == -2.0);
        }
        if (!good && bad++ < 8)
          ADD_FAILURE() << dtype_name(dt) << " input bits 0x" << std::hex << in << std::dec << " ("
                        << x << "): q_rot " << oq << ", " << oq2 << "; k_rot " << ok1 << ", "
                        << ok;
      }
      EXPECT_EQ(bad, 0) << dtype_name(dt);
    });
  }
}

// Round to nearest even, bit for bit. With rope_base = 2^40 and head_dim 4,
// inv_freq[1] = 2^-20 exactly, so at position 1 the second pair turns by
// theta = 2^-20, where fp32 cos is exactly 1 and fp32 sin exactly 2^-20.
// Then out[1] = x[1] - x[3] * 2^-20 with an exact product; choosing x[3] so
// that the product is m/2 ulp of the output dtype at x[1] (m = 1, 2, 3, 4, 6)
// makes the exact result a tie (m odd) or not: for f16 and bf16 it is exact
// in fp32 and the kernel's one rounding must give encode(exact) bit for bit
// (a truncating, tie-away or double-rounding store fails); for f32 the fp32
// subtraction itself is the one rounding. out[3] = x[3] + x[1] * 2^-20 the
// same way. Pair 0 (theta = 1) is checked within the usual bound.
TEST(Cpu, RoundingIsToNearestEvenBitForBit) {
  std::mt19937_64 rng(test_seed());
  const double base = std::ldexp(1.0, 40);
  ASSERT_EQ(ropekv::reference::inv_freq(1, 4, base), std::ldexp(1.0, -20));
  for (DType dt : kFloatTypes) {
    const Format f = format_of(dt);
    CaseSpec s;
    s.T = 4096;
    s.Hq = 1;
    s.Hk = 1;
    s.D = 4;
    s.P = 64;
    s.base = base;
    s.dtype = dt;
    Case c = make_case(s, rng);
    std::vector<double> want1(s.T), want3(s.T);
    for (int64_t t = 0; t < s.T; ++t) {
      c.positions.set_index(t, 1);
      // x1: a random value of the dtype with |x1| in [2^-3, 2^4).
      const double x1 = decode(encode(random_value(rng) * 2.0, f), f);
      const int m[] = {1, 2, 3, 4, 6};
      const double half_ulp = 0.5 * ulp_of(x1, f);
      double x3 = m[rng() % 5] * half_ulp * std::ldexp(1.0, 20);
      if (rng() & 1) x3 = -x3;
      for (Tensor* x : {&c.q, &c.k}) {
        x->set_value(x->off(t, 0, 1), x1);
        x->set_value(x->off(t, 0, 3), x3);
      }
      ASSERT_EQ(c.q.value(c.q.off(t, 0, 3)), x3);  // representable
      want1[t] = x1 - x3 * std::ldexp(1.0, -20);
      want3[t] = x3 + x1 * std::ldexp(1.0, -20);
    }
    Expected e = expect(c);
    for_each_target([&](int64_t) {
      c.reset();
      ropekv::rope_pool_fused(c.tensors(), c.config());
      int64_t bad = 0;
      for (int64_t t = 0; t < s.T; ++t) {
        for (int which = 0; which < 2; ++which) {
          const Tensor* out = which ? &c.k_rot : &c.q_rot;
          const std::vector<double>& ref = which ? e.k : e.q;
          const std::vector<double>& tol = which ? e.k_tol : e.q_tol;
          const uint64_t g1 = out->raw(out->off(t, 0, 1)), g3 = out->raw(out->off(t, 0, 3));
          const uint64_t w1 = encode(want1[t], f), w3 = encode(want3[t], f);
          if ((g1 != w1 || g3 != w3) && bad++ < 8)
            ADD_FAILURE() << dtype_name(dt) << " token " << t << ": out[1] 0x" << std::hex << g1
                          << " want 0x" << w1 << " (exact " << std::dec << want1[t]
                          << "), out[3] 0x" << std::hex << g3 << " want 0x" << w3 << std::dec
                          << " (exact " << want3[t] << ")";
          for (int64_t d : {0, 2}) {
            const double g = out->value(out->off(t, 0, d));
            const int64_t i = t * 4 + d;
            if (!(std::fabs(g - ref[i]) <= tol[i]) && bad++ < 8)
              ADD_FAILURE() << dtype_name(dt) << " token " << t << " dim " << d << ": " << g
                            << " vs " << ref[i];
          }
        }
      }
      EXPECT_EQ(bad, 0) << dtype_name(dt);
    });
  }
}

// Inputs at the edges of the formats: subnormals, values just above the
// smallest normal, values up to the format's maximum; results must still be
// within one rounding, and Inf (of the right sign) where the exact value
// overflows the format.
TEST(Cpu, ExtremeMagnitudes) {
  std::mt19937_64 rng(test_seed());
  for (DType dt : kFloatTypes) {
    CaseSpec s = small_spec(dt, 8, 10);
    Case c = make_case(s, rng);
    const Format f = format_of(dt);
    const double tiny = std::ldexp(1.0, 1 - bias_of(f) - f.man_bits);  // smallest subnormal
    const double big = decode(((1u << f.exp_bits) - 2) << f.man_bits, f);  // 2^emax
    for (Tensor* x : {&c.q, &c.k, &c.v}) {
      x->for_each_offset([&](int64_t o) {
        const uint64_t r = rng() % 4;
        const double m = 1.0 + static_cast<double>(rng() % 990) / 1000.0;  // < bf16's max 1.992
        double v = r == 0 ? tiny * static_cast<double>(rng() % 64 + 1)   // subnormal
                   : r == 1 ? big * m                                    // up to the maximum
                   : r == 2 ? std::ldexp(m, 1 - bias_of(f))              // just above the smallest normal
                            : random_value(rng);
        if (rng() & 1) v = -v;
        x->set_value(o, v);
      });
    }
    const Expected e = expect(c);
    int64_t overflows = 0;
    for (double r : e.q) overflows += std::fabs(r) >= overflow_threshold(f);
    EXPECT_GT(overflows, 0) << "the case should reach the overflow range";
    SCOPED_TRACE(dtype_name(dt));
    check_on_all_targets(c, e);
  }
}

// ------------------------------------------------------------ golden vectors

TEST(Cpu, GoldenVectorsThroughTheKernel) {
  // The 55 vectors of tests/data/rope_neox_f64.json (x exact in fp32) go
  // through the kernel in f32, as q and as k, one call per (head_dim, base)
  // group, one token per vector, and must land within the f32 bound of the
  // golden (independently computed) values.
  std::ifstream in(ROPEKV_GOLDEN_JSON);
  ASSERT_TRUE(in.good());
  nlohmann::json j;
  in >> j;
  std::map<std::pair<int64_t, double>, std::vector<const nlohmann::json*>> groups;
  for (const auto& c : j.at("cases"))
    groups[{c.at("head_dim").get<int64_t>(), c.at("rope_base").get<double>()}].push_back(&c);
  int64_t vectors = 0;
  for (const auto& [key, cases] : groups) {
    const int64_t D = key.first, T = static_cast<int64_t>(cases.size()), half = D / 2;
    const double base = key.second;
    Case c;
    c.spec.T = T;
    c.spec.Hq = c.spec.Hk = 1;
    c.spec.D = D;
    c.spec.P = T;
    c.spec.base = base;
    c.spec.dtype = DType::kF32;
    c.spec.pos_type = DType::kI64;
    c.q = Tensor::compact(DType::kF32, {T, 1, D});
    c.k = Tensor::compact(DType::kF32, {T, 1, D});
    c.v = Tensor::compact(DType::kF32, {T, 1, D});
    c.q_rot = Tensor::compact(DType::kF32, {T, 1, D});
    c.k_rot = Tensor::compact(DType::kF32, {T, 1, D});
    c.k_pool = Tensor::compact(DType::kF32, {T, 1, D});
    c.v_pool = Tensor::compact(DType::kF32, {T, 1, D});
    c.positions = Tensor::compact(DType::kI64, {T});
    c.slots = Tensor::compact(DType::kI32, {T});
    Expected e;
    e.q.resize(T * D);
    e.q_tol.resize(T * D);
    for (int64_t t = 0; t < T; ++t) {
      const auto& g = *cases[t];
      const int64_t pos = g.at("position").get<int64_t>();
      const auto x = g.at("x").get<std::vector<double>>();
      const auto want = g.at("expected").get<std::vector<double>>();
      c.positions.set_index(t, pos);
      c.slots.set_index(t, T - 1 - t);
      for (int64_t d = 0; d < D; ++d) {
        c.q.set_value(c.q.off(t, 0, d), x[d]);
        c.k.set_value(c.k.off(t, 0, d), x[d]);
        c.v.set_value(c.v.off(t, 0, d), -x[d]);
        e.q[t * D + d] = want[d];
      }
      for (int64_t i = 0; i < half; ++i) {
        const double th = ropekv::reference::angle(pos, i, D, base);
        const double cs = std::cos(th), sn = std::sin(th);
        e.q_tol[t * D + i] = element_tolerance(DType::kF32, want[i], x[i] * cs, x[i + half] * sn);
        e.q_tol[t * D + i + half] =
            element_tolerance(DType::kF32, want[i + half], x[i + half] * cs, x[i] * sn);
      }
      ++vectors;
    }
    e.k = e.q;
    e.k_tol = e.q_tol;
    random_bytes(*c.k_pool.storage(), rng_for_golden());
    random_bytes(*c.v_pool.storage(), rng_for_golden());
    c.k_pool_init = c.k_pool.storage()->snapshot();
    c.v_pool_init = c.v_pool.storage()->snapshot();
    SCOPED_TRACE("head_dim " + std::to_string(D) + ", base " + std::to_string(base));
    check_on_all_targets(c, e);
  }
  EXPECT_EQ(vectors, 55);
}

}  // namespace
}  // namespace ropekv_test
