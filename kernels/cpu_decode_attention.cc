// One query per row (a decode step) against a layer's KV cache as the token loop keeps it on
// XLA:CPU (`jaxrlhf.models.decode_kv.DecodeKV`): keys in tiles [b, k, c, d, i], values
// [b, k, S, d]. An XLA FFI handler; built and loaded by `kernels/cpu_decode_attention.py`,
// whose docstring says why it exists.
//
// Each (row, kv head) pair is one task: its queries' scores over one key tile at a time, an
// online softmax, and the values of that tile added in, so the keys and values of the pair
// are read once, and only up to the row's query slot (the slots after it are never visible).
// The tasks are shared out over XLA's intra-op thread pool (at most `threads` threads).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace {

namespace ffi = xla::ffi;

// 16 floats: one AVX-512 register, two AVX2 ones (the compiler splits it where it must).
typedef float Vec __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;
// As the XLA path's mask value: finite, so a query that sees no key averages the values.
constexpr float kMasked = -1e30f;

inline Vec Load(const float* p) {
  Vec x;
  std::memcpy(&x, p, sizeof(Vec));
  return x;
}

inline void Store(float* p, Vec x) { std::memcpy(p, &x, sizeof(Vec)); }

// e^x for x <= 0 (a score minus the running maximum), in a form the compiler vectorises:
// x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-7 Taylor-like polynomial (Cephes'
// expf coefficients, within 2 ulp of e^r), times 2^n built in the exponent bits.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);  // e^-87 ~ 1.6e-38 still a normal float; below it 0 is as good
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// One call's operands and the tasks' shared counters. Held by a shared_ptr: a pool task that
// starts after the call returned finds no pair left and touches nothing else.
struct Call {
  const float* q;       // [b, k, g, d]
  const float* keys;    // [b, k, c, d, i]
  const float* values;  // [b, k, S, d]
  const int32_t* q_seg;   // [b]
  const int32_t* kv_seg;  // [b, S]
  const int32_t* q_slot;  // [b]
  float* out;             // [b, k, g, d]
  int64_t kv_heads, tiles, length;
  float scale;
  int64_t pairs;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// The pair's G queries against its keys and values. G, D and the tile T are template
// arguments so that the scores (G x T) and the output (G x D) stay in registers.
template <int64_t G, int64_t D, int64_t T>
void AttendPair(const Call& c, int64_t pair) {
  constexpr int64_t kTileVecs = T / kLanes, kDimVecs = D / kLanes;
  const int64_t row = pair / c.kv_heads;
  const int32_t seg = c.q_seg[row];
  const int64_t live = std::min<int64_t>(c.length, int64_t{c.q_slot[row]} + 1);
  float* out = c.out + pair * G * D;
  if (live <= 0 || seg == 0) {  // a padding query: never read, zeros
    std::fill(out, out + G * D, 0.0f);
    return;
  }
  float q[G][D];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) q[g][d] = c.q[(pair * G + g) * D + d] * c.scale;
  Vec acc[G][kDimVecs] = {};
  float running_max[G], total[G];
  std::fill(running_max, running_max + G, kMasked);
  std::fill(total, total + G, 0.0f);
  const float* keys = c.keys + pair * c.tiles * D * T;
  const float* values = c.values + pair * c.length * D;
  const int32_t* kv_seg = c.kv_seg + row * c.length;
  alignas(64) float weights[G][T];
  for (int64_t start = 0; start < live; start += T) {
    const int64_t n = std::min(T, live - start);
    const float* tile = keys + (start / T) * D * T;
    Vec scores[G][kTileVecs] = {};
    for (int64_t d = 0; d < D; ++d) {
      Vec k_row[kTileVecs];
      for (int64_t t = 0; t < kTileVecs; ++t) k_row[t] = Load(tile + d * T + t * kLanes);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t t = 0; t < kTileVecs; ++t) scores[g][t] += q[g][d] * k_row[t];
    }
    for (int64_t g = 0; g < G; ++g) {
      float* w = weights[g];
      for (int64_t t = 0; t < kTileVecs; ++t) Store(w + t * kLanes, scores[g][t]);
      float tile_max = running_max[g];
      for (int64_t i = 0; i < T; ++i) {
        w[i] = (i < n && kv_seg[start + i] == seg) ? w[i] : kMasked;
        tile_max = std::max(tile_max, w[i]);
      }
      // The first visible slot's tile drops every slot weighed before it, exactly (those all
      // weighed 1, below, and were masked).
      const bool first_visible = running_max[g] == kMasked && tile_max != kMasked;
      const float rescale = first_visible ? 0.0f : ExpNonPositive(running_max[g] - tile_max);
      running_max[g] = tile_max;
      // A masked slot weighs exactly 0 (e^(-1e30 - max) is 0 in XLA's softmax; the clamped exp
      // would give 1e-38), unless no slot so far was visible: then every slot weighs 1, as in
      // XLA's softmax of a query that sees no key, until a visible one rescales them to 0.
      const bool none_visible = tile_max == kMasked;
      float sum = 0.0f;
      for (int64_t i = 0; i < T; ++i) {
        w[i] = i < n && (w[i] != kMasked || none_visible) ? ExpNonPositive(w[i] - tile_max) : 0.0f;
        sum += w[i];
      }
      total[g] = total[g] * rescale + sum;
      for (int64_t t = 0; t < kDimVecs; ++t) acc[g][t] *= rescale;
    }
    for (int64_t i = 0; i < n; ++i) {
      Vec v_row[kDimVecs];
      for (int64_t t = 0; t < kDimVecs; ++t) v_row[t] = Load(values + (start + i) * D + t * kLanes);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t t = 0; t < kDimVecs; ++t) acc[g][t] += weights[g][i] * v_row[t];
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t t = 0; t < kDimVecs; ++t)
      Store(out + g * D + t * kLanes, acc[g][t] * (1.0f / total[g]));
}

