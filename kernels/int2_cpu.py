"""A tiered decode step on CPU that reads the INT2 windows from their packed codes: a C++ extension.

The PyTorch path of a tiered decode step expands every active INT2 window to float32 (unpack the
2-bit codes through a lookup table, then apply the grid) before its matrix products: several
passes over half the context's entries at budget 0.1, and a dozen small tensor operations a layer
(docs/tiered_decode.md). ``tiered_decode`` does one sequence's step in one call: the FP body and
tail and the INT2 windows in one float32 softmax per query head, each window's codes read once
(``q . (code * scale + zero) = (q * scale) . code + q . zero``; a value's per-token grid folds
into its weight). It returns the FP and INT2 shares of the output apart, the latter in the
values' quantization basis.

It is the CPU counterpart of the Triton mixed-tier kernel, compiled on first use with
``torch.utils.cpp_extension.load_inline`` (a C++ compiler and ninja; about 25 s here, then cached
by torch on disk) and checked against the PyTorch path (``tests/cache/test_tiered_decode.py``) and a brute-force
softmax (``tests/kernels/test_int2_cpu.py``).
Where it cannot be built, ``load`` raises ``CpuKernelUnavailable`` with the reason and the runtime
keeps the PyTorch path (``vlm_kv.attention.backend.AttentionPaths.cpu_int2_decode``).
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import threading
from functools import lru_cache

import torch

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__) && !defined(VLM_KV_SCALAR)
#define VLM_KV_AVX512 1
#include <immintrin.h>
#endif
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

void check(const torch::Tensor& t, torch::ScalarType dtype, int64_t dim, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == dtype, name, " has the wrong dtype");
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dims");
}

// first window of each KV head, from the windows per head (they are grouped by head, in order)
std::vector<int64_t> head_starts(const torch::Tensor& head_windows, int64_t n) {
  check(head_windows, torch::kLong, 1, "head_windows");
  const int64_t H = head_windows.size(0);
  const int64_t* hw = head_windows.data_ptr<int64_t>();
  std::vector<int64_t> start(H + 1, 0);
  for (int64_t h = 0; h < H; ++h) {
    TORCH_CHECK(hw[h] >= 0, "head_windows must be >= 0");
    start[h + 1] = start[h] + hw[h];
  }
  TORCH_CHECK(start[H] == n, "head_windows sum to ", start[H], " but there are ", n, " windows");
  return start;
}

// the four 2-bit codes of every byte as floats: unpacking is then a copy the compiler vectorizes
struct CodeTable {
  float v[256][4];
  CodeTable() {
    for (int b = 0; b < 256; ++b)
      for (int i = 0; i < 4; ++i) v[b][i] = static_cast<float>((b >> (2 * i)) & 3);
  }
};
const CodeTable& codes_as_floats() {
  static const CodeTable table;
  return table;
}

// Codes unpack in "plane" order when the row's bytes come in chunks of 16 (head_dim a multiple of
// 64): chunk c's plane i holds channel 64c + 4k + i at place 64c + 16i + k, which is what shifting
// 16 bytes at once gives (one vector instruction per plane). Dots and sums do not care about the
// order as long as the query, the grid and the accumulators use the same one (``place``).
inline int64_t place(int64_t ch, bool planes) {
  return planes ? (ch / 64) * 64 + (ch % 4) * 16 + (ch % 64) / 4 : ch;
}

inline void unpack(const uint8_t* __restrict__ row, int64_t D4, float* __restrict__ out, bool planes) {
  if (planes) {
    for (int64_t c = 0; c < D4; c += 16) {
#ifdef VLM_KV_AVX512
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c)));
      const __m512i three = _mm512_set1_epi32(3);
      float* o = out + 4 * c;
      _mm512_storeu_ps(o, _mm512_cvtepi32_ps(_mm512_and_si512(b, three)));
      _mm512_storeu_ps(o + 16, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(b, 2), three)));
      _mm512_storeu_ps(o + 32, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(b, 4), three)));
      _mm512_storeu_ps(o + 48, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(b, 6), three)));
#else
      for (int64_t i = 0; i < 4; ++i)
        for (int64_t k = 0; k < 16; ++k) out[4 * c + 16 * i + k] = static_cast<float>((row[c + k] >> (2 * i)) & 3);
#endif
    }
    return;
  }
  const CodeTable& t = codes_as_floats();
  for (int64_t b = 0; b < D4; ++b) {
    const float* f = t.v[row[b]];
    out[4 * b] = f[0];
    out[4 * b + 1] = f[1];
    out[4 * b + 2] = f[2];
    out[4 * b + 3] = f[3];
  }
}

int64_t head_of(const std::vector<int64_t>& start, int64_t j) {
  return std::upper_bound(start.begin(), start.end(), j) - start.begin() - 1;
}

#ifdef VLM_KV_AVX512
// e^x of 16 floats: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^7 (the
// remainder is below 6e-9 relatively), times 2^n. Lanes below -87 (where e^x is under float's
// normal range) give exactly 0, so a hole's -inf weighs nothing, as with std::exp.
inline __m512 exp16(__m512 x) {
  const __m512 floor_x = _mm512_set1_ps(-87.0f);
  const __mmask16 live = _mm512_cmp_ps_mask(x, floor_x, _CMP_GE_OQ);
  x = _mm512_max_ps(x, floor_x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // ln 2 in two parts, so that n * ln2_hi is exact for |n| < 2^11
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 poly = _mm512_set1_ps(1.0f / 5040.0f);
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f / 720.0f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f / 120.0f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f / 24.0f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f / 6.0f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(0.5f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f));
  poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(live, poly, n);
}

// the 8 horizontal sums of v[0..7], in order
inline __m256 sum8(const __m512* v) {
  // within each 128-bit lane: pairs, then quads; then across the four lanes
  const __m512 a0 = _mm512_add_ps(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));
  const __m512 a1 = _mm512_add_ps(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));
  const __m512 a2 = _mm512_add_ps(_mm512_unpacklo_ps(v[4], v[5]), _mm512_unpackhi_ps(v[4], v[5]));
  const __m512 a3 = _mm512_add_ps(_mm512_unpacklo_ps(v[6], v[7]), _mm512_unpackhi_ps(v[6], v[7]));
  // a0 lanes (per 128 bits): v0 even, v1 even, v0 odd, v1 odd partial sums
  const __m512 b0 = _mm512_add_ps(_mm512_shuffle_ps(a0, a1, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_ps(a0, a1, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 b1 = _mm512_add_ps(_mm512_shuffle_ps(a2, a3, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_ps(a2, a3, _MM_SHUFFLE(3, 2, 3, 2)));
  // b0: each 128-bit lane holds a quarter-sum of v0..v3; b1 of v4..v7
  const __m512 c = _mm512_add_ps(_mm512_shuffle_f32x4(b0, b1, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_f32x4(b0, b1, _MM_SHUFFLE(3, 2, 3, 2)));
  // c lanes: [v0..3 half, v0..3 other half, v4..7 half, v4..7 other half]
  const __m512 d = _mm512_add_ps(c, _mm512_shuffle_f32x4(c, c, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps256(_mm512_shuffle_f32x4(d, d, _MM_SHUFFLE(3, 1, 2, 0)));
}
#endif

// softmax of x[0..L) in place, float32; a row with nothing visible (all -inf) becomes all 0
void softmax_in_place(float* x, int64_t L) {
  const float ninf = -std::numeric_limits<float>::infinity();
  float mx = ninf;
  for (int64_t e = 0; e < L; ++e) mx = std::max(mx, x[e]);
  if (mx == ninf) {
    std::fill(x, x + L, 0.f);
    return;
  }
  float sum = 0.f;
  int64_t e = 0;
#ifdef VLM_KV_AVX512
  // std::exp one lane at a time was about a fifth of a call at 8192 tokens (docs/tiered_decode.md)
  const __m512 m = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (; e + 16 <= L; e += 16) {
    const __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + e), m));
    _mm512_storeu_ps(x + e, p);
    acc = _mm512_add_ps(acc, p);
  }
  if (e < L) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (L - e)) - 1u);
    const __m512 p = exp16(_mm512_sub_ps(_mm512_mask_loadu_ps(m, tail, x + e), m));
    _mm512_mask_storeu_ps(x + e, tail, p);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(tail, p));
    e = L;
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; e < L; ++e) {
    x[e] = std::exp(x[e] - mx);
    sum += x[e];
  }
  const float inv = 1.f / sum;  // >= 1: the maximum's own term is 1
  for (e = 0; e < L; ++e) x[e] *= inv;
}

}  // namespace

// One decode step of one sequence over its FP entries (a body laid out by KV head, then a dense
// tail) and its INT2 windows (grouped by KV head), in one float32 softmax per query head.
// Returns [2, Hq, D]: the FP entries' share of the output and the INT2 windows' share, the latter
// still in the values' quantization basis (the caller rotates it back).
// The keys' grid is read as stored: fp16 scale and zero [n, D], or the compact grid's uint8 codes
// [n, D] with fp16 references [n, 3] (zero = z_lo + zero_code * z_step, scale = scale_code * s_step,
// as kernels/int2.py decodes it); the values' grid is fp16 [n, w].
torch::Tensor tiered_decode(torch::Tensor query, torch::Tensor rotated_query, torch::Tensor body_keys,
                            torch::Tensor body_values, torch::Tensor body_lengths, torch::Tensor tail_keys,
                            torch::Tensor tail_values, torch::Tensor tail_valid, torch::Tensor key_codes,
                            torch::Tensor key_scale, torch::Tensor key_zero, torch::Tensor key_ref, torch::Tensor value_codes,
                            torch::Tensor value_scale, torch::Tensor value_zero, torch::Tensor head_windows,
                            torch::Tensor holes, int64_t group, double alpha) {
  check(query, torch::kFloat, 2, "query");
  check(rotated_query, torch::kFloat, 2, "rotated_query");
  check(body_keys, torch::kFloat, 2, "body_keys");
  check(body_values, torch::kFloat, 2, "body_values");
  check(body_lengths, torch::kLong, 1, "body_lengths");
  check(tail_keys, torch::kFloat, 3, "tail_keys");
  check(tail_values, torch::kFloat, 3, "tail_values");
  check(tail_valid, torch::kBool, 1, "tail_valid");
  check(key_codes, torch::kByte, 3, "key_codes");
  const bool compact = key_scale.scalar_type() == torch::kByte;
  check(key_scale, compact ? torch::kByte : torch::kHalf, 2, "key_scale");
  check(key_zero, compact ? torch::kByte : torch::kHalf, 2, "key_zero");
  if (compact) {
    check(key_ref, torch::kHalf, 2, "key_ref");
    TORCH_CHECK(key_ref.size(0) == key_scale.size(0) && key_ref.size(1) == 3, "key_ref must be [windows, 3]");
  }
  check(value_codes, torch::kByte, 3, "value_codes");
  check(value_scale, torch::kHalf, 2, "value_scale");
  check(value_zero, torch::kHalf, 2, "value_zero");
  for (const torch::Tensor* t : {&query, &rotated_query, &body_keys, &body_values, &body_lengths, &tail_keys,
                                 &tail_values, &tail_valid, &key_codes, &key_scale, &key_zero, &key_ref, &value_codes,
                                 &value_scale, &value_zero})
    TORCH_CHECK(t->is_contiguous(), "every input must be contiguous");
  const int64_t Hq = query.size(0), D = query.size(1);
  const int64_t H = head_windows.size(0), n = key_codes.size(0), w = key_codes.size(1), D4 = key_codes.size(2);
  const int64_t T = tail_keys.size(1), nb = body_keys.size(0);
  TORCH_CHECK(group >= 1 && Hq == H * group, "query heads ", Hq, " != KV heads ", H, " x group ", group);
  TORCH_CHECK(D == 4 * D4, "codes pack four channels per byte: ", D4, " bytes for head_dim ", D);
  TORCH_CHECK(rotated_query.size(0) == Hq && rotated_query.size(1) == D, "rotated_query must be [Hq, D]");
  TORCH_CHECK(body_lengths.size(0) == H, "body_lengths must give each KV head's entries");
  TORCH_CHECK(tail_keys.size(0) == H && tail_keys.size(2) == D && tail_values.sizes() == tail_keys.sizes(),
              "tail keys and values must be [H, T, D]");
  TORCH_CHECK(tail_valid.size(0) == T, "tail_valid must be [T]");
  TORCH_CHECK(key_scale.size(0) == n && key_scale.size(1) == D && key_zero.sizes() == key_scale.sizes(),
              "key scale and zero must be [windows, head_dim]");
  TORCH_CHECK(value_codes.sizes() == key_codes.sizes(), "value codes must be shaped as the key codes");
  TORCH_CHECK(value_scale.size(0) == n && value_scale.size(1) == w && value_zero.sizes() == value_scale.sizes(),
              "value scale and zero must be [windows, w]");
  const std::vector<int64_t> wstart = head_starts(head_windows, n);
  std::vector<int64_t> bstart(H + 1, 0);
  const int64_t* bl = body_lengths.data_ptr<int64_t>();
  for (int64_t h = 0; h < H; ++h) bstart[h + 1] = bstart[h] + bl[h];
  TORCH_CHECK(bstart[H] == nb, "body_lengths sum to ", bstart[H], " but the body holds ", nb);
  const bool* hole = nullptr;
  if (holes.numel()) {
    check(holes, torch::kBool, 2, "holes");
    TORCH_CHECK(holes.is_contiguous() && holes.size(0) == n && holes.size(1) == w, "holes must be [windows, w]");
    hole = holes.data_ptr<bool>();
  }
  // each query head's logits: its KV head's body entries, the tail, its KV head's INT2 entries
  std::vector<int64_t> off(Hq + 1, 0);
  for (int64_t qh = 0; qh < Hq; ++qh) {
    const int64_t h = qh / group;
    off[qh + 1] = off[qh] + bl[h] + T + (wstart[h + 1] - wstart[h]) * w;
  }
  std::vector<float> logit(off[Hq]);
  const float a = static_cast<float>(alpha);
  const float ninf = -std::numeric_limits<float>::infinity();
  const float* q = query.data_ptr<float>();
  const float* qr = rotated_query.data_ptr<float>();
  const float* bk = body_keys.data_ptr<float>();
  const float* bv = body_values.data_ptr<float>();
  const float* tk = tail_keys.data_ptr<float>();
  const float* tv = tail_values.data_ptr<float>();
  const bool* tvalid = tail_valid.data_ptr<bool>();
  const uint8_t* kc = key_codes.data_ptr<uint8_t>();
  const uint8_t* ks8 = compact ? key_scale.data_ptr<uint8_t>() : nullptr;
  const uint8_t* kz8 = compact ? key_zero.data_ptr<uint8_t>() : nullptr;
  const at::Half* kref = compact ? key_ref.data_ptr<at::Half>() : nullptr;
  const at::Half* ks16 = compact ? nullptr : key_scale.data_ptr<at::Half>();
  const at::Half* kz16 = compact ? nullptr : key_zero.data_ptr<at::Half>();
  const uint8_t* vc = value_codes.data_ptr<uint8_t>();
  const at::Half* vs = value_scale.data_ptr<at::Half>();
  const at::Half* vz = value_zero.data_ptr<at::Half>();

  // FP logits, per query head
  at::parallel_for(0, Hq, 1, [&](int64_t q_begin, int64_t q_end) {
    for (int64_t qh = q_begin; qh < q_end; ++qh) {
      const int64_t h = qh / group;
      const float* qq = q + qh * D;
      float* lg = logit.data() + off[qh];
      for (int64_t e = bstart[h]; e < bstart[h + 1]; ++e) {
        const float* k = bk + e * D;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t ch = 0; ch < D; ++ch) acc += qq[ch] * k[ch];
        lg[e - bstart[h]] = acc * a;
      }
      lg += bl[h];
      for (int64_t t = 0; t < T; ++t) {
        if (!tvalid[t]) { lg[t] = ninf; continue; }
        const float* k = tk + (h * T + t) * D;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t ch = 0; ch < D; ++ch) acc += qq[ch] * k[ch];
        lg[t] = acc * a;
      }
    }
  });
  const bool planes = D4 % 16 == 0;
  // the channel at each place of the unpacked order, and the rotated query in that order
  std::vector<int64_t> channel(D);
  for (int64_t ch = 0; ch < D; ++ch) channel[place(ch, planes)] = ch;
  std::vector<float> qp(Hq * D);
  for (int64_t qh = 0; qh < Hq; ++qh)
    for (int64_t x = 0; x < D; ++x) qp[qh * D + x] = qr[qh * D + channel[x]];
  // INT2 logits, per window: q . (code * scale + zero) = (q * scale) . code + q . zero
  at::parallel_for(0, n, 32, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(group * D), qz(group), code(D), sj(D), zj(D);
#ifdef VLM_KV_AVX512
    std::vector<float> block(planes ? 8 * D : 0, 0.f);
#endif
    for (int64_t j = begin; j < end; ++j) {
      const int64_t h = head_of(wstart, j);
      if (compact) {
        const float z_lo = static_cast<float>(kref[3 * j]), z_step = static_cast<float>(kref[3 * j + 1]);
        const float s_step = static_cast<float>(kref[3 * j + 2]);
        for (int64_t x = 0; x < D; ++x) {
          zj[x] = z_lo + static_cast<float>(kz8[j * D + channel[x]]) * z_step;
          sj[x] = static_cast<float>(ks8[j * D + channel[x]]) * s_step;
        }
      } else {
        for (int64_t x = 0; x < D; ++x) {
          sj[x] = static_cast<float>(ks16[j * D + channel[x]]);
          zj[x] = static_cast<float>(kz16[j * D + channel[x]]);
        }
      }
      for (int64_t r = 0; r < group; ++r) {
        const float* qq = qp.data() + (h * group + r) * D;
        float* qsr = qs.data() + r * D;
        float dz = 0.f;
#pragma omp simd reduction(+ : dz)
        for (int64_t x = 0; x < D; ++x) {
          qsr[x] = qq[x] * sj[x];
          dz += qq[x] * zj[x];
        }
        qz[r] = dz;
      }
#ifdef VLM_KV_AVX512
      if (planes) {
        // eight slots at a time, their dot products reduced across lanes together (one horizontal
        // sum per slot and query head cost more than the products themselves)
        for (int64_t t0 = 0; t0 < w; t0 += 8) {
          const int64_t m = std::min<int64_t>(8, w - t0);
          for (int64_t u = 0; u < m; ++u) unpack(kc + (j * w + t0 + u) * D4, D4, block.data() + u * D, true);
          if (m < 8) std::fill(block.begin() + m * D, block.end(), 0.f);
          for (int64_t r = 0; r < group; ++r) {
            const float* qsr = qs.data() + r * D;
            __m512 acc[8];
            for (int u = 0; u < 8; ++u) acc[u] = _mm512_setzero_ps();
            for (int64_t x = 0; x < D; x += 16) {
              const __m512 qv = _mm512_loadu_ps(qsr + x);
              for (int u = 0; u < 8; ++u) acc[u] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(block.data() + u * D + x), acc[u]);
            }
            float sums[8];
            _mm256_storeu_ps(sums, _mm256_mul_ps(_mm256_add_ps(sum8(acc), _mm256_set1_ps(qz[r])), _mm256_set1_ps(a)));
            float* dst = logit.data() + off[h * group + r] + bl[h] + T + (j - wstart[h]) * w + t0;
            for (int64_t u = 0; u < m; ++u) dst[u] = hole && hole[j * w + t0 + u] ? ninf : sums[u];
          }
        }
        continue;
      }
#endif
      for (int64_t t = 0; t < w; ++t) {
        const int64_t slot = (j - wstart[h]) * w + t;
        if (hole && hole[j * w + t]) {
          for (int64_t r = 0; r < group; ++r) logit[off[h * group + r] + bl[h] + T + slot] = ninf;
          continue;
        }
        unpack(kc + (j * w + t) * D4, D4, code.data(), planes);
        for (int64_t r = 0; r < group; ++r) {
          const float* qsr = qs.data() + r * D;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t ch = 0; ch < D; ++ch) acc += qsr[ch] * code[ch];
          logit[off[h * group + r] + bl[h] + T + slot] = (acc + qz[r]) * a;
        }
      }
    }
  });
  // softmax per query head (float32), then the FP entries' weighted values
  auto out = torch::zeros({2, Hq, D}, query.options());
  float* o_fp = out.data_ptr<float>();
  float* o_q = o_fp + Hq * D;
  at::parallel_for(0, Hq, 1, [&](int64_t q_begin, int64_t q_end) {
    for (int64_t qh = q_begin; qh < q_end; ++qh) {
      const int64_t h = qh / group;
      float* lg = logit.data() + off[qh];
      const int64_t L = off[qh + 1] - off[qh];
      softmax_in_place(lg, L);
      float* acc = o_fp + qh * D;
      for (int64_t e = bstart[h]; e < bstart[h + 1]; ++e) {
        const float p = lg[e - bstart[h]];
        const float* v = bv + e * D;
#pragma omp simd
        for (int64_t ch = 0; ch < D; ++ch) acc[ch] += p * v[ch];
      }
      for (int64_t t = 0; t < T; ++t) {
        const float p = lg[bl[h] + t];
        if (p == 0.f) continue;
        const float* v = tv + (h * T + t) * D;
#pragma omp simd
        for (int64_t ch = 0; ch < D; ++ch) acc[ch] += p * v[ch];
      }
    }
  });
  // the INT2 windows' weighted values: each thread sums its windows into a partial [Hq, D + 1]
  // (the last column: sum of p * zero, which every channel receives), added up after
  const int64_t threads = at::get_num_threads();
  std::vector<float> part(threads * Hq * (D + 1), 0.f);
  at::parallel_for(0, n, 32, [&](int64_t begin, int64_t end) {
    float* acc = part.data() + at::get_thread_num() * Hq * (D + 1);
    std::vector<float> code(D);
#ifdef VLM_KV_AVX512
    std::vector<float> block(planes ? 8 * D : 0);
#endif
    for (int64_t j = begin; j < end; ++j) {
      const int64_t h = head_of(wstart, j);
#ifdef VLM_KV_AVX512
      if (planes) {
        // eight slots at a time: each partial row is read and written once per eight entries
        for (int64_t t0 = 0; t0 < w; t0 += 8) {
          const int64_t m = std::min<int64_t>(8, w - t0);
          const int64_t slot0 = bl[h] + T + (j - wstart[h]) * w + t0;
          for (int64_t u = 0; u < m; ++u) unpack(vc + (j * w + t0 + u) * D4, D4, block.data() + u * D, true);
          for (int64_t r = 0; r < group; ++r) {
            const float* p = logit.data() + off[h * group + r] + slot0;
            float ws[8];
            float* row = acc + (h * group + r) * (D + 1);
            for (int64_t u = 0; u < m; ++u) {
              // a weight of 0 (a hole) reads nothing of its grid
              ws[u] = p[u] == 0.f ? 0.f : p[u] * static_cast<float>(vs[j * w + t0 + u]);
              if (p[u] != 0.f) row[D] += p[u] * static_cast<float>(vz[j * w + t0 + u]);
            }
            for (int64_t x = 0; x < D; x += 16) {
              __m512 sum = _mm512_loadu_ps(row + x);
              for (int64_t u = 0; u < m; ++u)
                sum = _mm512_fmadd_ps(_mm512_set1_ps(ws[u]), _mm512_loadu_ps(block.data() + u * D + x), sum);
              _mm512_storeu_ps(row + x, sum);
            }
          }
        }
        continue;
      }
#endif
      for (int64_t t = 0; t < w; ++t) {
        const int64_t e = j * w + t;
        const int64_t slot = bl[h] + T + (j - wstart[h]) * w + t;
        bool any = false;
        for (int64_t r = 0; r < group; ++r) any = any || logit[off[h * group + r] + slot] != 0.f;
        if (!any) continue;  // a hole, or an entry no query head weighs
        unpack(vc + e * D4, D4, code.data(), planes);
        for (int64_t r = 0; r < group; ++r) {
          const float p = logit[off[h * group + r] + slot];
          const float ws = p * static_cast<float>(vs[e]);
          float* row = acc + (h * group + r) * (D + 1);
#pragma omp simd
          for (int64_t ch = 0; ch < D; ++ch) row[ch] += ws * code[ch];
          row[D] += p * static_cast<float>(vz[e]);
        }
      }
    }
  });
  for (int64_t th = 0; th < threads; ++th) {
    const float* src = part.data() + th * Hq * (D + 1);
    for (int64_t qh = 0; qh < Hq; ++qh)
      for (int64_t ch = 0; ch < D; ++ch)
        o_q[qh * D + ch] += src[qh * (D + 1) + place(ch, planes)] + src[qh * (D + 1) + D];
  }
  return out;
}
"""

