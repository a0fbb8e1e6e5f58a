// Row-invariant CPU kernels for decoding (1 row) and verification (k+1 rows), AVX2/FMA (plus one int8 path on
// AVX-512 VNNI, compiled with target attributes and used only where the CPU has it).
//
// The contract: every output element is computed by one fixed sequence of float operations that depends only
// on its own inputs and the tensor sizes along the reduced axis, never on how many rows were computed
// together, how rows and columns were tiled, or how the work was split across threads. So a position's
// logits are bitwise the same whether it was verified alone or with 8 others (greedy identity by
// construction, not up to rounding). Built with -ffp-contract=off so the compiler fuses nothing on its own.
//
// Linears (y = x W^T + b): per output, U 8-lane accumulators over K in chunks of 8 (round robin, in
// increasing order, the last chunk zero-padded), then a fixed sum of them and a fixed horizontal sum. Rows
// go in blocks whose size never changes a row's arithmetic (details at linear_rows).
// Attention: per query row, scores, softmax and the weighted sum of values in one fixed order over its own
// keys (the other rows only share loads). Attention and SiLU use our own vector exp (the same code for every
// element, tails included): torch's elementwise kernels compute chunk tails with scalar code, whose
// results differ from the vector ones.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline __m256i tail_mask(int64_t r) {  // lanes < r set
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(int(r)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// exp(x) for 8 lanes (Cephes expf: range reduction by ln 2, degree-5 polynomial; ~1 ulp on [-88, 88]).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3365f)), _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
  const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

// ---- linears -------------------------------------------------------------------------------------------

// 8 weights of column row `w` at k as floats; `r` < 8: only the first r (the rest 0).
inline __m256 load_w(const float* w, int64_t r = 8) {
  return r == 8 ? _mm256_loadu_ps(w) : _mm256_maskload_ps(w, tail_mask(r));
}
inline __m256 load_w(const int8_t* w, int64_t r = 8) {
  int64_t bits = 0;
  std::memcpy(&bits, w, size_t(r));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(bits)));
}

// Y[r, n0 + c] for R rows x C columns. S: per-column scale (int8 weights) or nullptr; B: bias or nullptr.
// Per output: K in chunks of 8, chunk j into accumulator j % U (U independent FMA chains per output), the
// last chunk zero-padded (its padding lanes add +0), then hsum of the accumulators summed in order
// (acc0 + acc1 [+ acc2 + acc3]), [* scale] [+ bias].
template <int U, int R, int C, typename WT>
void tile(const float* X, const WT* W, const float* S, const float* B, float* Y, int64_t K, int64_t N, int64_t n0) {
  __m256 acc[R][C][U];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int u = 0; u < U; ++u) acc[r][c][u] = _mm256_setzero_ps();
  const int64_t KU = K / (8 * U) * (8 * U);
  for (int64_t k = 0; k < KU; k += 8 * U) {
    for (int u = 0; u < U; ++u) {
      __m256 w[C];
      for (int c = 0; c < C; ++c) w[c] = load_w(W + (n0 + c) * K + k + 8 * u);
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
          acc[r][c][u] = _mm256_fmadd_ps(w[c], _mm256_loadu_ps(X + r * K + k + 8 * u), acc[r][c][u]);
    }
  }
  int u = 0;
  for (int64_t k = KU; k < K; k += 8, ++u) {  // the remaining chunks, the last one maybe partial
    const int64_t n = std::min<int64_t>(8, K - k);
    const __m256i mask = tail_mask(n);
    for (int c = 0; c < C; ++c) {
      const __m256 w = load_w(W + (n0 + c) * K + k, n);
      for (int r = 0; r < R; ++r) acc[r][c][u] = _mm256_fmadd_ps(w, _mm256_maskload_ps(X + r * K + k, mask), acc[r][c][u]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      __m256 sum = acc[r][c][0];
      for (int i = 1; i < U; ++i) sum = _mm256_add_ps(sum, acc[r][c][i]);
      float t = hsum(sum);
      if (S) t = t * S[n0 + c];
      Y[r * N + n0 + c] = B ? t + B[n0 + c] : t;
    }
}

// Rows [m0, m0 + R) x columns [n0, n1), one column at a time: each column's weights are read in order (one
// stream; interleaving several columns' streams measured up to 2x slower from DRAM here).
template <int U, int R, typename WT>
void row_block(const float* X, const WT* W, const float* S, const float* B, float* Y, int64_t K, int64_t N,
               int64_t m0, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) tile<U, R, 1>(X + m0 * K, W, S, B, Y + m0 * N, K, N, n);
}

