// The float work of a transformer forward around the Q4_K/Q6_K kernel (q4_kernel.cpp), one row at a time:
// RMSNorm, q/k/v biases + RoPE + KV-cache write, causal GQA attention over the cache, SiLU(gate) * up.
//
// Why C++ and not torch ops: greedy identity by construction. A position's logits must be bitwise the same
// whether it is fed alone or with up to 8 other rows. torch's reductions (the mean of RMSNorm, softmax sums,
// batched matmuls in attention) and its vectorised transcendental functions (exp in SiLU: SIMD body, scalar tail)
// may sum or round differently with the number of rows or where a thread's chunk ends. Here every row runs the
// same instructions in the same order whatever M is and whichever thread takes it: work is split across threads by
// whole rows (or row x KV head), reductions are per row in a fixed order, exp is one vectorised function applied to
// every element (no scalar tail: widths must be multiples of 8).
//
// Limitations: float32 only; widths (hidden, head dim, intermediate) must be multiples of 8; RoPE is the NEOX
// form (pairs i, i + D/2) that Qwen2 uses; the KV cache is float32, (G, T, D) per layer.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

namespace {

// Cheap per-row ops (RMSNorm, biases + RoPE) run on the calling thread for up to this many rows: waking the
// thread pool costs more than the work of a verify's <= 9 rows. Larger feeds (prompt chunks) split by rows.
constexpr int64_t INLINE_ROWS = 16;

inline float hsum8(__m256 v) {  // fixed order
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// exp(x) for 8 floats (Cephes' expf: range reduction by ln 2, degree-5 polynomial; ~1 ulp). The same function
// for every element, so results never depend on an element's place in a vector.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

void check_f32(const torch::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == dim, "q4_glue: ", name,
              " must be a contiguous float32 tensor with ", dim, " dims");
}

void check_width(int64_t k, const char* name) {
  TORCH_CHECK(k > 0 && k % 8 == 0, "q4_glue: ", name, " must be a positive multiple of 8, got ", k);
}

}  // namespace

// x (M, K), w (K) -> x / sqrt(mean(x^2) + eps) * w, per row (llama.cpp's and transformers' RMSNorm)
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_f32(x, 2, "x");
  check_f32(w, 1, "w");
  const int64_t M = x.size(0), K = x.size(1);
  check_width(K, "the hidden size");
  TORCH_CHECK(w.size(0) == K, "rms_norm: weight size ", w.size(0), " != ", K);
  auto y = torch::empty_like(x);
  const float *X = x.data_ptr<float>(), *W = w.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, M, INLINE_ROWS, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = X + r * K;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t j = 0; j < K; j += 8) {
        const __m256 v = _mm256_loadu_ps(xr + j);
        acc = _mm256_fmadd_ps(v, v, acc);
      }
      const float scale = 1.f / std::sqrt(hsum8(acc) / static_cast<float>(K) + static_cast<float>(eps));
      const __m256 s = _mm256_set1_ps(scale);
      for (int64_t j = 0; j < K; j += 8)
        _mm256_storeu_ps(Y + r * K + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + j), s), _mm256_loadu_ps(W + j)));
    }
  });
  return y;
}

