// Multi-row products with llama.cpp's K-quant weights (Q4_K, Q6_K) on a CPU: y (M, N) = x (M, K) W^T, M = 1..any.
//
// The math is ggml's Q4_K x Q8_K and Q6_K x Q8_K dot products: each row of x is quantized per 256-block to int8
// with one float scale (quantize_row_q8_K_ref, bit for bit), the integer part of each block's dot product is
// exact, and only the float combination of blocks differs from ggml (its order, not its terms).
//
// Why: verifying k+1 draft tokens multiplies k+1 rows by every weight. One row is memory-bound (~1 GB of 4-bit
// weights per token); llama.cpp's CPU kernels cost ~1.8x for 2 rows and ~2.9x for 4 here. This kernel reads each
// weight block once, unpacks its nibbles once and multiplies them with up to 8 rows held in registers.
//
// Weight layout (repacked once from the GGUF's blocks by models/q4.py): per 256-block, "unpacked" byte u (0..255)
// holds element 32*l + 4*v + t of the block, where v = u / 32 (the 32-byte vector), l = (u % 32) / 4 (the 32-bit
// lane), t = u % 4. So every 32-bit lane l of every vector belongs to Q4_K's sub-block l (32 elements) and to
// Q6_K's sub-blocks 2l (vectors 0-3) or 2l+1 (vectors 4-7): integer dot products (maddubs / vpdpbusd) sum within
// one sub-block per lane and the sub-block scales apply once per lane. Activations are permuted the same way.
//   Q4_K: qs (N, B, 128) u8: low nibble = unpacked byte p, high nibble = unpacked byte p + 128
//         sm (N, B, 16) u8: 8 sub-block scales, then 8 sub-block mins (6-bit values)
//         dd (N, B, 2) f16: d, dmin
//   Q6_K: ql (N, B, 128) u8: low 4 bits, packed like Q4_K's qs
//         qh (N, B, 64) u8: bits 2c..2c+1 of byte p = high 2 bits of unpacked byte p + 64 c
//         sc (N, B, 16) i8: the 16 sub-block scales (natural order); d (N, B) f16
//
// Two code paths: AVX2 (maddubs) and AVX-512 VNNI (vpdpbusd), chosen at run time. Both produce the same 8 int32
// per block and row and then run identical float instructions, so their results are bitwise equal; and each row's
// float accumulation is the same whatever the number of rows computed together (bitwise row-count invariance).
// Limitations: K must be a multiple of 256; no bias (add it outside); rows beyond 8 go in further passes of 8
// over the same weights (hot in cache per tile of output columns).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>

namespace {

constexpr int QK = 256;     // weights per block
constexpr int MAX_R = 8;    // rows per pass over the weights
constexpr int64_t TILE = 16;  // output columns per tile (all row groups run over a tile before the next)

#define VNNI_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

struct Act {  // Q8_K activations, kernel order
  const int8_t* q;    // (M, B, 256)
  const float* d;     // (M, B)
  const int16_t* bs;  // (M, B, 16): sums of 16 consecutive quants (natural order), as ggml's bsums
  int64_t B;
};

struct Q4W {
  const uint8_t* qs;
  const uint8_t* sm;
  const uint16_t* dd;
  int64_t B;
};

struct Q6W {
  const uint8_t* ql;
  const uint8_t* qh;
  const int8_t* sc;
  const uint16_t* d;
  int64_t B;
};

inline float fp16(uint16_t h) { return _cvtsh_ss(h); }

inline float hsum8(__m256 v) {  // fixed order: both paths and every row count use this one
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// ---------------------------------------------------------------- activations: ggml's quantize_row_q8_K_ref
void quantize_block(const float* x, int8_t* q, float* d, int16_t* bs) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 vmax = _mm256_setzero_ps();
  for (int j = 0; j < QK; j += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(x + j), absmask));
  float lanes[8];
  _mm256_storeu_ps(lanes, vmax);
  float amax = 0.f;
  for (float a : lanes) amax = a > amax ? a : amax;
  if (!(amax > 0.f)) {  // all zero (ggml tests !amax)
    std::memset(q, 0, QK);
    std::memset(bs, 0, 16 * sizeof(int16_t));
    *d = 0.f;
    return;
  }
  int first = 0;  // ggml keeps the first element of largest magnitude, with its sign
  while (std::fabs(x[first]) != amax) ++first;
  const float iscale = -127.f / x[first];
  const __m256 vs = _mm256_set1_ps(iscale);
  const __m256i top = _mm256_set1_epi32(127);
  alignas(32) int8_t nat[QK];  // natural order
  for (int j = 0; j < QK; j += 32) {
    __m256i a = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(vs, _mm256_loadu_ps(x + j))), top);  // round half even
    __m256i b = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(vs, _mm256_loadu_ps(x + j + 8))), top);
    __m256i c = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(vs, _mm256_loadu_ps(x + j + 16))), top);
    __m256i e = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(vs, _mm256_loadu_ps(x + j + 24))), top);
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, e));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_store_si256(reinterpret_cast<__m256i*>(nat + j), p);
  }
  for (int g = 0; g < 16; ++g) {
    int s = 0;
    for (int i = 0; i < 16; ++i) s += nat[16 * g + i];
    bs[g] = static_cast<int16_t>(s);
  }
  int32_t words[64];  // kernel order: word (v, l) <- natural word (l, v)
  std::memcpy(words, nat, QK);
  int32_t out[64];
  for (int l = 0; l < 8; ++l)
    for (int v = 0; v < 8; ++v) out[8 * v + l] = words[8 * l + v];
  std::memcpy(q, out, QK);
  *d = 1.f / iscale;
}