// U chains per output, rows in blocks of 12 / U (12 accumulators of the 16 ymm registers). fp32: U = 2,
// blocks of 6 rows; int8: U = 4 (its single row, the draft's usual case, would otherwise wait on FMA
// latency), blocks of 3 rows. Column panels of ~128 KB of weights stay in L2 while the row blocks reuse them,
// so fp32 1-6 rows cost one pass over W from memory, and a prompt's prefill runs through the same code.
template <int U, typename WT>
void linear_rows(const float* X, const WT* W, const float* S, const float* B, float* Y, int64_t M, int64_t K, int64_t N) {
  constexpr int64_t block = 12 / U;
  const int64_t panel = std::max<int64_t>(8, int64_t(128 << 10) / (K * int64_t(sizeof(WT))));
  const int64_t panels = (N + panel - 1) / panel;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * panel, n1 = std::min(N, n0 + panel);
      for (int64_t m = 0; m < M; m += block) {
        switch (std::min(block, M - m)) {
          case 1: row_block<U, 1>(X, W, S, B, Y, K, N, m, n0, n1); break;
          case 2: row_block<U, 2>(X, W, S, B, Y, K, N, m, n0, n1); break;
          case 3: row_block<U, 3>(X, W, S, B, Y, K, N, m, n0, n1); break;
          case 4: row_block<U, (4 <= block ? 4 : 1)>(X, W, S, B, Y, K, N, m, n0, n1); break;
          case 5: row_block<U, (5 <= block ? 5 : 1)>(X, W, S, B, Y, K, N, m, n0, n1); break;
          default: row_block<U, (6 <= block ? 6 : 1)>(X, W, S, B, Y, K, N, m, n0, n1); break;
        }
      }
    }
  });
}

// Checks shared by both entry points; returns the bias pointer (nullptr: none), `keep` holds its tensor.
const float* check_rows(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                        torch::Tensor& keep, const char* name) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), name, ": x (M, K), w (N, K)");
  TORCH_CHECK(x.scalar_type() == at::kFloat, name, ": x must be float32");
  TORCH_CHECK(w.is_contiguous(), name, ": w must be contiguous");
  if (!bias.has_value() || !bias->defined()) return nullptr;
  keep = bias->contiguous();
  TORCH_CHECK(keep.scalar_type() == at::kFloat && keep.numel() == w.size(0), name, ": bias (N,) float32");
  return keep.data_ptr<float>();
}

}  // namespace

torch::Tensor rows_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(w.scalar_type() == at::kFloat, "rows_linear: float32 only");
  torch::Tensor b;
  const float* B = check_rows(x, w, bias, b, "rows_linear");
  x = x.contiguous();
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  linear_rows<2>(x.data_ptr<float>(), w.data_ptr<float>(), nullptr, B, y.data_ptr<float>(), x.size(0), x.size(1), w.size(0));
  return y;
}

// ---- int8 weights x int8 activations with AVX-512 VNNI (vpdpbusd) --------------------------------------
// Activations quantised per row in blocks of 32 (q = round(x * 127 / max|x_block|), one float scale per
// block, as llama.cpp's q8_0), products summed exactly in int32 by vpdpbusd (|q| as its unsigned operand,
// q's sign moved onto the weights), each block's 8 int32 lanes then scaled into two float accumulators
// (block g into g % 2) in increasing order, then a fixed horizontal sum: fixed per output, so row-invariant
// within this path. Not bitwise the fp32-activation path (activations are rounded to 8 bits).

#define VNNI_TARGET __attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni")))

namespace {

constexpr int64_t kQBlock = 32;

struct QuantRows {
  std::vector<int8_t> q;   // (M, blocks * 32) quantised activations, zero-padded
  std::vector<uint8_t> a;  // |q|
  std::vector<float> s;    // (M, blocks) scales
  int64_t blocks = 0;
};

bool cpu_has_vnni() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}