namespace {

struct CacheRef {  // one sequence's cache of one layer: keys, values (G, T, D)
  float *k, *v;
  int64_t T;
};

void check_cache(const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t G, int64_t D) {
  check_f32(k_cache, 3, "k_cache");
  check_f32(v_cache, 3, "v_cache");
  TORCH_CHECK(k_cache.size(0) == G && k_cache.size(2) == D && v_cache.sizes() == k_cache.sizes(),
              "the caches' shapes disagree (G, T, D)");
}

// Each row's caches: caches[of[r]] (several sequences in one call), checked: one per group of rows.
std::vector<CacheRef> cache_refs(const std::vector<torch::Tensor>& k_caches, const std::vector<torch::Tensor>& v_caches,
                                 const torch::Tensor& of, int64_t M, int64_t G, int64_t D) {
  TORCH_CHECK(!k_caches.empty() && k_caches.size() == v_caches.size(), "one key and one value cache per sequence");
  TORCH_CHECK(of.scalar_type() == at::kLong && of.is_contiguous() && of.dim() == 1 && of.size(0) == M,
              "cache_of must be (M,) int64");
  std::vector<CacheRef> refs;
  for (size_t i = 0; i < k_caches.size(); ++i) {
    check_cache(k_caches[i], v_caches[i], G, D);
    refs.push_back({k_caches[i].data_ptr<float>(), v_caches[i].data_ptr<float>(), k_caches[i].size(1)});
  }
  const int64_t* O = of.data_ptr<int64_t>();
  std::vector<CacheRef> rows(M);
  for (int64_t r = 0; r < M; ++r) {
    TORCH_CHECK(O[r] >= 0 && O[r] < static_cast<int64_t>(refs.size()), "cache_of: row ", r, " names no cache");
    rows[r] = refs[O[r]];
  }
  return rows;
}

// biases + RoPE of every row, keys/values written at cache index A[r] of the row's cache (cache_of(r) -> CacheRef).
template <class CacheOf>
torch::Tensor rope_rows(const torch::Tensor& qkv, const torch::Tensor& bias, const torch::Tensor& cos,
                        const torch::Tensor& sin, const torch::Tensor& pos, const torch::Tensor& at, int64_t H,
                        int64_t G, int64_t D, CacheOf cache_of) {
  check_f32(qkv, 2, "qkv");
  check_f32(bias, 1, "bias");
  check_f32(cos, 2, "cos");
  check_f32(sin, 2, "sin");
  const int64_t M = qkv.size(0), half = D / 2, width = (H + 2 * G) * D;
  check_width(half, "half the head dim");
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.is_contiguous() && pos.dim() == 1 && pos.size(0) == M,
              "qkv_rope: pos must be (M,) int64");
  TORCH_CHECK(qkv.size(1) == width && bias.size(0) == width, "qkv_rope: qkv/bias width must be (H + 2G) D = ", width);
  TORCH_CHECK(at.scalar_type() == at::kLong && at.is_contiguous() && at.dim() == 1 && at.size(0) == M,
              "qkv_rope: at must be (M,) int64");
  TORCH_CHECK(cos.size(1) == half && sin.sizes() == cos.sizes(), "qkv_rope: RoPE table shapes disagree");
  const int64_t *P = pos.data_ptr<int64_t>(), *A = at.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r) {
    const int64_t T = cache_of(r).T;
    TORCH_CHECK(P[r] >= 0 && P[r] < T && P[r] < cos.size(0) && A[r] >= 0 && A[r] < T, "qkv_rope: position ", P[r],
                " / index ", A[r], " outside the cache");
  }
  auto q = torch::empty({M, H, D}, qkv.options());
  const float *X = qkv.data_ptr<float>(), *B = bias.data_ptr<float>();
  const float *C = cos.data_ptr<float>(), *S = sin.data_ptr<float>();
  float* Q = q.data_ptr<float>();
  // one head vector (D) of row r: x + bias, rotated by position p, stored at out
  auto rotate = [&](const float* x, const float* b, int64_t p, float* out) {
    const float *c = C + p * half, *s = S + p * half;
    for (int64_t i = 0; i < half; i += 8) {
      const __m256 x0 = _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(b + i));
      const __m256 x1 = _mm256_add_ps(_mm256_loadu_ps(x + half + i), _mm256_loadu_ps(b + half + i));
      const __m256 ci = _mm256_loadu_ps(c + i), si = _mm256_loadu_ps(s + i);
      _mm256_storeu_ps(out + i, _mm256_sub_ps(_mm256_mul_ps(x0, ci), _mm256_mul_ps(x1, si)));
      _mm256_storeu_ps(out + half + i, _mm256_add_ps(_mm256_mul_ps(x1, ci), _mm256_mul_ps(x0, si)));
    }
  };
  at::parallel_for(0, M, INLINE_ROWS, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = X + r * width;
      const int64_t p = P[r], a = A[r];
      const CacheRef c = cache_of(r);
      for (int64_t h = 0; h < H; ++h) rotate(x + h * D, B + h * D, p, Q + (r * H + h) * D);
      for (int64_t g = 0; g < G; ++g) {
        rotate(x + (H + g) * D, B + (H + g) * D, p, c.k + (g * c.T + a) * D);
        const float *v = x + (H + G + g) * D, *bv = B + (H + G + g) * D;
        float* vout = c.v + (g * c.T + a) * D;
        for (int64_t i = 0; i < D; i += 8)
          _mm256_storeu_ps(vout + i, _mm256_add_ps(_mm256_loadu_ps(v + i), _mm256_loadu_ps(bv + i)));
      }
    }
  });
  return q;
}

}  // namespace