_FUNCTIONS = ["tiered_decode"]


#: seconds a ``load`` may take before it says that it is building (a cached build loads in well under this)
BUILD_NOTICE_AFTER = 2.0


class CpuKernelUnavailable(RuntimeError):
    """The C++ INT2 kernels could not be built here (no compiler, no ninja, a build error)."""


def _host_tag() -> str:
    """A short hash of this CPU's feature flags. Why: the build uses ``-march=native`` and torch
    caches it by name under the home folder, which machines with other CPUs may share; a build
    made for AVX-512 must never load where the instructions are missing."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            flags = next((line for line in fh if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return hashlib.sha1((platform.machine() + (flags or platform.processor())).encode()).hexdigest()[:10]


@lru_cache(maxsize=2)
def _build(scalar: bool = False):
    from torch.utils.cpp_extension import load_inline

    # -O3 and the host's vector units: the extension is built on the machine that runs it;
    # -fopenmp: at::parallel_for is a header template that runs serially without it (measured: the
    # same time on 1 and 2 threads)
    flags = ["-O3", "-march=native", "-fopenmp"] + (["-DVLM_KV_SCALAR"] if scalar else [])
    name = f"vlm_kv_int2_cpu_{_host_tag()}" + ("_scalar" if scalar else "")
    return load_inline(name=name, cpp_sources=[_SOURCE], functions=_FUNCTIONS,
                       extra_cflags=flags, extra_ldflags=["-fopenmp"],
                       verbose=bool(os.environ.get("VLM_KV_VERBOSE_BUILD")))


_loaded: dict[bool, object] = {}  # built modules by ``scalar``


def load(scalar: bool = False):
    """The compiled module (built on the first call, then cached by torch on disk); raises
    ``CpuKernelUnavailable`` with the reason where it cannot be built. ``scalar``: the build without
    AVX-512 unpacking (what a CPU without it runs; the tests build it to check that path too)."""
    built = _loaded.get(scalar)
    if built is not None:  # every decode step of every layer calls this: no timer thread then
        return built
    notice = threading.Timer(BUILD_NOTICE_AFTER, lambda: print(
        "vlm-kv: building the CPU tiered-decode kernel (once per machine and version, about 30 s; "
        "attention_backend='torch' skips it)", file=sys.stderr, flush=True))
    notice.daemon = True
    notice.start()
    try:
        _loaded[scalar] = _build(scalar)
        return _loaded[scalar]
    except Exception as err:  # a missing compiler, ninja or header surfaces as many exception types
        raise CpuKernelUnavailable(f"the CPU INT2 kernels could not be built: {err}") from err
    finally:
        notice.cancel()


def tiered_decode(query: torch.Tensor, rotated_query: torch.Tensor, body: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                  tail: tuple[torch.Tensor, torch.Tensor, torch.Tensor], windows, group: int,
                  scale: float, scalar: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's decode step: (FP share [Hq, D], INT2 share [Hq, D] in the values' basis) of
    the attention output, one float32 softmax over both. ``query`` / ``rotated_query`` [Hq, D]
    float32 (the latter in the keys' basis); ``body``: keys, values [n_b, D] float32 laid out by KV
    head and [H] int64 entries per head; ``tail``: keys, values [H, T, D] float32 and [T] bool valid;
    ``windows``: a ``vlm_kv.attention.backend.PackedWindows``."""
    empty = torch.empty(0, 0, dtype=torch.bool)
    out = load(scalar).tiered_decode(query, rotated_query, *body, *tail, windows.key_codes, windows.key_scale,
                               windows.key_zero, windows.key_ref, windows.value_codes, windows.value_scale, windows.value_zero,
                               windows.head_windows, empty if windows.holes is None else windows.holes,
                               group, float(scale))
    return out[0], out[1]