VNNI_TARGET void quantize_rows(const float* X, int64_t M, int64_t K, QuantRows& out) {
  const int64_t nb = (K + kQBlock - 1) / kQBlock;
  out.blocks = nb;
  out.q.assign(size_t(M * nb * kQBlock), 0);
  out.a.assign(size_t(M * nb * kQBlock), 0);
  out.s.assign(size_t(M * nb), 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < nb; ++g) {
      const int64_t k0 = g * kQBlock, n = std::min(kQBlock, K - k0);
      const __mmask16 lo = n >= 16 ? 0xffff : __mmask16((1u << n) - 1);
      const __mmask16 hi = n >= 32 ? 0xffff : n > 16 ? __mmask16((1u << (n - 16)) - 1) : 0;
      const __m512 x0 = _mm512_maskz_loadu_ps(lo, X + m * K + k0), x1 = _mm512_maskz_loadu_ps(hi, X + m * K + k0 + 16);
      const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
      const __m512 inv = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f);
      const int64_t at = (m * nb + g) * kQBlock;
      const __m128i q0 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)));
      const __m128i q1 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x1, inv)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q.data() + at), q0);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q.data() + at + 16), q1);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.a.data() + at), _mm_abs_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.a.data() + at + 16), _mm_abs_epi8(q1));
      out.s[size_t(m * nb + g)] = top / 127.f;
    }
}

template <int R>
VNNI_TARGET void vnni_tile(const QuantRows& x, int64_t m0, const int8_t* W, const float* S, const float* B, float* Y,
                           int64_t K, int64_t N, int64_t n) {
  const int64_t nb = x.blocks;
  const int8_t* w = W + n * K;
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  auto step = [&](int64_t g, int u) VNNI_TARGET {
    const int64_t k0 = g * kQBlock;
    const __m256i wv = k0 + kQBlock <= K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k0))
                                         : _mm256_maskz_loadu_epi8(__mmask32((1ull << (K - k0)) - 1), w + k0);
    for (int r = 0; r < R; ++r) {
      const int64_t at = ((m0 + r) * nb + g) * kQBlock;
      const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.a.data() + at));
      const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + at));
      const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), qa, _mm256_sign_epi8(wv, qs));
      acc[r][u] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(x.s[size_t((m0 + r) * nb + g)]), acc[r][u]);
    }
  };
  int64_t g = 0;
  for (; g + 2 <= nb; g += 2) step(g, 0), step(g + 1, 1);
  if (g < nb) step(g, 0);
  for (int r = 0; r < R; ++r) {
    const float t = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) * S[n];
    Y[(m0 + r) * N + n] = B ? t + B[n] : t;
  }
}

VNNI_TARGET void linear_int8_vnni(const float* X, const int8_t* W, const float* S, const float* B, float* Y, int64_t M,
                                  int64_t K, int64_t N) {
  QuantRows x;
  quantize_rows(X, M, K, x);
  const int64_t panel = std::max<int64_t>(8, int64_t(128 << 10) / K);
  const int64_t panels = (N + panel - 1) / panel;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * panel, n1 = std::min(N, n0 + panel);
      for (int64_t m = 0; m < M; m += 4)
        for (int64_t n = n0; n < n1; ++n) {
          switch (std::min<int64_t>(4, M - m)) {
            case 1: vnni_tile<1>(x, m, W, S, B, Y, K, N, n); break;
            case 2: vnni_tile<2>(x, m, W, S, B, Y, K, N, n); break;
            case 3: vnni_tile<3>(x, m, W, S, B, Y, K, N, n); break;
            default: vnni_tile<4>(x, m, W, S, B, Y, K, N, n); break;
          }
        }
    }
  });
}

}  // namespace

bool has_vnni() { return cpu_has_vnni(); }

// Weight-only int8 with one float scale per output row: y = (x . W8[n]) * scale[n] + b[n]. Activations stay
// fp32, so it is more accurate than dynamic int8, and it moves 4x fewer bytes than fp32 (drafts only: their
// precision changes acceptance, never the output). vnni=true: activations quantised too (the section above).
torch::Tensor rows_linear_int8(torch::Tensor x, torch::Tensor w, torch::Tensor scale, c10::optional<torch::Tensor> bias,
                               bool vnni) {
  TORCH_CHECK(w.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat, "rows_linear_int8: w int8, scale float32");
  TORCH_CHECK(scale.is_contiguous() && scale.numel() == w.size(0), "rows_linear_int8: scale (N,)");
  TORCH_CHECK(!vnni || cpu_has_vnni(), "rows_linear_int8: vnni=True needs a CPU with AVX-512 VNNI");
  torch::Tensor b;
  const float* B = check_rows(x, w, bias, b, "rows_linear_int8");
  x = x.contiguous();
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  if (vnni)
    linear_int8_vnni(x.data_ptr<float>(), w.data_ptr<int8_t>(), scale.data_ptr<float>(), B, y.data_ptr<float>(), x.size(0),
                     x.size(1), w.size(0));
  else
    linear_rows<4>(x.data_ptr<float>(), w.data_ptr<int8_t>(), scale.data_ptr<float>(), B, y.data_ptr<float>(), x.size(0),
                   x.size(1), w.size(0));
  return y;
}