// qkv (M, (H + 2G) D) = the q, k, v projections side by side, bias ((H + 2G) D), cos/sin (T, D/2), pos (M) int64,
// k_cache/v_cache (G, T, D) of this layer. Adds the biases, rotates q and k (NEOX RoPE at each row's position),
// writes k and v at the rows' positions; returns q (M, H, D).
// qkv_rope_at: the same with the keys/values written at cache index at[r] instead of pos[r] (token trees: a node's
// RoPE position is its depth, its cache index its place in the tree).
torch::Tensor qkv_rope_at(torch::Tensor qkv, torch::Tensor bias, torch::Tensor cos, torch::Tensor sin, torch::Tensor pos,
                          torch::Tensor at, torch::Tensor k_cache, torch::Tensor v_cache, int64_t H) {
  check_f32(k_cache, 3, "k_cache");
  const int64_t G = k_cache.size(0), D = k_cache.size(2);
  check_cache(k_cache, v_cache, G, D);
  const CacheRef c{k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), k_cache.size(1)};
  return rope_rows(qkv, bias, cos, sin, pos, at, H, G, D, [c](int64_t) { return c; });
}

torch::Tensor qkv_rope(torch::Tensor qkv, torch::Tensor bias, torch::Tensor cos, torch::Tensor sin, torch::Tensor pos,
                       torch::Tensor k_cache, torch::Tensor v_cache, int64_t H) {
  return qkv_rope_at(qkv, bias, cos, sin, pos, pos, k_cache, v_cache, H);
}

// Several sequences' rows in one call (one parallel region instead of one per sequence): row r's keys/values go to
// k_caches[cache_of[r]], v_caches[cache_of[r]] at its position. The same arithmetic per row as qkv_rope.
torch::Tensor qkv_rope_many(torch::Tensor qkv, torch::Tensor bias, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor pos, std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
                            torch::Tensor cache_of, int64_t H) {
  TORCH_CHECK(!k_caches.empty(), "qkv_rope_many: no caches");
  const int64_t G = k_caches[0].size(0), D = k_caches[0].size(2);
  const auto rows = cache_refs(k_caches, v_caches, cache_of, qkv.size(0), G, D);
  return rope_rows(qkv, bias, cos, sin, pos, pos, H, G, D, [&rows](int64_t r) { return rows[r]; });
}