// ---------------------------------------------------------------- Q4_K
// Per block: isum lane l = sc_l * (dot of sub-block l), imin lane l = m_l * (sum of sub-block l's quants);
// acc += isum * (d * dy) - imin * (dmin * dy).
inline void q4_finish(__m256& acc, __m256i isum, __m256i bs, __m256i mins, float d, float dmin, float dy) {
  const __m256i imin = _mm256_madd_epi16(bs, mins);
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d * dy), acc);
  acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin), _mm256_set1_ps(dmin * dy), acc);
}

inline __m256i pairs(const uint8_t* p) {  // 8 u8 -> int32 lanes holding (x, x) as two int16
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
}

template <int R>
void q4_avx2(const Act& a, const Q4W& w, float* Y, int64_t N, int64_t n0, int64_t n1, int64_t r0) {
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  const int64_t B = w.B;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t nb = n * B + b;
      const uint8_t* qs = w.qs + nb * 128;
      __m256i wv[8];
      for (int i = 0; i < 4; ++i) {
        const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * i));
        wv[i] = _mm256_and_si256(p, m4);
        wv[i + 4] = _mm256_and_si256(_mm256_srli_epi16(p, 4), m4);
      }
      const __m256i sc = pairs(w.sm + nb * 16), mins = pairs(w.sm + nb * 16 + 8);
      const float d = fp16(w.dd[2 * nb]), dmin = fp16(w.dd[2 * nb + 1]);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t rb = (r0 + r) * B + b;
        const __m256i* y = reinterpret_cast<const __m256i*>(a.q + rb * QK);
        __m256i p = _mm256_maddubs_epi16(wv[0], _mm256_loadu_si256(y));  // int16 pairs, |.| <= 2*15*127
        for (int v = 1; v < 8; ++v) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(wv[v], _mm256_loadu_si256(y + v)));
        const __m256i isum = _mm256_madd_epi16(p, sc);  // |p| <= 8*3810 < 2^15: no overflow
        q4_finish(acc[r], isum, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bs + rb * 16)), mins, d, dmin,
                  a.d[rb]);
      }
    }
    for (int r = 0; r < R; ++r) Y[(r0 + r) * N + n] = hsum8(acc[r]);
  }
}

template <int R>
VNNI_TARGET void q4_vnni(const Act& a, const Q4W& w, float* Y, int64_t N, int64_t n0, int64_t n1, int64_t r0) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const int64_t B = w.B;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t nb = n * B + b;
      const uint8_t* qs = w.qs + nb * 128;
      const __m512i p0 = _mm512_loadu_si512(qs), p1 = _mm512_loadu_si512(qs + 64);
      const __m512i w0 = _mm512_and_si512(p0, m4), w1 = _mm512_and_si512(p1, m4);  // unpacked bytes 0-63, 64-127
      const __m512i w2 = _mm512_and_si512(_mm512_srli_epi16(p0, 4), m4);  // 128-191
      const __m512i w3 = _mm512_and_si512(_mm512_srli_epi16(p1, 4), m4);  // 192-255
      const __m256i sc8 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.sm + nb * 16)));
      const __m512i sc = _mm512_inserti64x4(_mm512_castsi256_si512(sc8), sc8, 1);  // (sc, 0) per lane, both halves
      const __m256i mins = pairs(w.sm + nb * 16 + 8);
      const float d = fp16(w.dd[2 * nb]), dmin = fp16(w.dd[2 * nb + 1]);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t rb = (r0 + r) * B + b;
        const int8_t* y = a.q + rb * QK;
        __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, _mm512_loadu_si512(y));
        s = _mm512_dpbusd_epi32(s, w1, _mm512_loadu_si512(y + 64));
        s = _mm512_dpbusd_epi32(s, w2, _mm512_loadu_si512(y + 128));
        s = _mm512_dpbusd_epi32(s, w3, _mm512_loadu_si512(y + 192));  // lane i: sub-block i % 8, |.| <= 16*15*127
        s = _mm512_madd_epi16(s, sc);  // low int16 holds the whole value: * sc exactly
        const __m256i isum = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
        q4_finish(acc[r], isum, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bs + rb * 16)), mins, d, dmin,
                  a.d[rb]);
      }
    }
    for (int r = 0; r < R; ++r) Y[(r0 + r) * N + n] = hsum8(acc[r]);
  }
}