// ---- attention -----------------------------------------------------------------------------------------

namespace {

// out[r * os] = (q_r . k) * scale for N rows q_r = q + r * qs: per row one 8-lane accumulator over D in
// chunks of 8 (the last one zero-padded), then a fixed horizontal sum; the rows share the loads of k.
template <int N>
void dots(const float* q, int64_t qs, const float* k, int64_t D, float scale, float* out, int64_t os) {
  __m256 acc[N];
  for (int r = 0; r < N; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t D8 = D & ~int64_t(7);
  for (int64_t d = 0; d < D8; d += 8) {
    const __m256 kv = _mm256_loadu_ps(k + d);
    for (int r = 0; r < N; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * qs + d), kv, acc[r]);
  }
  if (D8 < D) {
    const __m256i mask = tail_mask(D - D8);
    const __m256 kv = _mm256_maskload_ps(k + D8, mask);
    for (int r = 0; r < N; ++r) acc[r] = _mm256_fmadd_ps(_mm256_maskload_ps(q + r * qs + D8, mask), kv, acc[r]);
  }
  for (int r = 0; r < N; ++r) out[r * os] = hsum(acc[r]) * scale;
}

// dots() for any number of rows, 8 at a time.
void dots_any(const float* q, int64_t qs, int64_t n, const float* k, int64_t D, float scale, float* out, int64_t os) {
  for (; n >= 8; n -= 8, q += 8 * qs, out += 8 * os) dots<8>(q, qs, k, D, scale, out, os);
  switch (n) {
    case 7: dots<7>(q, qs, k, D, scale, out, os); break;
    case 6: dots<6>(q, qs, k, D, scale, out, os); break;
    case 5: dots<5>(q, qs, k, D, scale, out, os); break;
    case 4: dots<4>(q, qs, k, D, scale, out, os); break;
    case 3: dots<3>(q, qs, k, D, scale, out, os); break;
    case 2: dots<2>(q, qs, k, D, scale, out, os); break;
    case 1: dots<1>(q, qs, k, D, scale, out, os); break;
    default: break;
  }
}

// Softmax in place over p[0, L) (given scores), returning the sum of the exponentials (divided out later).
float softmax_unnormalised(float* p, int64_t L) {
  float m = -INFINITY;
  for (int64_t j = 0; j < L; ++j) m = std::max(m, p[j]);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  const int64_t L8 = L & ~int64_t(7);
  for (int64_t j = 0; j < L8; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), mv));
    _mm256_storeu_ps(p + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (L8 < L) {
    const __m256i mask = tail_mask(L - L8);
    const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(p + L8, mask), mv)), _mm256_castsi256_ps(mask));
    _mm256_maskstore_ps(p + L8, mask, e);
    sum = _mm256_add_ps(sum, e);
  }
  return hsum(sum);
}

