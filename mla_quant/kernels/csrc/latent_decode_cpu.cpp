// Fused CPU decode attention over a (quantized) paged latent cache: one query token per sequence, every head.
//
// The CPU counterpart of the Triton kernel (latent_decode.py) and the same arithmetic as its PyTorch reference
// (`latent_decode_reference`): every stored token is unpacked from its int32 code words, dequantized with its
// group's scale and zero (or a codebook's level), scored against every head's query and accumulated into the
// output in one pass over the pages, a tile of tokens at a time, with an online softmax. No dequantized copy of
// the cache is written: a thread's workspace is one tile of tokens. Split-KV: each sequence's tokens of each
// segment are cut into chunks (by the sequence's own length) spread over the threads (at::parallel_for); each
// chunk keeps its running max, sum and unnormalised output, and the chunks of a sequence are merged with
// log-sum-exp weights.
//
// Arguments (checked in Python, mla_quant/kernels/layout.py `check_inputs`, before the call):
//   q_latent (B, H, d_c), q_rope (B, H, d_r) float32, contiguous;
//   tensors: per segment, SEG_TENSORS entries: content data, scales, zeros, levels; rope data, scales, zeros,
//     levels; block table (B, max_blocks) int32; lengths (B,) int32 or int64. A path's data is int32 code words
//     (WordLayout: field k of word j holds channel k W + j) or float values (float32, bfloat16, float16), each
//     tensor (num_blocks, block_size, *) with contiguous rows and any block stride. Scales: float32, bfloat16,
//     float16, or int8 exponents (pow2: 2^e). Absent parts are None. The engines' formats: uint8 e4m3 codes (one
//     byte per value) or e2m1 codes (two per byte, the even value in the low nibble) in channel order, a scale per
//     group of `group` values (the last group may be shorter) of a float dtype, int8 pow2 exponents, uint8 E8M0
//     bytes (2^(s - 127)) or uint8 e4m3 bytes, or no scale. A stream: uint8 bytes holding `bits`-bit (3 or 4)
//     indices into the path's codebook (levels), value i at bits [i bits, (i + 1) bits) LSB first, times its
//     group's scale of a float dtype.
//   meta: per segment, SEG_META entries: per path (content, then rope) bits, group, symmetric, codes (0 int32 words
//     or float values, 1 e4m3, 2 e2m1, 3 stream), scale bytes (0 by dtype, 2 E8M0, 3 e4m3; layout.SCALE_KINDS).
// Returns (o_latent (B, H, d_c), lse (B, H)) float32: the output and its log-sum-exp; a sequence with no token
// attends to nothing (zeros, -inf).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kTile = 32;          // tokens decoded and scored together
constexpr int64_t kSegTensors = 10;    // tensors per segment
constexpr int64_t kPathMeta = 5;       // ints per path
constexpr int64_t kSegMeta = 2 * kPathMeta;  // ints per segment
constexpr int64_t kMinChunk = 128;     // fewest tokens per split

enum class Kind { F32, F16, BF16, I8, I32, U8 };
enum Codes { kWords = 0, kE4M3 = 1, kE2M1 = 2, kStream = 3 };  // layout.CODES
enum ScaleBytes { kByDtype = 0, kE8M0 = 2, kScaleE4M3 = 3 };  // layout.SCALE_KINDS

// The float32 value of every e4m3fn byte (sign, 4 exponent bits of bias 7, 3 mantissa bits; m 2^-9 below the normals;
// 0x7F / 0xFF, NaN, are never stored) and of every e2m1 nibble (0, 0.5, 1, 1.5, 2, 3, 4, 6, signed).
struct FloatCodes {
  float e4m3[256];
  float e2m1[16];
  FloatCodes() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.f + m / 8.f, e - 7);
      e4m3[b] = (b & 128) ? -mag : mag;
    }
    const float mags[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
    for (int c = 0; c < 16; ++c) e2m1[c] = (c & 8) ? -mags[c & 7] : mags[c & 7];
  }
};
const FloatCodes kFloatCodes;