// ---------------------------------------------------------------- Q6_K
// Per block: isum lane l = sc_2l (dot_2l - 32 bs_2l) + sc_2l+1 (dot_2l+1 - 32 bs_2l+1) (|.| < 2^24: exact in
// float); acc += isum * (d * dy).
inline void q6_finish(__m256& acc, __m256i isum, __m256i bs, __m256i sc16, float d, float dy) {
  isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d * dy), acc);
}

template <int R>
void q6_avx2(const Act& a, const Q6W& w, float* Y, int64_t N, int64_t n0, int64_t n1, int64_t r0) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  const int64_t B = w.B;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t nb = n * B + b;
      const uint8_t* ql = w.ql + nb * 128;
      const uint8_t* qh = w.qh + nb * 64;
      const __m256i h0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
      const __m256i h1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32));
      const __m256i high[8] = {  // bits 2c..2c+1 -> bits 4-5, c = v / 2, qh vector v % 2
          _mm256_and_si256(_mm256_slli_epi16(h0, 4), m30), _mm256_and_si256(_mm256_slli_epi16(h1, 4), m30),
          _mm256_and_si256(_mm256_slli_epi16(h0, 2), m30), _mm256_and_si256(_mm256_slli_epi16(h1, 2), m30),
          _mm256_and_si256(h0, m30), _mm256_and_si256(h1, m30),
          _mm256_and_si256(_mm256_srli_epi16(h0, 2), m30), _mm256_and_si256(_mm256_srli_epi16(h1, 2), m30)};
      __m256i wv[8];
      for (int i = 0; i < 4; ++i) {
        const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32 * i));
        wv[i] = _mm256_or_si256(_mm256_and_si256(p, m4), high[i]);
        wv[i + 4] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(p, 4), m4), high[i + 4]);
      }
      const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc + nb * 16)));
      const __m256i sce = _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(sc16, 0xA0), 0xA0);  // (sc_2l, sc_2l)
      const __m256i sco = _mm256_shufflehi_epi16(_mm256_shufflelo_epi16(sc16, 0xF5), 0xF5);  // (sc_2l+1, sc_2l+1)
      const float d = fp16(w.d[nb]);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t rb = (r0 + r) * B + b;
        const __m256i* y = reinterpret_cast<const __m256i*>(a.q + rb * QK);
        __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(wv[0], _mm256_loadu_si256(y)), sce);  // |pair| <= 2*63*127
        for (int v = 1; v < 8; ++v)
          s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(wv[v], _mm256_loadu_si256(y + v)),
                                                    v < 4 ? sce : sco));
        q6_finish(acc[r], s, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bs + rb * 16)), sc16, d, a.d[rb]);
      }
    }
    for (int r = 0; r < R; ++r) Y[(r0 + r) * N + n] = hsum8(acc[r]);
  }
}