// Query rows [t0, t1) of one head; row t sees keys [0, L0 + t]. Per row the arithmetic of a row alone:
// scores q.k_j * scale, softmax, then out = (sum over j in order of p_j v_j) / total. The rows only share
// each key's and value's loads (one pass over this head's cache for all of them).
void attend_rows(const float* q, int64_t qs, const float* k, const float* v, int64_t ks, int64_t vs, int64_t L0, int64_t t0,
                 int64_t t1, int64_t D, float scale, std::vector<float>& scratch, float* out, int64_t os) {
  const int64_t R = t1 - t0, Lmax = L0 + t1, Dp = (D + 7) / 8 * 8, full = D / 8;
  scratch.assign(size_t(R * Lmax + R * Dp), 0.f);
  float* S = scratch.data();        // (R, Lmax) scores, then probabilities
  float* A = S + R * Lmax;          // (R, Dp) accumulators
  auto first_row = [&](int64_t j) { return std::max<int64_t>(0, j - L0 - t0); };  // rows that see key j
  for (int64_t j = 0; j < Lmax; ++j) {
    const int64_t r = first_row(j);
    dots_any(q + (t0 + r) * qs, qs, R - r, k + j * ks, D, scale, S + r * Lmax + j, Lmax);
  }
  std::vector<float> total(R);
  for (int64_t r = 0; r < R; ++r) total[r] = softmax_unnormalised(S + r * Lmax, L0 + t0 + r + 1);
  const __m256i mask = tail_mask(D - 8 * full);
  for (int64_t j = 0; j < Lmax; ++j) {
    const float* vj = v + j * vs;
    for (int64_t r = first_row(j); r < R; ++r) {
      const __m256 pj = _mm256_set1_ps(S[r * Lmax + j]);
      float* a = A + r * Dp;
      for (int64_t i = 0; i < full; ++i)
        _mm256_storeu_ps(a + 8 * i, _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * i), _mm256_loadu_ps(a + 8 * i)));
      if (full * 8 < D)
        _mm256_storeu_ps(a + 8 * full, _mm256_fmadd_ps(pj, _mm256_maskload_ps(vj + 8 * full, mask), _mm256_loadu_ps(a + 8 * full)));
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const __m256 t = _mm256_set1_ps(total[r]);
    float* o = out + (t0 + r) * os;
    for (int64_t i = 0; i < full; ++i) _mm256_storeu_ps(o + 8 * i, _mm256_div_ps(_mm256_loadu_ps(A + r * Dp + 8 * i), t));
    if (full * 8 < D) _mm256_maskstore_ps(o + 8 * full, mask, _mm256_div_ps(_mm256_loadu_ps(A + r * Dp + 8 * full), t));
  }
}

constexpr int64_t kQueryChunk = 32;  // rows per task: bounds the scores buffer (32 x L floats)

}  // namespace

// Causal attention for one sequence whose last T positions are the queries: q (H, T, D), k and v (Hkv, L, D)
// with L >= T (the cache plus the new rows), H a multiple of Hkv (grouped queries). Query t attends to keys
// [0, L - T + t]. Returns (T, H, D). Strided inputs are fine if the last axis is contiguous.
torch::Tensor attention_rows(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "attention_rows: q (H, T, D), k and v (Hkv, L, D)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "attention_rows: float32 only");
  q = q.stride(2) == 1 ? q : q.contiguous();
  k = k.stride(2) == 1 ? k : k.contiguous();
  v = v.stride(2) == 1 ? v : v.contiguous();
  const int64_t H = q.size(0), T = q.size(1), D = q.size(2), Hkv = k.size(0), L = k.size(1);
  TORCH_CHECK(k.size(2) == D && Hkv > 0 && H % Hkv == 0, "attention_rows: head sizes do not match");
  TORCH_CHECK(L >= T, "attention_rows: fewer keys than queries");
  auto out = torch::empty({T, H, D}, q.options());
  const float *Q = q.data_ptr<float>(), *Kp = k.data_ptr<float>(), *V = v.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const int64_t group = H / Hkv, chunks = (T + kQueryChunk - 1) / kQueryChunk;
  at::parallel_for(0, H * chunks, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scratch;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i / chunks, t0 = (i % chunks) * kQueryChunk, g = h / group;
      attend_rows(Q + h * q.stride(0), q.stride(1), Kp + g * k.stride(0), V + g * v.stride(0), k.stride(1), v.stride(1),
                  L - T, t0, std::min(T, t0 + kQueryChunk), D, float(scale), scratch, O + h * D, H * D);
    }
  });
  return out;
}

// silu(x) = x / (1 + exp(-x)), every element through the same vector code.
torch::Tensor silu_rows(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "silu_rows: float32 only");
  x = x.contiguous();
  auto y = torch::empty_like(x);
  const float* X = x.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  const int64_t n = x.numel();
  at::parallel_for(0, (n + 7) / 8, 2048, [&](int64_t b0, int64_t b1) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t b = b0; b < b1; ++b) {
      const __m256i mask = tail_mask(std::min<int64_t>(8, n - 8 * b));
      const __m256 v = _mm256_maskload_ps(X + 8 * b, mask);
      const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), v));
      _mm256_maskstore_ps(Y + 8 * b, mask, _mm256_div_ps(v, _mm256_add_ps(one, e)));
    }
  });
  return y;
}