namespace {

constexpr int64_t KEY_CHUNK = 32;  // keys per chunk: their K (then V) rows stay in L1 while every head of a group reads them

// One row's group of query heads sharing a KV head: for each head h, softmax(q_h k / sqrt(D)) over the n keys
// key(0..n-1) (cache indices, in this order) times their values, into out + h D. Keys are taken a chunk at a time
// for every head of the group (each K and V row read from memory once per group instead of once per head), but each
// (head, key) score is the same chain of fmadds, and each head's output the same fmadds over the keys in order, as
// for that head alone: the same bits whoever calls it and however many heads share the pass (a tree node attending
// to its listed ancestors gets bitwise what its path fed as a chain gets).
template <class KeyAt>
void attend(const float* qv, int64_t heads, const float* K, const float* V, int64_t n, int64_t D, float scale,
            KeyAt key, std::vector<float>& scores, std::vector<float>& inv, std::vector<__m256>& acc, float* out) {
  const int64_t padded = (n + 7) / 8 * 8, W = D / 8;
  scores.resize(heads * padded);
  for (int64_t c0 = 0; c0 < n; c0 += KEY_CHUNK) {
    const int64_t c1 = std::min(n, c0 + KEY_CHUNK);
    for (int64_t h = 0; h < heads; ++h) {
      const float* q = qv + h * D;
      float* sc = scores.data() + h * padded;
      int64_t t = c0;
      for (; t + 4 <= c1; t += 4) {  // 4 independent chains; each score is the same chain of fmadds as below
        const float *k0 = K + key(t) * D, *k1 = K + key(t + 1) * D, *k2 = K + key(t + 2) * D, *k3 = K + key(t + 3) * D;
        __m256 d0 = _mm256_setzero_ps(), d1 = d0, d2 = d0, d3 = d0;
        for (int64_t j = 0; j < D; j += 8) {
          const __m256 x = _mm256_loadu_ps(q + j);
          d0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + j), d0);
          d1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k1 + j), d1);
          d2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k2 + j), d2);
          d3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k3 + j), d3);
        }
        sc[t] = hsum8(d0) * scale;
        sc[t + 1] = hsum8(d1) * scale;
        sc[t + 2] = hsum8(d2) * scale;
        sc[t + 3] = hsum8(d3) * scale;
      }
      for (; t < c1; ++t) {
        const float* kt = K + key(t) * D;
        __m256 d = _mm256_setzero_ps();
        for (int64_t j = 0; j < D; j += 8) d = _mm256_fmadd_ps(_mm256_loadu_ps(q + j), _mm256_loadu_ps(kt + j), d);
        sc[t] = hsum8(d) * scale;
      }
    }
  }
  inv.resize(heads);
  for (int64_t h = 0; h < heads; ++h) {  // each head's softmax weights (unnormalised) and 1 / their sum
    float* sc = scores.data() + h * padded;
    for (int64_t t = n; t < padded; ++t) sc[t] = -INFINITY;  // padding: weight 0
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (int64_t u = 0; u < padded; u += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(sc + u));
    const __m256 mx = _mm256_set1_ps(hmax8(vmax)), ninf = _mm256_set1_ps(-INFINITY);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t u = 0; u < padded; u += 8) {
      const __m256 s = _mm256_loadu_ps(sc + u);
      const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(s, mx)), _mm256_cmp_ps(s, ninf, _CMP_NEQ_OQ));
      _mm256_storeu_ps(sc + u, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    inv[h] = 1.f / hsum8(vsum);
  }
  acc.resize(heads * W);
  for (auto& a : acc) a = _mm256_setzero_ps();
  for (int64_t c0 = 0; c0 < n; c0 += KEY_CHUNK) {
    const int64_t c1 = std::min(n, c0 + KEY_CHUNK);
    for (int64_t h = 0; h < heads; ++h) {
      const float* sc = scores.data() + h * padded;
      __m256* a = acc.data() + h * W;
      for (int64_t t = c0; t < c1; ++t) {
        const __m256 w = _mm256_set1_ps(sc[t]);
        const float* vt = V + key(t) * D;
        for (int64_t j = 0; j < W; ++j) a[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 8 * j), a[j]);
      }
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    const __m256 vi = _mm256_set1_ps(inv[h]);
    for (int64_t j = 0; j < W; ++j) _mm256_storeu_ps(out + h * D + 8 * j, _mm256_mul_ps(acc[h * W + j], vi));
  }
}