Kind kind_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return Kind::F32;
    case at::kHalf: return Kind::F16;
    case at::kBFloat16: return Kind::BF16;
    case at::kChar: return Kind::I8;
    case at::kInt: return Kind::I32;
    case at::kByte: return Kind::U8;
    default: TORCH_CHECK(false, "latent_decode_cpu: unsupported dtype ", t.scalar_type());
  }
}

// n values of kind k at p -> float32 (int8: pow2 exponents, 2^e).
inline void load_floats(const char* p, Kind k, int64_t n, float* out) {
  switch (k) {
    case Kind::F32:
      std::memcpy(out, p, n * sizeof(float));
      break;
    case Kind::F16: {
      const auto* h = reinterpret_cast<const c10::Half*>(p);
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(h[i]);
      break;
    }
    case Kind::BF16: {
      const auto* h = reinterpret_cast<const c10::BFloat16*>(p);
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(h[i]);
      break;
    }
    case Kind::I8: {
      const auto* e = reinterpret_cast<const int8_t*>(p);
      for (int64_t i = 0; i < n; ++i) out[i] = std::exp2(static_cast<float>(e[i]));
      break;
    }
    default:
      TORCH_CHECK(false, "latent_decode_cpu: float values expected");
  }
}

// One path of one segment, as stored.
struct Path {
  const char* data = nullptr;
  int64_t data_stride = 0, row = 0;  // bytes per block, bytes per token
  Kind data_kind = Kind::F32;
  const char* scales = nullptr;
  int64_t sc_stride = 0, sc_row = 0;
  Kind sc_kind = Kind::F32;
  const char* zeros = nullptr;
  int64_t z_stride = 0, z_row = 0;
  Kind z_kind = Kind::F32;
  const float* levels = nullptr;
  int64_t d = 0, bits = 0, group = 1, groups = 1, words = 0;
  bool symmetric = true;
  int64_t codes = kWords, scale_bytes = kByDtype;