template <int R>
VNNI_TARGET void q6_vnni(const Act& a, const Q6W& w, float* Y, int64_t N, int64_t n0, int64_t n1, int64_t r0) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  const int64_t B = w.B;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t nb = n * B + b;
      const uint8_t* ql = w.ql + nb * 128;
      const __m512i l0 = _mm512_loadu_si512(ql), l1 = _mm512_loadu_si512(ql + 64);
      const __m512i h = _mm512_loadu_si512(w.qh + nb * 64);
      const __m512i w0 = _mm512_or_si512(_mm512_and_si512(l0, m4), _mm512_and_si512(_mm512_slli_epi16(h, 4), m30));
      const __m512i w1 = _mm512_or_si512(_mm512_and_si512(l1, m4), _mm512_and_si512(_mm512_slli_epi16(h, 2), m30));
      const __m512i w2 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), m4), _mm512_and_si512(h, m30));
      const __m512i w3 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), m4),
                                         _mm512_and_si512(_mm512_srli_epi16(h, 2), m30));
      const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.sc + nb * 16)));
      const __m256i sce = _mm256_srai_epi32(_mm256_slli_epi32(sc16, 16), 16);  // int32 sc_2l
      const __m256i sco = _mm256_srai_epi32(sc16, 16);                          // int32 sc_2l+1
      const float d = fp16(w.d[nb]);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int64_t rb = (r0 + r) * B + b;
        const int8_t* y = a.q + rb * QK;
        __m512i e = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, _mm512_loadu_si512(y));  // vectors 0-3: even
        e = _mm512_dpbusd_epi32(e, w1, _mm512_loadu_si512(y + 64));
        __m512i o = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w2, _mm512_loadu_si512(y + 128));  // 4-7: odd
        o = _mm512_dpbusd_epi32(o, w3, _mm512_loadu_si512(y + 192));
        const __m256i e8 = _mm256_add_epi32(_mm512_castsi512_si256(e), _mm512_extracti64x4_epi64(e, 1));
        const __m256i o8 = _mm256_add_epi32(_mm512_castsi512_si256(o), _mm512_extracti64x4_epi64(o, 1));
        const __m256i s = _mm256_add_epi32(_mm256_mullo_epi32(e8, sce), _mm256_mullo_epi32(o8, sco));
        q6_finish(acc[r], s, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bs + rb * 16)), sc16, d, a.d[rb]);
      }
    }
    for (int r = 0; r < R; ++r) Y[(r0 + r) * N + n] = hsum8(acc[r]);
  }
}

// ---------------------------------------------------------------- dispatch
bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

// isa: 0 = best available, 1 = AVX2, 2 = AVX-512 VNNI (an error where the CPU lacks it)
bool use_vnni(int64_t isa) {
  static const bool have = cpu_has_vnni();
  TORCH_CHECK(isa >= 0 && isa <= 2, "q4_kernel: isa must be 0 (best), 1 (avx2) or 2 (avx512_vnni)");
  TORCH_CHECK(isa != 2 || have, "q4_kernel: this CPU has no AVX-512 VNNI");
  return isa == 2 || (isa == 0 && have);
}

template <class W>
using RowsFn = void (*)(const Act&, const W&, float*, int64_t, int64_t, int64_t, int64_t);

template <class W, RowsFn<W>... Fns>
struct Table {  // the kernel for R = 1..MAX_R rows
  static constexpr RowsFn<W> fn[MAX_R] = {Fns...};
};
using Q4Avx2 = Table<Q4W, q4_avx2<1>, q4_avx2<2>, q4_avx2<3>, q4_avx2<4>, q4_avx2<5>, q4_avx2<6>, q4_avx2<7>, q4_avx2<8>>;
using Q4Vnni = Table<Q4W, q4_vnni<1>, q4_vnni<2>, q4_vnni<3>, q4_vnni<4>, q4_vnni<5>, q4_vnni<6>, q4_vnni<7>, q4_vnni<8>>;
using Q6Avx2 = Table<Q6W, q6_avx2<1>, q6_avx2<2>, q6_avx2<3>, q6_avx2<4>, q6_avx2<5>, q6_avx2<6>, q6_avx2<7>, q6_avx2<8>>;
using Q6Vnni = Table<Q6W, q6_vnni<1>, q6_vnni<2>, q6_vnni<3>, q6_vnni<4>, q6_vnni<5>, q6_vnni<6>, q6_vnni<7>, q6_vnni<8>>;

// Output columns in tiles of TILE split across threads; within a tile, rows in groups of MAX_R (the same code
// for a row whatever group it is in).
template <class W>
void run_rows(const Act& a, const W& w, float* Y, int64_t M, int64_t N, const RowsFn<W>* fns) {
  at::parallel_for(0, (N + TILE - 1) / TILE, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * TILE, n1 = std::min(N, n0 + TILE);
      for (int64_t r0 = 0; r0 < M; r0 += MAX_R) fns[std::min<int64_t>(MAX_R, M - r0) - 1](a, w, Y, N, n0, n1, r0);
    }
  });
}

void check_u8(const torch::Tensor& t, int64_t N, int64_t B, int64_t last, const char* name, at::ScalarType type) {
  TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.dim() == 3 && t.size(0) == N && t.size(1) == B &&
                  t.size(2) == last,
              "q4_kernel: ", name, " must be a contiguous (", N, ", ", B, ", ", last, ") tensor of ", type);
}