void check_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  check_f32(q, 3, "q");
  check_f32(k_cache, 3, "k_cache");
  check_f32(v_cache, 3, "v_cache");
  const int64_t H = q.size(1), D = q.size(2), G = k_cache.size(0);
  check_width(D, "the head dim");
  TORCH_CHECK(k_cache.size(2) == D && v_cache.sizes() == k_cache.sizes() && G > 0 && H % G == 0,
              "attention: cache shapes disagree with q (G must divide H)");
}

// Every (row, KV head) of q over its cache, split across threads by (row, KV head), the query heads of a KV head
// together (attend): cache_of(r) -> row r's CacheRef; keys_of(r) -> (n, key) names the n cache indices key(0..n-1)
// row r attends to, in order. Returns (M, H D).
template <class CacheOf, class KeysOf>
torch::Tensor attend_rows(const torch::Tensor& q, int64_t G, CacheOf cache_of, KeysOf keys_of) {
  const int64_t M = q.size(0), H = q.size(1), D = q.size(2);
  auto out = torch::empty({M, H * D}, q.options());
  const float* Q = q.data_ptr<float>();
  float* O = out.data_ptr<float>();
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const int64_t group = H / G;
  at::parallel_for(0, M * G, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores, inv;  // scratch of this thread's calls
    std::vector<__m256> acc;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / G, g = i % G, first = (r * H + g * group) * D;  // the group's first query head
      const CacheRef c = cache_of(r);
      const auto [n, key] = keys_of(r);
      attend(Q + first, group, c.k + g * c.T * D, c.v + g * c.T * D, n, D, scale, key, scores, inv, acc, O + first);
    }
  });
  return out;
}

CacheRef only_cache(const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  return {k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), k_cache.size(1)};
}

// Causal attention: row r over positions 0..pos[r] of its cache rows[r] (checked here).
torch::Tensor causal_rows(const torch::Tensor& q, int64_t G, const std::vector<CacheRef>& rows, const torch::Tensor& pos) {
  const int64_t M = q.size(0);
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.is_contiguous() && pos.dim() == 1 && pos.size(0) == M,
              "attention: pos must be (M,) int64");
  const int64_t* P = pos.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r)
    TORCH_CHECK(P[r] >= 0 && P[r] < rows[r].T, "attention: position ", P[r], " outside the cache");
  return attend_rows(q, G, [&rows](int64_t r) { return rows[r]; },
                     [P](int64_t r) { return std::make_pair(P[r] + 1, [](int64_t t) { return t; }); });
}

}  // namespace

// q (M, H, D), k_cache/v_cache (G, T, D), pos (M): row r's head h attends to cached positions 0..pos[r] of KV head
// h / (H / G) with softmax(q k / sqrt(D)). Returns (M, H D). Each (row, head) is computed alone, in a fixed order.
torch::Tensor attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor pos) {
  check_attention(q, k_cache, v_cache);
  return causal_rows(q, k_cache.size(0), std::vector<CacheRef>(q.size(0), only_cache(k_cache, v_cache)), pos);
}

// Several sequences' rows in one call: row r attends to positions 0..pos[r] of k_caches[cache_of[r]] (and its
// values). The same arithmetic per (row, head) as `attention`.
torch::Tensor attention_many(torch::Tensor q, std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
                             torch::Tensor cache_of, torch::Tensor pos) {
  check_f32(q, 3, "q");
  TORCH_CHECK(!k_caches.empty(), "attention_many: no caches");
  const int64_t M = q.size(0), H = q.size(1), D = q.size(2), G = k_caches[0].size(0);
  check_width(D, "the head dim");
  TORCH_CHECK(G > 0 && H % G == 0, "attention: cache shapes disagree with q (G must divide H)");
  return causal_rows(q, G, cache_refs(k_caches, v_caches, cache_of, M, G, D), pos);
}

