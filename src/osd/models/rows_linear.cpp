// y = x W^T + b for the few rows that decoding (1) and verification (k+1) multiply, on a CPU with AVX2/FMA.
// Such products are memory-bound: the ideal cost is one pass over W, whatever the row count. Each output
// column n reads W's row n once and updates one 8-wide accumulator per input row (M <= 8 rows fit in the
// 16 ymm registers); columns are split across threads. General-purpose GEMMs (MKL, oneDNN) re-read or
// repack W for M >= 2 and cost ~2x per extra row here; this kernel costs ~1.2x for 5 rows (models/prepack.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// M rows, U independent accumulator sets (hides FMA latency when M is small).
template <int M, int U>
static void columns(const float* X, const float* W, const float* B, float* Y, int64_t K, int64_t N,
                    int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* w = W + n * K;
    __m256 acc[U][M];
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < M; ++m) acc[u][m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 * U <= K; k += 8 * U) {
      for (int u = 0; u < U; ++u) {
        const __m256 wv = _mm256_loadu_ps(w + k + 8 * u);
        for (int m = 0; m < M; ++m)
          acc[u][m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(X + m * K + k + 8 * u), acc[u][m]);
      }
    }
    for (int m = 0; m < M; ++m) {
      __m256 s = acc[0][m];
      for (int u = 1; u < U; ++u) s = _mm256_add_ps(s, acc[u][m]);
      float t = hsum(s);
      for (int64_t j = k; j < K; ++j) t += w[j] * X[m * K + j];
      Y[m * N + n] = t + (B ? B[n] : 0.f);
    }
  }
}

// Checks shared by both entry points; returns the bias pointer (nullptr: none), `keep` holds its tensor.
static const float* check_rows(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                               int64_t max_rows, torch::Tensor& keep, const char* name) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), name, ": x (M, K), w (N, K)");
  TORCH_CHECK(x.scalar_type() == at::kFloat, name, ": x must be float32");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= max_rows, name, ": 1 to ", max_rows, " rows");
  TORCH_CHECK(w.is_contiguous(), name, ": w must be contiguous");
  if (!bias.has_value() || !bias->defined()) return nullptr;
  keep = bias->contiguous();
  TORCH_CHECK(keep.scalar_type() == at::kFloat && keep.numel() == w.size(0), name, ": bias (N,) float32");
  return keep.data_ptr<float>();
}

torch::Tensor rows_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(w.scalar_type() == at::kFloat, "rows_linear: float32 only");
  torch::Tensor b;
  const float* B = check_rows(x, w, bias, 8, b, "rows_linear");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* X = x.data_ptr<float>();
  const float* W = w.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1: columns<1, 4>(X, W, B, Y, K, N, n0, n1); break;
      case 2: columns<2, 2>(X, W, B, Y, K, N, n0, n1); break;
      case 3: columns<3, 2>(X, W, B, Y, K, N, n0, n1); break;
      case 4: columns<4, 2>(X, W, B, Y, K, N, n0, n1); break;
      case 5: columns<5, 1>(X, W, B, Y, K, N, n0, n1); break;
      case 6: columns<6, 1>(X, W, B, Y, K, N, n0, n1); break;
      case 7: columns<7, 1>(X, W, B, Y, K, N, n0, n1); break;
      default: columns<8, 1>(X, W, B, Y, K, N, n0, n1); break;
    }
  });
  return y;
}

// The same for int8 weights with one float scale per output row: y = (x . W8[n]) * scale[n] + b[n].
// Weight-only quantisation: activations stay fp32, so it is more accurate than dynamic int8, and it
// moves 4x fewer bytes than fp32 (drafts only: their precision changes acceptance, never the output).
template <int M, int U>
static void columns_int8(const float* X, const int8_t* W, const float* S, const float* B, float* Y, int64_t K,
                         int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* w = W + n * K;
    __m256 acc[U][M];
    for (int u = 0; u < U; ++u)
      for (int m = 0; m < M; ++m) acc[u][m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 * U <= K; k += 8 * U) {
      for (int u = 0; u < U; ++u) {
        const __m128i w8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k + 8 * u));  // 8 int8
        const __m256 wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(w8));
        for (int m = 0; m < M; ++m)
          acc[u][m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(X + m * K + k + 8 * u), acc[u][m]);
      }
    }
    for (int m = 0; m < M; ++m) {
      __m256 s = acc[0][m];
      for (int u = 1; u < U; ++u) s = _mm256_add_ps(s, acc[u][m]);
      float t = hsum(s);
      for (int64_t j = k; j < K; ++j) t += float(w[j]) * X[m * K + j];
      Y[m * N + n] = t * S[n] + (B ? B[n] : 0.f);
    }
  }
}

torch::Tensor rows_linear_int8(torch::Tensor x, torch::Tensor w, torch::Tensor scale, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(w.scalar_type() == at::kChar && scale.scalar_type() == at::kFloat, "rows_linear_int8: w int8, scale float32");
  TORCH_CHECK(scale.is_contiguous() && scale.numel() == w.size(0), "rows_linear_int8: scale (N,)");
  torch::Tensor b;
  const float* B = check_rows(x, w, bias, 4, b, "rows_linear_int8");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* X = x.data_ptr<float>();
  const int8_t* W = w.data_ptr<int8_t>();
  const float* S = scale.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1: columns_int8<1, 4>(X, W, S, B, Y, K, N, n0, n1); break;
      case 2: columns_int8<2, 4>(X, W, S, B, Y, K, N, n0, n1); break;
      case 3: columns_int8<3, 2>(X, W, S, B, Y, K, N, n0, n1); break;
      default: columns_int8<4, 2>(X, W, S, B, Y, K, N, n0, n1); break;
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rows_linear", &rows_linear, "y = x w^T + b for 1-8 rows (AVX2/FMA)",
        py::arg("x"), py::arg("w"), py::arg("bias") = py::none());
  m.def("rows_linear_int8", &rows_linear_int8, "y = (x w8^T) * scale + b for 1-4 rows (AVX2/FMA)",
        py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("bias") = py::none());
}
