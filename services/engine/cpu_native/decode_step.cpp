// One CPU decode step of a plain Llama-family model in one call (services/engine/cpu_native.py
// builds and loads this file; services/engine/cpu_decode.py is the torch path it mirrors).
//
// Every row of the step is one sequence's new token. Per layer: RMSNorm -> bf16, the qkv int4 /
// int8 matmul (ATen's kernels), neox rotary of q and k, the new k / v written into the paged
// cache, attention of each row over its cached tokens read in place through its block table,
// o_proj and the residual add, RMSNorm -> bf16, gate_up, SiLU-and-mul -> bf16, down and the
// residual add; then the final norm and the LM head. The small ops are plain loops on the
// calling thread (no OpenMP wake-up for a 576-float norm); only the matmuls, and the attention of
// long sequences, use the thread pool. Numerics follow the torch path op for op (float32
// residual, bf16 between the linears, float32 rotary and attention, FMA contraction off): the
// differences are the summation orders of the norm and the attention, and exp's last bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using at::Tensor;
using bf16 = c10::BFloat16;
constexpr int64_t kLanes = 16;

// Sum of kLanes partial sums as a tree (log2 dependent adds, not kLanes).
inline float fold(float* acc) {
  for (int64_t w = kLanes / 2; w > 0; w /= 2)
    for (int64_t j = 0; j < w; ++j) acc[j] += acc[j + w];
  return acc[0];
}

// Sum of squares with kLanes independent partial sums (vectorizes without reassociation).
inline float sum_squares(const float* x, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += x[i + j] * x[i + j];
  float s = 0.f;
  for (; i < n; ++i) s += x[i] * x[i];
  return fold(acc) + s;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += a[i + j] * b[i + j];
  return fold(acc) + [&] {
    float s = 0.f;
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
  }();
}

// e^x of n floats in place, Cephes' expf (range reduction by ln 2, degree-6 polynomial; within
// 2 ulp of libm's) written without branches or calls so that the loop vectorizes.
void exp_inplace(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::min(std::max(x[i], -87.3f), 88.3f);
    const float k = __builtin_rintf(v * 1.44269504088896341f);
    const float r = (v - k * 0.693359375f) - k * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * (r * r) + r + 1.f;
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(k) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    x[i] = y * scale;
  }
}

// float -> bf16, round to nearest even (NaN kept a NaN): c10::BFloat16's rounding, branchless.
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(f != f ? 0x7FC0u : rounded);
}

void to_bf16(const float* x, bf16* out, int64_t n) {
  auto* o = reinterpret_cast<uint16_t*>(out);
  for (int64_t i = 0; i < n; ++i) o[i] = bf16_bits(x[i]);
}

// rows of x [T, H] float32 -> out [T, H] bf16: x * rsqrt(mean(x^2) + eps) * w.
void rms_norm_bf16(const Tensor& x, const Tensor& w, double eps, Tensor& out) {
  const int64_t t = x.size(0), h = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  bf16* op = out.data_ptr<bf16>();
  for (int64_t r = 0; r < t; ++r) {
    const float* xr = xp + r * h;
    const float rstd = 1.f / std::sqrt(sum_squares(xr, h) / static_cast<float>(h) +
                                       static_cast<float>(eps));
    auto* o = reinterpret_cast<uint16_t*>(op + r * h);
    for (int64_t i = 0; i < h; ++i) o[i] = bf16_bits(xr[i] * rstd * wp[i]);
  }
}

Tensor linear(const Tensor& x, const Tensor& w, const Tensor& s, int64_t group_size) {
  if (w.scalar_type() == at::kByte) return at::_weight_int4pack_mm_for_cpu(x, w, group_size, s);
  return at::_weight_int8pack_mm(x, w, s);
}

// residual [T, H] float32 += y [T, H] bf16
void add_bf16(Tensor& residual, const Tensor& y) {
  float* rp = residual.data_ptr<float>();
  const bf16* yp = y.data_ptr<bf16>();
  const int64_t n = residual.numel();
  for (int64_t i = 0; i < n; ++i) rp[i] += static_cast<float>(yp[i]);
}

struct Shape {
  int64_t hq, hk, d, block_size;
  float scale;
};