// Token trees: row r attends to cache positions 0..prefix[r] - 1, then to the cache indices
// extra[offsets[r] .. offsets[r + 1]) in that order (its ancestors in the tree, then itself). prefix (M), offsets
// (M + 1), extra (N) int64. The same arithmetic as `attention` over that key sequence.
torch::Tensor attention_at(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor prefix,
                           torch::Tensor offsets, torch::Tensor extra) {
  check_attention(q, k_cache, v_cache);
  const int64_t M = q.size(0), T = k_cache.size(1);
  auto is_index = [](const torch::Tensor& t, int64_t n) {
    return t.scalar_type() == at::kLong && t.is_contiguous() && t.dim() == 1 && (n < 0 || t.size(0) == n);
  };
  TORCH_CHECK(is_index(prefix, M) && is_index(offsets, M + 1) && is_index(extra, -1),
              "attention_at: prefix (M,), offsets (M + 1,) and extra (N,) must be int64");
  const int64_t *PRE = prefix.data_ptr<int64_t>(), *OFF = offsets.data_ptr<int64_t>(), *EX = extra.data_ptr<int64_t>();
  const int64_t N = extra.size(0);
  TORCH_CHECK(OFF[0] == 0, "attention_at: offsets must start at 0");
  for (int64_t r = 0; r < M; ++r)
    TORCH_CHECK(PRE[r] >= 0 && PRE[r] <= T && OFF[r] <= OFF[r + 1] && OFF[r + 1] <= N && PRE[r] + OFF[r + 1] - OFF[r] > 0,
                "attention_at: row ", r, " has no keys or bad offsets");
  for (int64_t j = 0; j < N; ++j) TORCH_CHECK(EX[j] >= 0 && EX[j] < T, "attention_at: key index ", EX[j], " outside the cache");
  const CacheRef c = only_cache(k_cache, v_cache);
  return attend_rows(q, k_cache.size(0), [c](int64_t) { return c; }, [PRE, OFF, EX](int64_t r) {
    const int64_t pre = PRE[r], *ex = EX + OFF[r] - pre;
    return std::make_pair(pre + OFF[r + 1] - OFF[r], [pre, ex](int64_t t) { return t < pre ? t : ex[t]; });
  });
}

// gate_up (M, 2I): gate columns then up columns -> (M, I) = silu(gate) * up, silu(x) = x / (1 + exp(-x))
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_f32(gate_up, 2, "gate_up");
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  check_width(I, "the intermediate size");
  TORCH_CHECK(gate_up.size(1) == 2 * I, "silu_mul: gate_up must have an even width");
  auto y = torch::empty({M, I}, gate_up.options());
  const float* X = gate_up.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *g = X + r * 2 * I, *u = g + I;
      for (int64_t j = 0; j < I; j += 8) {
        const __m256 gv = _mm256_loadu_ps(g + j);
        const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
        _mm256_storeu_ps(Y + r * I + j, _mm256_mul_ps(s, _mm256_loadu_ps(u + j)));
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "x (M, K), w (K), eps -> RMSNorm(x) * w, per row");
  m.def("qkv_rope", &qkv_rope, "biases + NEOX RoPE + KV-cache write; returns q (M, H, D)");
  m.def("qkv_rope_at", &qkv_rope_at, "qkv_rope with keys/values written at cache indices `at` (token trees)");
  m.def("attention", &attention, "causal GQA attention of each row over the cache up to its position -> (M, H D)");
  m.def("qkv_rope_many", &qkv_rope_many, "qkv_rope over several sequences' rows, row r's cache cache_of[r]");
  m.def("attention_many", &attention_many, "attention over several sequences' rows, row r's cache cache_of[r]");
  m.def("attention_at", &attention_at, "GQA attention of each row over its listed cache indices (token trees)");
  m.def("silu_mul", &silu_mul, "gate_up (M, 2I) -> silu(gate) * up (M, I)");
}