  Path(const std::optional<at::Tensor>& data_t, const std::optional<at::Tensor>& scales_t,
       const std::optional<at::Tensor>& zeros_t, const std::optional<at::Tensor>& levels_t, int64_t d_,
       const int64_t* m)
      : d(d_), bits(m[0]), group(m[1]), symmetric(m[2] != 0), codes(m[3]), scale_bytes(m[4]) {
    TORCH_CHECK(data_t.has_value(), "latent_decode_cpu: a path without data");
    const at::Tensor& x = *data_t;
    data = static_cast<const char*>(x.data_ptr());
    data_stride = x.stride(0) * x.element_size();
    row = x.size(2) * x.element_size();
    data_kind = kind_of(x);
    if (codes != kWords) {  // the engines' byte codes
      TORCH_CHECK((codes == kE4M3 && bits == 8) || (codes == kE2M1 && bits == 4) ||
                      (codes == kStream && (bits == 3 || bits == 4)),
                  "latent_decode_cpu: codes=", codes, " with bits=", bits, "; allowed e4m3 (1) at 8, e2m1 (2) at 4, "
                  "stream (3) at 3 or 4");
      if (codes == kStream) {
        TORCH_CHECK(levels_t.has_value() && levels_t->numel() == (int64_t{1} << bits),
                    "latent_decode_cpu: a stream reads a codebook of 2^bits levels");
        levels = levels_t->data_ptr<float>();
      }
      TORCH_CHECK(data_kind == Kind::U8 && x.size(2) == (d * bits + 7) / 8,
                  "latent_decode_cpu: ", (d * bits + 7) / 8, " uint8 code bytes per token expected");
      TORCH_CHECK(group > 0, "latent_decode_cpu: group=", group, " must be positive");
      groups = (d + group - 1) / group;
      if (scales_t.has_value()) {
        const at::Tensor& s = *scales_t;
        scales = static_cast<const char*>(s.data_ptr());
        sc_stride = s.stride(0) * s.element_size();
        sc_row = groups * s.element_size();
        sc_kind = kind_of(s);
        TORCH_CHECK((sc_kind == Kind::U8) == (scale_bytes == kE8M0 || scale_bytes == kScaleE4M3),
                    "latent_decode_cpu: uint8 scales are E8M0 or e4m3 bytes, and those are uint8");
      }
      return;
    }
    if (bits == 0) {
      TORCH_CHECK(x.size(2) == d, "latent_decode_cpu: ", d, " values per token expected, got ", x.size(2));
      return;
    }
    TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "latent_decode_cpu: bits=", bits, "; allowed 0, 2, 4, 8");
    TORCH_CHECK(data_kind == Kind::I32, "latent_decode_cpu: int32 code words expected");
    words = (d + 32 / bits - 1) / (32 / bits);
    TORCH_CHECK(x.size(2) == words, "latent_decode_cpu: ", words, " code words per token expected, got ", x.size(2));
    TORCH_CHECK(group > 0 && d % group == 0, "latent_decode_cpu: group=", group, " must divide d=", d);
    groups = d / group;
    TORCH_CHECK(scales_t.has_value() && (symmetric || zeros_t.has_value()),
                "latent_decode_cpu: an int path needs its scales (and zeros unless symmetric)");
    const at::Tensor& s = *scales_t;
    scales = static_cast<const char*>(s.data_ptr());
    sc_stride = s.stride(0) * s.element_size();
    sc_row = groups * s.element_size();
    sc_kind = kind_of(s);
    if (!symmetric) {
      const at::Tensor& z = *zeros_t;
      zeros = static_cast<const char*>(z.data_ptr());
      z_stride = z.stride(0) * z.element_size();
      z_row = groups * z.element_size();
      z_kind = kind_of(z);
    }
    if (levels_t.has_value()) {
      TORCH_CHECK(levels_t->numel() == (int64_t{1} << bits), "latent_decode_cpu: a codebook of 2^bits levels expected");
      levels = levels_t->data_ptr<float>();
    }
  }

  // A token's words -> its codes (a codebook's levels at them) in channel order: field k of every word is the run of
  // channels k W .. k W + W - 1.
  template <int BITS>
  void unpack(const uint32_t* __restrict__ w, float* __restrict__ out) const {
    constexpr int per = 32 / BITS;
    constexpr uint32_t mask = (1u << BITS) - 1u;
    if (levels == nullptr && words < 8 && per * words == d) {  // a short path (a RoPE key): word by word
      for (int64_t j = 0; j < words; ++j) {
        const uint32_t v = w[j];
        for (int k = 0; k < per; ++k) out[k * words + j] = static_cast<float>((v >> (k * BITS)) & mask);
      }
      return;
    }
    for (int k = 0; k < per; ++k) {
      const int64_t c0 = k * words;
      if (c0 >= d) break;
      const int64_t n = std::min(words, d - c0);
      float* o = out + c0;
      if (levels != nullptr) {
        for (int64_t j = 0; j < n; ++j) o[j] = levels[(w[j] >> (k * BITS)) & mask];
      } else {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) o[j] = static_cast<float>((w[j] >> (k * BITS)) & mask);
      }
    }
  }

  // n uint8 scale bytes (E8M0 or e4m3) or n scales of a float dtype / pow2 exponents at p -> float32.
  void load_scales(const char* p, int64_t n, float* out) const {
    const auto* u = reinterpret_cast<const uint8_t*>(p);
    if (scale_bytes == kE8M0) {
      for (int64_t i = 0; i < n; ++i) out[i] = std::ldexp(1.f, static_cast<int>(u[i]) - 127);
    } else if (scale_bytes == kScaleE4M3) {
      for (int64_t i = 0; i < n; ++i) out[i] = kFloatCodes.e4m3[u[i]];
    } else {
      load_floats(p, sc_kind, n, out);
    }
  }

  // The engines' byte codes of one token -> out[d], each group times its scale (none: unscaled); work: groups floats.
  void decode_bytes(int64_t blk, int64_t slot, float* __restrict__ out, float* __restrict__ work) const {
    const auto* c = reinterpret_cast<const uint8_t*>(data + blk * data_stride + slot * row);
    if (codes == kE4M3) {
      for (int64_t i = 0; i < d; ++i) out[i] = kFloatCodes.e4m3[c[i]];
    } else if (codes == kStream && bits == 4) {  // two per byte, the even value low
      for (int64_t j = 0; j < d / 2; ++j) {
        out[2 * j] = levels[c[j] & 15];
        out[2 * j + 1] = levels[c[j] >> 4];
      }
      if (d % 2) out[d - 1] = levels[c[d / 2] & 15];
    } else if (codes == kStream && d % 8 == 0) {  // 3 bits: eight values in each three bytes
      for (int64_t j = 0; j < d / 8; ++j) {
        const uint32_t v = c[3 * j] | (static_cast<uint32_t>(c[3 * j + 1]) << 8) |
                           (static_cast<uint32_t>(c[3 * j + 2]) << 16);
        float* o = out + 8 * j;
        for (int k = 0; k < 8; ++k) o[k] = levels[(v >> (3 * k)) & 7];
      }
    } else if (codes == kStream) {
      const uint32_t mask = (1u << bits) - 1u;
      for (int64_t i = 0; i < d; ++i) {
        const int64_t bit = i * bits, at = bit >> 3;
        const uint32_t two = c[at] | (at + 1 < row ? static_cast<uint32_t>(c[at + 1]) << 8 : 0u);
        out[i] = levels[(two >> (bit & 7)) & mask];
      }
    } else {
      for (int64_t i = 0; i < d; ++i) out[i] = kFloatCodes.e2m1[(c[i / 2] >> ((i % 2) * 4)) & 15];
    }
    if (scales == nullptr) return;
    load_scales(scales + blk * sc_stride + slot * sc_row, groups, work);
    for (int64_t g = 0; g < groups; ++g) {
      float* o = out + g * group;
      const int64_t n = std::min(group, d - g * group);
      const float sg = work[g];
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] *= sg;
    }
  }

  // The token in slot `slot` of block `blk` -> out[d] float32; work: 2 * groups floats.
  void decode(int64_t blk, int64_t slot, float* __restrict__ out, float* __restrict__ work) const {
    if (codes != kWords) {
      decode_bytes(blk, slot, out, work);
      return;
    }
    if (bits == 0) {
      load_floats(data + blk * data_stride + slot * row, data_kind, d, out);
      return;
    }
    const auto* w = reinterpret_cast<const uint32_t*>(data + blk * data_stride + slot * row);
    switch (bits) {
      case 2: unpack<2>(w, out); break;
      case 4: unpack<4>(w, out); break;
      default: unpack<8>(w, out); break;
    }
    float* s = work;
    float* z = work + groups;
    load_floats(scales + blk * sc_stride + slot * sc_row, sc_kind, groups, s);
    if (symmetric) {
      const float half = static_cast<float>(1 << (bits - 1));
      for (int64_t g = 0; g < groups; ++g) z[g] = -half * s[g];
    } else {
      load_floats(zeros + blk * z_stride + slot * z_row, z_kind, groups, z);
    }
    for (int64_t g = 0; g < groups; ++g) {
      float* o = out + g * group;
      const float sg = s[g], zg = z[g];
#pragma omp simd
      for (int64_t i = 0; i < group; ++i) o[i] = o[i] * sg + zg;
    }
  }
};