// One row's attention for kv heads [h0, h1) (each with its Hq / Hk query heads) over its `len`
// cached tokens, walked block by block through `table`; q [Hq, D] float32 (rotated), out
// [Hq, D] bf16. scores: [Hq / Hk, len] scratch.
void attend(const float* q, const float* kc, const float* vc, const int32_t* table, int64_t len,
            const Shape& s, int64_t h0, int64_t h1, std::vector<float>& scores, bf16* out) {
  const int64_t group = s.hq / s.hk, d = s.d, row = s.hk * d, bs = s.block_size;
  const int64_t blocks = (len + bs - 1) / bs;
  scores.resize(static_cast<size_t>(group * len));
  std::vector<float> acc(static_cast<size_t>(d));
  for (int64_t h = h0; h < h1; ++h) {
    const float* qh = q + h * group * d;
    for (int64_t b = 0, j = 0; b < blocks; ++b) {  // scores: each key row read once
      const float* kb = kc + static_cast<int64_t>(table[b]) * bs * row + h * d;
      for (int64_t jj = 0; jj < bs && j < len; ++jj, ++j) {
        for (int64_t g = 0; g < group; ++g) {
          scores[g * len + j] = dot(qh + g * d, kb + jj * row, d) * s.scale;
        }
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      float* sc = scores.data() + g * len;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < len; ++j) top = std::max(top, sc[j]);
      for (int64_t j = 0; j < len; ++j) sc[j] -= top;
      exp_inplace(sc, len);
      float total = 0.f;
      for (int64_t j = 0; j < len; ++j) total += sc[j];
      for (int64_t j = 0; j < len; ++j) sc[j] /= total;
    }
    for (int64_t g = 0; g < group; ++g) {
      const float* sc = scores.data() + g * len;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0, j = 0; b < blocks; ++b) {
        const float* vb = vc + static_cast<int64_t>(table[b]) * bs * row + h * d;
        for (int64_t jj = 0; jj < bs && j < len; ++jj, ++j) {
          const float p = sc[j];
          const float* vr = vb + jj * row;
          for (int64_t i = 0; i < d; ++i) acc[i] += p * vr[i];
        }
      }
      to_bf16(acc.data(), out + (h * group + g) * d, d);
    }
  }
}

// qkv [T, (Hq + 2 Hk) D] bf16 -> rotated q [T, Hq, D] float32; rotated k and v written at each
// row's slot of the caches [blocks, bs, Hk, D] float32; attention -> out [T, Hq * D] bf16.
void attention(const Tensor& qkv, const Tensor& cos_sin, const int64_t* positions,
               const int64_t* slots, const Tensor& block_tables, const int32_t* seq_lens,
               Tensor& k_cache, Tensor& v_cache, const Shape& s, Tensor& q_buf, Tensor& out) {
  const int64_t t = qkv.size(0), hq = s.hq, hk = s.hk, d = s.d, half = d / 2;
  const int64_t width = qkv.size(1);
  const bf16* qkvp = qkv.data_ptr<bf16>();
  const float* table = cos_sin.data_ptr<float>();
  float* qp = q_buf.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  for (int64_t r = 0; r < t; ++r) {
    const float* cs = table + positions[r] * d;  // cos [D / 2] then sin [D / 2]
    const bf16* src = qkvp + r * width;
    const int64_t slot = slots[r];
    for (int64_t head = 0; head < hq + hk; ++head) {
      const bf16* x = src + head * d;
      float* dst = head < hq ? qp + (r * hq + head) * d
                             : (slot >= 0 ? kc + (slot * hk + head - hq) * d : nullptr);
      if (dst == nullptr) continue;
      for (int64_t i = 0; i < half; ++i) {
        const float x0 = static_cast<float>(x[i]), x1 = static_cast<float>(x[i + half]);
        const float c = cs[i], sn = cs[half + i];
        dst[i] = x0 * c + x1 * -sn;
        dst[i + half] = x1 * c + x0 * sn;
      }
    }
    if (slot >= 0) {
      const bf16* v = src + (hq + hk) * d;
      float* vd = vc + slot * hk * d;
      for (int64_t i = 0; i < hk * d; ++i) vd[i] = static_cast<float>(v[i]);
    }
  }
  const int64_t cols = block_tables.size(1);
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  bf16* op = out.data_ptr<bf16>();
  int64_t keys = 0;
  for (int64_t r = 0; r < t; ++r) keys += seq_lens[r];
  // work items: (row, kv head); one thread below ~8k key-head dot products (an OpenMP
  // wake-up costs more than it saves there)
  const int64_t items = t * hk;
  const int64_t grain = keys * hq < 8192 ? items : 1;
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    const int64_t group = hq / hk;
    for (int64_t it = begin; it < end;) {
      const int64_t r = it / hk, h0 = it % hk, h1 = std::min(hk, h0 + (end - it));
      bf16* o = op + r * hq * d;
      if (slots[r] >= 0 && seq_lens[r] > 0) {
        attend(qp + r * hq * d, kc, vc, bt + r * cols, seq_lens[r], s, h0, h1, scores, o);
      } else {
        std::fill(o + h0 * group * d, o + h1 * group * d, bf16(0.f));
      }
      it += h1 - h0;
    }
  });
}