using PairFn = void (*)(const Call&, int64_t);
using F32x4 = ffi::Buffer<ffi::F32, 4>;
using F32x5 = ffi::Buffer<ffi::F32, 5>;
using S32x1 = ffi::Buffer<ffi::S32, 1>;
using S32x2 = ffi::Buffer<ffi::S32, 2>;

template <int64_t G, int64_t D>
PairFn ForTile(int64_t tile) {
  switch (tile) {
    case 32: return AttendPair<G, D, 32>;
    case 64: return AttendPair<G, D, 64>;
  }
  return nullptr;
}

template <int64_t G>
PairFn ForDim(int64_t dim, int64_t tile) {
  switch (dim) {
    case 16: return ForTile<G, 16>(tile);
    case 32: return ForTile<G, 32>(tile);
    case 64: return ForTile<G, 64>(tile);
    case 128: return ForTile<G, 128>(tile);
  }
  return nullptr;
}

// The supported shapes: 1-8 query heads per kv head, head dim 16/32/64/128, tiles of 32 or
// 64 slots (`kernels/cpu_decode_attention.py` checks the same before it calls).
PairFn Select(int64_t groups, int64_t dim, int64_t tile) {
  switch (groups) {
    case 1: return ForDim<1>(dim, tile);
    case 2: return ForDim<2>(dim, tile);
    case 3: return ForDim<3>(dim, tile);
    case 4: return ForDim<4>(dim, tile);
    case 5: return ForDim<5>(dim, tile);
    case 6: return ForDim<6>(dim, tile);
    case 7: return ForDim<7>(dim, tile);
    case 8: return ForDim<8>(dim, tile);
  }
  return nullptr;
}

// Takes pairs until none is left. Every thread that runs this, the caller's included, takes
// work from the same counter, so the caller never waits on a task the pool has not started.
void Drain(Call& c, PairFn fn) {
  for (int64_t pair = c.next.fetch_add(1); pair < c.pairs; pair = c.next.fetch_add(1)) {
    fn(c, pair);
    c.done.fetch_add(1, std::memory_order_release);
  }
}

// `threads`: how many of the pool's threads may share the pairs (the caller's included):
// the cores per CPU device, so that devices which already keep every core busy (virtual
// devices on a few cores) do not also split their own calls.
ffi::Error Attend(ffi::ThreadPool pool, F32x4 q, F32x5 keys, F32x4 values, S32x1 q_seg,
                  S32x2 kv_seg, S32x1 q_slot, ffi::Result<F32x4> out, int64_t threads) {
  const auto qd = q.dimensions(), kd = keys.dimensions(), vd = values.dimensions();
  const int64_t batch = qd[0], kv_heads = qd[1], groups = qd[2], dim = qd[3];
  const int64_t tiles = kd[2], tile = kd[4], length = vd[2];
  if (kd[0] != batch || kd[1] != kv_heads || kd[3] != dim || vd[0] != batch ||
      vd[1] != kv_heads || vd[3] != dim || tiles * tile < length ||
      kv_seg.dimensions()[0] != batch || kv_seg.dimensions()[1] != length ||
      q_seg.dimensions()[0] != batch || q_slot.dimensions()[0] != batch) {
    return ffi::Error::InvalidArgument("cpu_decode_attention: operand shapes disagree");
  }
  const PairFn fn = Select(groups, dim, tile);
  if (fn == nullptr) {
    return ffi::Error::InvalidArgument(
        "cpu_decode_attention: unsupported groups " + std::to_string(groups) + ", head dim " +
        std::to_string(dim) + " or tile " + std::to_string(tile));
  }
  auto call = std::make_shared<Call>();
  call->q = q.typed_data();
  call->keys = keys.typed_data();
  call->values = values.typed_data();
  call->q_seg = q_seg.typed_data();
  call->kv_seg = kv_seg.typed_data();
  call->q_slot = q_slot.typed_data();
  call->out = out->typed_data();
  call->kv_heads = kv_heads;
  call->tiles = tiles;
  call->length = length;
  call->scale = 1.0f / std::sqrt(static_cast<float>(dim));
  call->pairs = batch * kv_heads;
  const int64_t helpers =
      std::min({threads, static_cast<int64_t>(pool.num_threads()), call->pairs}) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([call, fn] { Drain(*call, fn); });
  Drain(*call, fn);
  // What is left is running on other threads: its pairs end soon.
  while (call->done.load(std::memory_order_acquire) < call->pairs) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlhfCpuDecodeAttention, Attend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32x4>()   // q [b, k, g, d]
                                  .Arg<F32x5>()   // keys [b, k, c, d, i]
                                  .Arg<F32x4>()   // values [b, k, S, d]
                                  .Arg<S32x1>()   // q_seg [b]
                                  .Arg<S32x2>()   // kv_seg [b, S]
                                  .Arg<S32x1>()   // q_slot [b]
                                  .Ret<F32x4>()    // out [b, k, g, d]
                                  .Attr<int64_t>("threads"));