struct Seg {
  Path content, rope;
  const int32_t* table;
  int64_t table_row, block_size;
  std::vector<int64_t> lengths;
};

struct Item {  // a chunk of one sequence's tokens in one segment
  int64_t b, seg, t0, t1;
};

// Eight floats: GCC / Clang vector extensions, compiled to one AVX register with -mavx2 (two SSE registers, or
// NEON, otherwise). Loads and stores through memcpy: no alignment assumed.
typedef float V8 __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;

inline V8 load8(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof(V8));
  return v;
}

inline void store8(float* p, V8 v) { std::memcpy(p, &v, sizeof(V8)); }

inline float hsum(V8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// out[h][i] += q[h] . x[i] for HB heads (q rows of stride d) and the tile's n tokens (x rows of stride d).
template <int HB>
void scores(const float* __restrict__ q, const float* __restrict__ x, int64_t n, int64_t d,
            float* __restrict__ out, int64_t out_stride) {
  const int64_t dv = d / kLanes * kLanes;
  int64_t i = 0;
  for (; i + 2 <= n; i += 2) {  // two tokens against HB heads: 2 + HB loads per 2 HB multiply-adds
    V8 a0[HB] = {}, a1[HB] = {};
    const float* x0 = x + i * d;
    const float* x1 = x0 + d;
    for (int64_t c = 0; c < dv; c += kLanes) {
      const V8 v0 = load8(x0 + c), v1 = load8(x1 + c);
      for (int hh = 0; hh < HB; ++hh) {
        const V8 qv = load8(q + hh * d + c);
        a0[hh] += qv * v0;
        a1[hh] += qv * v1;
      }
    }
    for (int hh = 0; hh < HB; ++hh) {
      float s0 = hsum(a0[hh]), s1 = hsum(a1[hh]);
      for (int64_t c = dv; c < d; ++c) {
        s0 += q[hh * d + c] * x0[c];
        s1 += q[hh * d + c] * x1[c];
      }
      out[hh * out_stride + i] += s0;
      out[hh * out_stride + i + 1] += s1;
    }
  }
  for (; i < n; ++i) {
    V8 a0[HB] = {};
    const float* x0 = x + i * d;
    for (int64_t c = 0; c < dv; c += kLanes) {
      const V8 v0 = load8(x0 + c);
      for (int hh = 0; hh < HB; ++hh) a0[hh] += load8(q + hh * d + c) * v0;
    }
    for (int hh = 0; hh < HB; ++hh) {
      float s0 = hsum(a0[hh]);
      for (int64_t c = dv; c < d; ++c) s0 += q[hh * d + c] * x0[c];
      out[hh * out_stride + i] += s0;
    }
  }
}

// acc[h] += sum_i p[h][i] x[i] for HB heads (acc rows of stride d, p rows of stride p_stride), n tokens.
template <int HB>
void values(const float* __restrict__ p, int64_t p_stride, const float* __restrict__ x, int64_t n, int64_t d,
            float* __restrict__ acc) {
  const int64_t dv2 = d / (2 * kLanes) * (2 * kLanes);
  int64_t c = 0;
  for (; c < dv2; c += 2 * kLanes) {  // 16 channels of HB heads in registers over the tile's tokens
    V8 a0[HB], a1[HB];
    for (int hh = 0; hh < HB; ++hh) {
      a0[hh] = load8(acc + hh * d + c);
      a1[hh] = load8(acc + hh * d + c + kLanes);
    }
    for (int64_t i = 0; i < n; ++i) {
      const V8 v0 = load8(x + i * d + c), v1 = load8(x + i * d + c + kLanes);
      for (int hh = 0; hh < HB; ++hh) {
        const float w = p[hh * p_stride + i];
        a0[hh] += w * v0;
        a1[hh] += w * v1;
      }
    }
    for (int hh = 0; hh < HB; ++hh) {
      store8(acc + hh * d + c, a0[hh]);
      store8(acc + hh * d + c + kLanes, a1[hh]);
    }
  }
  for (int hh = 0; hh < HB; ++hh)
    for (int64_t i = 0; i < n; ++i) {
      const float w = p[hh * p_stride + i];
      for (int64_t cc = c; cc < d; ++cc) acc[hh * d + cc] += w * x[i * d + cc];
    }
}

constexpr int kHeadBlock = 4;

// Every head, blocks of kHeadBlock then one at a time: f(block size as a compile-time constant, first head).
template <typename F>
void over_heads(int64_t H, F f) {
  int64_t h = 0;
  for (; h + kHeadBlock <= H; h += kHeadBlock) f(std::integral_constant<int, kHeadBlock>{}, h);
  for (; h < H; ++h) f(std::integral_constant<int, 1>{}, h);
}

std::tuple<at::Tensor, at::Tensor> latent_decode_cpu(const at::Tensor& q_latent, const at::Tensor& q_rope,
                                                     double scale_,
                                                     const std::vector<std::optional<at::Tensor>>& tensors,
                                                     at::IntArrayRef meta) {
  TORCH_CHECK(q_latent.dim() == 3 && q_rope.dim() == 3, "latent_decode_cpu: q_latent (B, H, d_c) and q_rope "
              "(B, H, d_r) expected");
  TORCH_CHECK(q_latent.scalar_type() == at::kFloat && q_rope.scalar_type() == at::kFloat &&
                  q_latent.is_contiguous() && q_rope.is_contiguous(),
              "latent_decode_cpu: contiguous float32 queries expected");
  const int64_t n_seg = static_cast<int64_t>(tensors.size()) / kSegTensors;
  TORCH_CHECK(static_cast<int64_t>(tensors.size()) == n_seg * kSegTensors &&
                  static_cast<int64_t>(meta.size()) == n_seg * kSegMeta,
              "latent_decode_cpu: ", kSegTensors, " tensors and ", kSegMeta, " ints per segment expected, got ",
              tensors.size(), " and ", meta.size());
  const int64_t B = q_latent.size(0), H = q_latent.size(1), dc = q_latent.size(2), dr = q_rope.size(2);
  const float scale = static_cast<float>(scale_);

  std::vector<Seg> segs;
  segs.reserve(n_seg);
  for (int64_t i = 0; i < n_seg; ++i) {
    const auto* t = tensors.data() + i * kSegTensors;
    const int64_t* m = meta.data() + i * kSegMeta;
    const at::Tensor& table = *t[8];
    const at::Tensor& lengths = *t[9];
    TORCH_CHECK(table.scalar_type() == at::kInt && table.is_contiguous() && table.dim() == 2 && table.size(0) == B,
                "latent_decode_cpu: segments[", i, "].block_table: contiguous int32 (B, max_blocks) expected");
    Seg s{Path(t[0], t[1], t[2], t[3], dc, m), Path(t[4], t[5], t[6], t[7], dr, m + kPathMeta),
          table.data_ptr<int32_t>(), table.size(1), t[0]->size(1), {}};
    const at::Tensor len64 = lengths.to(at::kLong).contiguous();
    const int64_t* lp = len64.data_ptr<int64_t>();
    const int64_t capacity = s.table_row * s.block_size;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t n = std::max<int64_t>(0, std::min(lp[b], capacity));
      s.lengths.push_back(n);
    }
    segs.push_back(std::move(s));
  }

  // Split-KV: each sequence's tokens in chunks of at least kMinChunk tokens, about four per thread. The chunks of a
  // sequence depend on its own tokens only, so its result does not depend on the rest of the batch.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  std::vector<Item> items;
  std::vector<int64_t> first_item(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    first_item[b] = static_cast<int64_t>(items.size());
    int64_t tokens = 0;
    for (const auto& s : segs) tokens += s.lengths[b];
    int64_t chunk = std::max<int64_t>(kMinChunk, (tokens + 4 * threads - 1) / (4 * threads));
    chunk = (chunk + kTile - 1) / kTile * kTile;
    for (int64_t i = 0; i < n_seg; ++i)
      for (int64_t t0 = 0; t0 < segs[i].lengths[b]; t0 += chunk)
        items.push_back({b, i, t0, std::min(t0 + chunk, segs[i].lengths[b])});
  }
  first_item[B] = static_cast<int64_t>(items.size());
  const int64_t n_items = first_item[B];
  const int64_t part = H * (dc + 2);  // per item: max (H), sum (H), output (H, d_c)
  std::vector<float> parts(static_cast<size_t>(n_items * part));

  const float* q = q_latent.data_ptr<float>();
  const float* qr = q_rope.data_ptr<float>();
  int64_t max_groups = 1;
  for (const auto& s : segs) max_groups = std::max({max_groups, s.content.groups, s.rope.groups});

  at::parallel_for(0, n_items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> cbuf(kTile * dc), rbuf(kTile * dr), sbuf(H * kTile), work(2 * max_groups);
    for (int64_t it = begin; it < end; ++it) {
      const Item& item = items[it];
      const Seg& s = segs[item.seg];
      float* m = parts.data() + it * part;
      float* l = m + H;
      float* acc = l + H;
      std::fill(m, m + H, -std::numeric_limits<float>::infinity());
      std::fill(l, l + H + H * dc, 0.f);
      const float* qb = q + item.b * H * dc;
      const float* qrb = qr + item.b * H * dr;
      const int32_t* table = s.table + item.b * s.table_row;
      for (int64_t t = item.t0; t < item.t1; t += kTile) {
        const int64_t n = std::min(kTile, item.t1 - t);
        for (int64_t i = 0; i < n; ++i) {
          const int64_t token = t + i;
          const int64_t blk = table[token / s.block_size], slot = token % s.block_size;
          s.content.decode(blk, slot, cbuf.data() + i * dc, work.data());
          s.rope.decode(blk, slot, rbuf.data() + i * dr, work.data());
        }
        std::fill(sbuf.begin(), sbuf.end(), 0.f);
        over_heads(H, [&](auto hb, int64_t h) {
          scores<decltype(hb)::value>(qb + h * dc, cbuf.data(), n, dc, sbuf.data() + h * kTile, kTile);
          scores<decltype(hb)::value>(qrb + h * dr, rbuf.data(), n, dr, sbuf.data() + h * kTile, kTile);
        });
        for (int64_t h = 0; h < H; ++h) {  // the online softmax: scores -> weights under the running max
          float* sc = sbuf.data() + h * kTile;
          float top = -std::numeric_limits<float>::infinity();
          for (int64_t i = 0; i < n; ++i) {
            sc[i] *= scale;
            top = std::max(top, sc[i]);
          }
          const float m_new = std::max(m[h], top);
          if (m_new > m[h] && l[h] > 0.f) {  // rescale what was accumulated under the old max
            const float alpha = std::exp(m[h] - m_new);
            l[h] *= alpha;
            float* a = acc + h * dc;
            for (int64_t c = 0; c < dc; ++c) a[c] *= alpha;
          }
          m[h] = m_new;
          float sum = 0.f;
          for (int64_t i = 0; i < n; ++i) {
            sc[i] = std::exp(sc[i] - m_new);
            sum += sc[i];
          }
          l[h] += sum;
        }
        over_heads(H, [&](auto hb, int64_t h) {
          values<decltype(hb)::value>(sbuf.data() + h * kTile, kTile, cbuf.data(), n, dc, acc + h * dc);
        });
      }
    }
  });

  at::Tensor out = at::zeros({B, H, dc}, q_latent.options());
  at::Tensor lse = at::full({B, H}, -std::numeric_limits<float>::infinity(), q_latent.options());
  float* o = out.data_ptr<float>();
  float* lo = lse.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t it = first_item[b]; it < first_item[b + 1]; ++it) top = std::max(top, parts[it * part + h]);
        if (top == -std::numeric_limits<float>::infinity()) continue;  // no token: zeros
        float total_l = 0.f;
        float* ob = o + (b * H + h) * dc;
        for (int64_t it = first_item[b]; it < first_item[b + 1]; ++it) {
          const float* m = parts.data() + it * part;
          const float w = std::exp(m[h] - top);
          total_l += m[H + h] * w;
          const float* a = m + 2 * H + h * dc;
          for (int64_t c = 0; c < dc; ++c) ob[c] += w * a[c];
        }
        const float inv = 1.f / total_l;
        for (int64_t c = 0; c < dc; ++c) ob[c] *= inv;
        lo[b * H + h] = top + std::log(total_l);
      }
    }
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(mla_quant_cpu, m) {
  m.def("latent_decode(Tensor q_latent, Tensor q_rope, float scale, Tensor?[] tensors, int[] meta) -> "
        "(Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mla_quant_cpu, CPU, m) { m.impl("latent_decode", &latent_decode_cpu); }