Act check_act(const torch::Tensor& q, const torch::Tensor& d, const torch::Tensor& bs) {
  TORCH_CHECK(q.dim() == 3 && q.size(2) == QK && q.scalar_type() == at::kChar && q.is_contiguous(),
              "q4_kernel: activation quants must be a contiguous (M, B, 256) int8 tensor");
  const int64_t M = q.size(0), B = q.size(1);
  TORCH_CHECK(M >= 1, "q4_kernel: at least one row");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.dim() == 2 && d.size(0) == M && d.size(1) == B,
              "q4_kernel: activation scales must be a contiguous (M, B) float32 tensor");
  check_u8(bs, M, B, 16, "activation block sums", at::kShort);
  return {q.data_ptr<int8_t>(), d.data_ptr<float>(), bs.data_ptr<int16_t>(), B};
}

}  // namespace

std::vector<torch::Tensor> quantize_q8k(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "quantize_q8k: x must be (M, K) float32");
  TORCH_CHECK(x.size(1) % QK == 0 && x.size(1) > 0, "quantize_q8k: K must be a positive multiple of 256");
  x = x.contiguous();
  const int64_t M = x.size(0), B = x.size(1) / QK;
  auto q = torch::empty({M, B, QK}, x.options().dtype(at::kChar));
  auto d = torch::empty({M, B}, x.options());
  auto bs = torch::empty({M, B, 16}, x.options().dtype(at::kShort));
  const float* X = x.data_ptr<float>();
  int8_t* Q = q.data_ptr<int8_t>();
  float* D = d.data_ptr<float>();
  int16_t* S = bs.data_ptr<int16_t>();
  at::parallel_for(0, M * B, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) quantize_block(X + i * QK, Q + i * QK, D + i, S + i * 16);
  });
  return {q, d, bs};
}

torch::Tensor q4k_matmul(torch::Tensor q, torch::Tensor d, torch::Tensor bs, torch::Tensor qs, torch::Tensor sm,
                         torch::Tensor dd, int64_t isa) {
  const Act a = check_act(q, d, bs);
  const int64_t M = q.size(0), B = a.B, N = qs.size(0);
  check_u8(qs, N, B, 128, "qs", at::kByte);
  check_u8(sm, N, B, 16, "sm", at::kByte);
  check_u8(dd, N, B, 2, "dd", at::kHalf);
  const Q4W w{qs.data_ptr<uint8_t>(), sm.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(dd.data_ptr()), B};
  auto y = torch::empty({M, N}, d.options());
  run_rows(a, w, y.data_ptr<float>(), M, N, use_vnni(isa) ? Q4Vnni::fn : Q4Avx2::fn);
  return y;
}

torch::Tensor q6k_matmul(torch::Tensor q, torch::Tensor d, torch::Tensor bs, torch::Tensor ql, torch::Tensor qh,
                         torch::Tensor sc, torch::Tensor wd, int64_t isa) {
  const Act a = check_act(q, d, bs);
  const int64_t M = q.size(0), B = a.B, N = ql.size(0);
  check_u8(ql, N, B, 128, "ql", at::kByte);
  check_u8(qh, N, B, 64, "qh", at::kByte);
  check_u8(sc, N, B, 16, "sc", at::kChar);
  TORCH_CHECK(wd.scalar_type() == at::kHalf && wd.is_contiguous() && wd.dim() == 2 && wd.size(0) == N &&
                  wd.size(1) == B,
              "q4_kernel: d must be a contiguous (N, B) float16 tensor");
  const Q6W w{ql.data_ptr<uint8_t>(), qh.data_ptr<uint8_t>(), sc.data_ptr<int8_t>(),
              reinterpret_cast<const uint16_t*>(wd.data_ptr()), B};
  auto y = torch::empty({M, N}, d.options());
  run_rows(a, w, y.data_ptr<float>(), M, N, use_vnni(isa) ? Q6Vnni::fn : Q6Avx2::fn);
  return y;
}

bool has_vnni() { return cpu_has_vnni(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_q8k", &quantize_q8k, "x (M, K) f32 -> Q8_K activations (q (M,B,256) i8, d (M,B) f32, bs (M,B,16) i16)");
  m.def("q4k_matmul", &q4k_matmul, "Q8_K activations x repacked Q4_K weights^T -> (M, N) f32");
  m.def("q6k_matmul", &q6k_matmul, "Q8_K activations x repacked Q6_K weights^T -> (M, N) f32");
  m.def("has_vnni", &has_vnni, "whether this CPU runs the AVX-512 VNNI path");
}