// SiLU(gate) * up of gate_up [T, 2I] bf16 -> [T, I] bf16 (float32 math).
Tensor silu_mul(const Tensor& gate_up) {
  const int64_t t = gate_up.size(0), inner = gate_up.size(1) / 2;
  Tensor out = at::empty({t, inner}, gate_up.options());
  const bf16* gp = gate_up.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  std::vector<float> e(static_cast<size_t>(inner));
  for (int64_t r = 0; r < t; ++r) {
    const bf16* g = gp + r * 2 * inner;
    for (int64_t i = 0; i < inner; ++i) e[i] = -static_cast<float>(g[i]);
    exp_inplace(e.data(), inner);
    for (int64_t i = 0; i < inner; ++i) {
      const float x = static_cast<float>(g[i]);
      e[i] = x / (1.f + e[i]) * static_cast<float>(g[inner + i]);
    }
    to_bf16(e.data(), op + r * inner, inner);
  }
  return out;
}

// weights: per layer [attn_norm, mlp_norm, qkv_w, qkv_s, o_w, o_s, gate_up_w, gate_up_s,
// down_w, down_s]; caches: per layer [k_cache, v_cache]; head: [final_norm, head_w, head_s].
Tensor decode_step(const Tensor& input_ids, const Tensor& positions, const Tensor& slot_mapping,
                   const Tensor& block_tables, const Tensor& seq_lens, const Tensor& embed,
                   const Tensor& cos_sin, at::TensorList weights, at::TensorList caches,
                   at::TensorList head, double eps, double scale, int64_t hq, int64_t hk,
                   int64_t group_size) {
  TORCH_CHECK(weights.size() % 10 == 0 && caches.size() * 5 == weights.size() && head.size() == 3,
              "decode_step: 10 weights and 2 caches a layer, 3 head tensors");
  const int64_t t = input_ids.size(0), hidden = embed.size(1);
  const int64_t layers = static_cast<int64_t>(caches.size() / 2);
  const int64_t d = cos_sin.size(1);
  const Shape shape{hq, hk, d, caches[0].size(1), static_cast<float>(scale)};
  for (const Tensor* x : {&input_ids, &positions, &slot_mapping}) {
    TORCH_CHECK(x->scalar_type() == at::kLong && x->is_contiguous() && x->size(0) == t);
  }
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
              block_tables.size(0) == t && seq_lens.scalar_type() == at::kInt &&
              seq_lens.is_contiguous() && seq_lens.size(0) == t);
  for (const Tensor& c : caches) {
    TORCH_CHECK(c.scalar_type() == at::kFloat && c.is_contiguous() && c.size(2) == hk &&
                c.size(3) == d, "decode_step: float32 caches [blocks, bs, Hk, D]");
  }
  const int64_t* ids = input_ids.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  Tensor residual = at::empty({t, hidden}, embed.options());
  float* res = residual.data_ptr<float>();
  const float* emb = embed.data_ptr<float>();
  for (int64_t r = 0; r < t; ++r) {
    TORCH_CHECK(ids[r] >= 0 && ids[r] < embed.size(0), "decode_step: token id out of range");
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos_sin.size(0), "decode_step: position out of range");
    std::copy(emb + ids[r] * hidden, emb + (ids[r] + 1) * hidden, res + r * hidden);
  }
  const auto bf16_options = embed.options().dtype(at::kBFloat16);
  Tensor x = at::empty({t, hidden}, bf16_options);
  Tensor q_buf = at::empty({t, hq * d}, embed.options());
  Tensor attn_out = at::empty({t, hq * d}, bf16_options);
  for (int64_t l = 0; l < layers; ++l) {
    const Tensor* w = &weights[static_cast<size_t>(l * 10)];
    Tensor k_cache = caches[static_cast<size_t>(2 * l)];
    Tensor v_cache = caches[static_cast<size_t>(2 * l + 1)];
    rms_norm_bf16(residual, w[0], eps, x);
    Tensor qkv = linear(x, w[2], w[3], group_size);
    attention(qkv, cos_sin, pos, slots, block_tables, lens, k_cache, v_cache, shape, q_buf,
              attn_out);
    add_bf16(residual, linear(attn_out, w[4], w[5], group_size));
    rms_norm_bf16(residual, w[1], eps, x);
    Tensor act = silu_mul(linear(x, w[6], w[7], group_size));
    add_bf16(residual, linear(act, w[8], w[9], group_size));
  }
  rms_norm_bf16(residual, head[0], eps, x);
  return linear(x, head[1], head[2], group_size).to(at::kFloat);
}

}  // namespace

TORCH_LIBRARY(flotilla_cpu_decode, m) {
  m.def(
      "decode_step(Tensor input_ids, Tensor positions, Tensor slot_mapping, Tensor block_tables, "
      "Tensor seq_lens, Tensor embed, Tensor cos_sin, Tensor[] weights, Tensor(a!)[] caches, "
      "Tensor[] head, float eps, float scale, int hq, int hk, int group_size) -> Tensor");
  m.impl("decode_step", c10::DispatchKey::CPU, TORCH_FN(decode_step));
}