// softmax_top_k(x (N, V) f32, k) -> (ids (N, k) int64, probs (N, k) f32): per row, the k largest logits (ties: the
// lower index first), best first, and their softmax probabilities over the whole row. What the online learner keeps
// of each verified position (learn/compact.py compress): one pass for the max, one for the sum of exponentials
// (exp8), one heap pass for the top k; ~10x faster than torch's softmax + topk on one 151,936-token row.
std::vector<torch::Tensor> softmax_top_k(torch::Tensor x, int64_t k) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "softmax_top_k: x must be (N, V) float32");
  x = x.contiguous();
  const int64_t N = x.size(0), V = x.size(1);
  TORCH_CHECK(k >= 1 && k <= V, "softmax_top_k: k must be in [1, V]");
  auto ids = torch::empty({N, k}, torch::kLong);
  auto probs = torch::empty({N, k}, torch::kFloat);
  const float* X = x.data_ptr<float>();
  int64_t* I = ids.data_ptr<int64_t>();
  float* P = probs.data_ptr<float>();
  auto rows = [&](int64_t r0, int64_t r1) {
    using Entry = std::pair<float, int64_t>;
    // better(a, b): a ranks before b. As the heap's order, it keeps the worst entry on top.
    auto better = [](const Entry& a, const Entry& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
    std::vector<Entry> heap;
    heap.reserve(k);
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = X + r * V;
      __m256 m8 = _mm256_set1_ps(-INFINITY);
      int64_t j = 0;
      for (; j + 8 <= V; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(row + j));
      float buf[8];
      _mm256_storeu_ps(buf, m8);
      float mx = buf[0];
      for (int q = 1; q < 8; ++q) mx = std::max(mx, buf[q]);
      for (; j < V; ++j) mx = std::max(mx, row[j]);
      const __m256 vmx = _mm256_set1_ps(mx);
      __m256 s8 = _mm256_setzero_ps();
      for (int64_t b = 0; b < V; b += 8) {
        const __m256i mask = tail_mask(std::min<int64_t>(8, V - b));
        const __m256 e = exp8(_mm256_sub_ps(_mm256_maskload_ps(row + b, mask), vmx));
        s8 = _mm256_add_ps(s8, _mm256_and_ps(e, _mm256_castsi256_ps(mask)));
      }
      const float sum = hsum(s8);
      heap.clear();
      for (int64_t i = 0; i < k; ++i) heap.emplace_back(row[i], i);
      std::make_heap(heap.begin(), heap.end(), better);
      float worst = heap.front().first;
      auto offer = [&](int64_t i) {
        if (row[i] > worst) {  // equal values keep the lower index (already in)
          std::pop_heap(heap.begin(), heap.end(), better);
          heap.back() = Entry(row[i], i);
          std::push_heap(heap.begin(), heap.end(), better);
          worst = heap.front().first;
        }
      };
      int64_t i = k;
      for (; i < V && i % 8; ++i) offer(i);
      for (; i + 8 <= V; i += 8) {  // 8 at a time: most rows hold few logits above the k-th best so far
        int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), _mm256_set1_ps(worst), _CMP_GT_OQ));
        while (bits) {
          offer(i + __builtin_ctz(bits));
          bits &= bits - 1;
        }
      }
      for (; i < V; ++i) offer(i);
      std::sort_heap(heap.begin(), heap.end(), better);  // best first
      for (int64_t i = 0; i < k; ++i) {
        float e[8] = {heap[i].first - mx, 0, 0, 0, 0, 0, 0, 0};
        _mm256_storeu_ps(e, exp8(_mm256_loadu_ps(e)));
        I[r * k + i] = heap[i].second;
        P[r * k + i] = e[0] / sum;
      }
    }
  };
  // A few rows run on the calling thread: an OpenMP region of one thread between the target's two-thread ones
  // resizes the serving thread's team every call (a learning server observes one row per sequence per step).
  if (N < 8) rows(0, N); else at::parallel_for(0, N, 1, rows);
  return {ids, probs};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rows_linear", &rows_linear, "y = x w^T + b, any number of rows, each row bitwise independent of the others",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("rows_linear_int8", &rows_linear_int8, "y = (x w8^T) * scale + b, any number of rows, row-invariant",
        py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("bias") = py::none(), py::arg("vnni") = false);
  m.def("has_vnni", &has_vnni, "whether this CPU runs the AVX-512 VNNI int8 path");
  m.def("attention_rows", &attention_rows, "causal attention of the last T positions (H, T, D) -> (T, H, D), row-invariant",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"));
  m.def("softmax_top_k", &softmax_top_k, "per row: the k largest logits' ids (best first) and softmax probabilities",
        py::arg("x"), py::arg("k"));
  m.def("silu_rows", &silu_rows, "x * sigmoid(x), every element through the same code", py::arg("x"));
}
