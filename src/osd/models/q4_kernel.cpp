// Multi-row products with llama.cpp's quantized weights (Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) on a CPU:
// y (M, N) = x (M, K) W^T, M = 1..any. A type not listed is not converted into one that is: the caller says so.
//
// The math is ggml's: K-quants x Q8_K (each row of x quantized per 256-block to int8 with one float scale,
// quantize_row_q8_K_ref, bit for bit) and the 32-weight types x per-32 int8 quants (as ggml's Q8_0 / Q8_1, except
// that the scale stays float32 and ties round to even); the integer part of each block's dot product is exact, and
// only the float combination of blocks differs from ggml (its order, not its terms).
//
// Why: verifying k+1 draft tokens multiplies k+1 rows by every weight. One row is memory-bound (~1 GB of 4-bit
// weights per token); llama.cpp's CPU kernels cost ~1.8x for 2 rows and ~2.9x for 4 here. This kernel reads each
// weight block once, unpacks its nibbles once and multiplies them with up to 8 rows held in registers.
//
// Q4_K layout (repacked once from the GGUF's blocks by models/q4.py), columns interleaved: output columns in tiles of
// 16 (N padded with zero columns to a multiple of 16), per (tile t, block b), index tb = t B + b, stored tile-major
// so a tile's blocks stream through memory in order:
//   qs (T B, 2048) u8: 32 lines of 64 bytes; line 4 l + h holds, in its 4-byte lane i, column i's 4 weights
//         32 l + 4 h + (0..3) of block b in its low nibbles and 32 l + 4 (h + 4) + (0..3) in its high nibbles
//         (l = the 32-weight sub-block). So one vpdpbusd of an unpacked line against a row's 4 activations of those
//         positions (broadcast) adds 4 products to each of the 16 columns' sums: lane i = column i throughout.
//   sm (T B, 256) u8: the 16 columns' 6-bit sub-block scales (l-major: byte 16 l + i), then their mins as int16
//         pairs for vpdpwssd (byte 32 p + 2 i + j = min 2 p + j of column i)
//   dd (T B, 32) f16: the 16 columns' d, then their dmin
// Per (row, block, 16 columns) the integer sums are exact: isum_i = sum_l sc_l dot_l (|.| < 2^25) and
// imin_i = sum_l m_l bsum_l (the activations' sub-block sums); then two float steps per lane:
// acc += isum * (d dy); acc -= imin * (dmin dy). No horizontal sums: lane i is column i's result.
// Q6_K, the same interleaving: ql (T B, 2048) u8 the low 4 bits as Q4_K's qs; qh (T B, 1024) u8: 16 lines of 64
// bytes, line 2 l + j holding in bits 2c..2c+1 of its byte the high 2 bits of the same byte of group v = 4 j + c
// (so line 4 l + h's low nibbles pair with line 2 l's bits 2h, its high nibbles with line 2 l + 1's); sc (T B, 256)
// i8 the 16 columns' 16 signed sub-block scales (s-major); d (T B, 16) f16. Q5_K: Q4_K's qs, sm, dd and qh (T B, 512)
// u8: line l's byte holds in bit v the fifth bit of the same byte of group (l, v) (unpacked into bit 4 of a nibble).
// The 32-weight types (a 256-block is 8 GGUF blocks, sub-block l = GGUF block l): Q8_0 qs (T B, 4096) int8, line 8 l
// + v's lane i = column i's weights 32 l + 4 v + (0..3); Q4_0 / Q4_1 qs as Q4_K's; d (T B, 128) f16 (16 l + i), Q4_1
// then its m (T B, 128 more); Q5_0 / Q5_1 as Q4_0 / Q4_1 plus qh as Q5_K's. Per (row, sub-block, 16 columns): one
// exact integer dot product, one float step (with m: two). Activations are in kernel order: 4-byte group 8 v + l
// holds weights 32 l + 4 v + (0..3) of the block.
//
// Two code paths: AVX2 (maddubs, 8 columns a vector) and AVX-512 VNNI (vpdpbusd, 16), chosen at run time. Both
// compute the same exact int32 sums per (row, block, column) and then run identical float instructions lane by lane,
// so their results are bitwise equal; and each row's float accumulation is the same whatever the number of rows
// computed together (bitwise row-count invariance).
// Limitations: K must be a multiple of 256 (models/q4.py pads the 32-weight types' rows with zero blocks); no bias
// (add it outside); rows beyond 8 go in further passes of 8 over the same weights (hot in cache per tile of columns).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

constexpr int QK = 256;       // weights per block
constexpr int MAX_R = 8;      // rows per pass over the weights
constexpr int64_t TILE = 16;  // output columns per tile: the weight layout stores a tile's blocks together
constexpr int REC = 704;      // bytes per activation record (one row, one block; a multiple of 64), see Rec

#define VNNI_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

// One row's 256-block of activations, quantized twice, and what the kernels derive from it once per row instead of
// once per weight row. As Q8_K (one scale per 256, for the K-quants, as llama.cpp): the quants and the sums of its
// sub-blocks' quants, as Q4_K's mins and Q6_K's -32 offset need them, in integers. And per 32-weight sub-block with
// its own scale (the 32-block types Q8_0, Q4_0, Q4_1, as llama.cpp's Q8_0 / Q8_1 activations): quants and their sums.
struct Rec {
  int8_t q[QK];     // Q8_K quants, kernel order
  int32_t nbs[16];  // -32 * (sum of the quants of 16-element sub-block 2l) for l = 0..7, then of sub-block 2l+1
  float d;          // row block = d * q
  int16_t bs32[8];  // sums of the quants of 32-element sub-block l (Q4_K's mins)
  uint8_t pad[44];  // q32 starts at byte 384 (a cache line)
  int8_t q32[QK];   // per-32 quants, kernel order: sub-block l of the row block = d32[l] * (its quants)
  float d32[8];
  int32_t s32[8];   // sums of the per-32 quants of sub-block l (Q4_0's -8 offset, Q4_1's m, Q8_0's unsigned shift)
};
static_assert(sizeof(Rec) == REC, "activation record size");

struct Q4W {  // per (tile, block): qs 2048 bytes, sm 256 bytes, dd 32 halves (see the layout above)
  const uint8_t* qs;
  const uint8_t* sm;
  const uint16_t* dd;
  int64_t B;
  const uint8_t* qh;  // Q5_K: the fifth bits, 512 bytes (nullptr for Q4_K)
};

struct Q6W {  // per (tile, block): ql 2048 bytes, qh 1024 bytes, sc 256 bytes, d 16 halves (see the layout above)
  const uint8_t* ql;
  const uint8_t* qh;
  const int8_t* sc;
  const uint16_t* d;
  int64_t B;
};

// ---------------------------------------------------------------- activations
// 32 floats -> 32 int8 quants round(x * scale) (half to even), clamped to [-127, 127], natural order
inline void quantize_32(const float* x, __m256 scale, int8_t* out) {
  const __m256i top = _mm256_set1_epi32(127), bottom = _mm256_set1_epi32(-127);
  __m256i v[4];
  for (int j = 0; j < 4; ++j)
    v[j] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(scale, _mm256_loadu_ps(x + 8 * j))), top),
                            bottom);
  __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), p);
}

inline float abs_max(const float* x, int n) {
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 vmax = _mm256_setzero_ps();
  for (int j = 0; j < n; j += 8) vmax = _mm256_max_ps(vmax, _mm256_and_ps(_mm256_loadu_ps(x + j), absmask));
  float lanes[8];
  _mm256_storeu_ps(lanes, vmax);
  float amax = 0.f;
  for (float a : lanes) amax = a > amax ? a : amax;
  return amax;
}

// natural order -> kernel order: 4-byte word (v, l) <- natural word (l, v)
inline void to_kernel_order(const int8_t* nat, int8_t* out) {
  int32_t words[64], perm[64];
  std::memcpy(words, nat, QK);
  for (int l = 0; l < 8; ++l)
    for (int v = 0; v < 8; ++v) perm[8 * v + l] = words[8 * l + v];
  std::memcpy(out, perm, QK);
}

// Q8_K as ggml's quantize_row_q8_K_ref (bit for bit); per 32 as its quantize_row_q8_0_ref (d = amax / 127, quants
// x / d rounded) except that d stays float32 and ties round to even
void quantize_block(const float* x, Rec* rec) {
  std::memset(rec, 0, sizeof(Rec));
  const float amax = abs_max(x, QK);
  if (!(amax > 0.f)) return;  // all zero (ggml tests !amax): d = 0, quants 0
  int first = 0;  // ggml keeps the first element of largest magnitude, with its sign
  while (std::fabs(x[first]) != amax) ++first;
  const float iscale = -127.f / x[first];
  alignas(32) int8_t nat[QK];  // natural order
  for (int j = 0; j < QK; j += 32) quantize_32(x + j, _mm256_set1_ps(iscale), nat + j);  // 127 only at the top
  rec->d = 1.f / iscale;
  int bs[16];  // ggml's bsums: sums of 16 consecutive quants
  for (int g = 0; g < 16; ++g) {
    bs[g] = 0;
    for (int i = 0; i < 16; ++i) bs[g] += nat[16 * g + i];
  }
  for (int l = 0; l < 8; ++l) {
    rec->bs32[l] = static_cast<int16_t>(bs[2 * l] + bs[2 * l + 1]);  // |.| <= 32 * 127
    rec->nbs[l] = -32 * bs[2 * l];
    rec->nbs[8 + l] = -32 * bs[2 * l + 1];
  }
  to_kernel_order(nat, rec->q);
  for (int l = 0; l < 8; ++l) {
    const float am = abs_max(x + 32 * l, 32);
    rec->d32[l] = am / 127.f;
    const float id = am > 0.f ? 1.f / rec->d32[l] : 0.f;
    quantize_32(x + 32 * l, _mm256_set1_ps(id), nat + 32 * l);
    int sum = 0;
    for (int i = 0; i < 32; ++i) sum += nat[32 * l + i];
    rec->s32[l] = sum;
  }
  to_kernel_order(nat, rec->q32);
}

// Weights stream in layout order; fetching them PREFETCH bytes ahead hides more of the memory latency than the
// hardware prefetcher alone when many rows make each block slow (measured ~25% faster at 8 rows).
constexpr int PREFETCH = 2048;
inline void prefetch(const uint8_t* p, int lines) {
  for (int i = 0; i < lines; ++i) _mm_prefetch(reinterpret_cast<const char*>(p + PREFETCH + 64 * i), _MM_HINT_T0);
}

// ---------------------------------------------------------------- Q4_K
// One tile of 16 columns x R rows, block by block: each sub-block's 4 lines are loaded and unpacked once for the R
// rows (8 weight vectors in registers), each row's 8 activation groups broadcast against them.
// Float steps per (row, block), identical in both paths lane by lane: acc += isum * (d dy); acc -= imin * (dmin dy).

// bit v of each byte -> bit 4 (the rest is masked off by the caller); 16-bit shifts move no other byte's bit there
inline __m256i bit_to_4(__m256i h, int v) {
  return v < 4 ? _mm256_slli_epi16(h, 4 - v) : v == 4 ? h : _mm256_srli_epi16(h, v - 4);
}
VNNI_TARGET inline __m512i bit_to_4(__m512i h, int v) {
  return v < 4 ? _mm512_slli_epi16(h, 4 - v) : v == 4 ? h : _mm512_srli_epi16(h, v - 4);
}

template <int R, bool Q5>
void q4_avx2(const Rec* a, const Q4W& w, float* accs, int64_t t, int64_t r0) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m10 = _mm256_set1_epi8(0x10);
  const int64_t B = w.B;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t tb = t * B + b;
    const uint8_t *qs = w.qs + tb * 2048, *sm = w.sm + tb * 256;
    const int32_t* yq[R];
    for (int r = 0; r < R; ++r) yq[r] = reinterpret_cast<const int32_t*>(a[(r0 + r) * B + b].q);
    for (int half = 0; half < 2; ++half) {  // columns 8 half .. 8 half + 7
      __m256i isum[R];
      for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
      for (int l = 0; l < 8; ++l) {
        __m256i wv[8];
        for (int h = 0; h < 4; ++h) {
          const uint8_t* line = qs + 64 * (4 * l + h);
          prefetch(line, 1);
          const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32 * half));
          wv[h] = _mm256_and_si256(p, m4);
          wv[h + 4] = _mm256_and_si256(_mm256_srli_epi16(p, 4), m4);
        }
        if constexpr (Q5) {  // |int16 pair| <= 2*31*127
          const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qh + tb * 512 + 64 * l + 32 * half));
          for (int v = 0; v < 8; ++v) wv[v] = _mm256_or_si256(wv[v], _mm256_and_si256(bit_to_4(hb, v), m10));
        }
        // each column's 6-bit scale in both int16 halves of its lane: madd(s16, sc16) = (lo + hi) sc, the same
        // integer as summing the pairs first and multiplying (no mullo: its 10-cycle latency bound this loop)
        const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm + 16 * l + 8 * half)));
        const __m256i sc16 = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
        constexpr int G = Q5 ? 4 : 8;  // maddubs results summed in int16: |G * 2 * wmax * 128| < 2^15 (wmax 31 / 15)
        for (int r = 0; r < R; ++r) {
          for (int g = 0; g < 8; g += G) {
            __m256i s = _mm256_maddubs_epi16(wv[g], _mm256_set1_epi32(yq[r][8 * g + l]));
            for (int v = g + 1; v < g + G; ++v)
              s = _mm256_add_epi16(s, _mm256_maddubs_epi16(wv[v], _mm256_set1_epi32(yq[r][8 * v + l])));
            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(s, sc16));
          }
        }
      }
      __m256i mn[4];
      for (int p = 0; p < 4; ++p)
        mn[p] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm + 128 + 32 * p + 16 * half)));
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.dd + tb * 32 + 8 * half)));
      const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.dd + tb * 32 + 16 + 8 * half)));
      for (int r = 0; r < R; ++r) {
        const Rec* y = a + (r0 + r) * B + b;
        const int32_t* bs = reinterpret_cast<const int32_t*>(y->bs32);
        __m256i im = _mm256_madd_epi16(mn[0], _mm256_set1_epi32(bs[0]));
        for (int p = 1; p < 4; ++p) im = _mm256_add_epi32(im, _mm256_madd_epi16(mn[p], _mm256_set1_epi32(bs[p])));
        const __m256 dy = _mm256_set1_ps(y->d);
        float* acc = accs + 16 * r + 8 * half;
        const __m256 t1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, dy), _mm256_load_ps(acc));
        _mm256_store_ps(acc, _mm256_fnmadd_ps(_mm256_cvtepi32_ps(im), _mm256_mul_ps(dmin, dy), t1));
      }
    }
  }
}

template <int R, bool Q5>
VNNI_TARGET void q4_vnni(const Rec* a, const Q4W& w, float* accs, int64_t t, int64_t r0) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m10 = _mm512_set1_epi8(0x10);
  const int64_t B = w.B;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t tb = t * B + b;
    const uint8_t *qs = w.qs + tb * 2048, *sm = w.sm + tb * 256;
    const int32_t* yq[R];
    for (int r = 0; r < R; ++r) yq[r] = reinterpret_cast<const int32_t*>(a[(r0 + r) * B + b].q);
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int l = 0; l < 8; ++l) {
      __m512i wv[8];
      for (int h = 0; h < 4; ++h) {
        const uint8_t* line = qs + 64 * (4 * l + h);
        prefetch(line, 1);
        const __m512i p = _mm512_loadu_si512(line);
        wv[h] = _mm512_and_si512(p, m4);
        wv[h + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), m4);
      }
      if constexpr (Q5) {
        const __m512i hb = _mm512_loadu_si512(w.qh + tb * 512 + 64 * l);
        for (int v = 0; v < 8; ++v) wv[v] = _mm512_or_si512(wv[v], _mm512_and_si512(bit_to_4(hb, v), m10));
      }
      const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sm + 16 * l)));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[0], _mm512_set1_epi32(yq[r][l]));
        for (int v = 1; v < 8; ++v) s = _mm512_dpbusd_epi32(s, wv[v], _mm512_set1_epi32(yq[r][8 * v + l]));
        isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(s, sc));
      }
    }
    __m512i mn[4];
    for (int p = 0; p < 4; ++p)
      mn[p] = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm + 128 + 32 * p)));
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.dd + tb * 32)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.dd + tb * 32 + 16)));
    for (int r = 0; r < R; ++r) {
      const Rec* y = a + (r0 + r) * B + b;
      const int32_t* bs = reinterpret_cast<const int32_t*>(y->bs32);
      __m512i im = _mm512_dpwssd_epi32(_mm512_setzero_si512(), mn[0], _mm512_set1_epi32(bs[0]));
      for (int p = 1; p < 4; ++p) im = _mm512_dpwssd_epi32(im, mn[p], _mm512_set1_epi32(bs[p]));
      const __m512 dy = _mm512_set1_ps(y->d);
      float* acc = accs + 16 * r;
      const __m512 t1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, dy), _mm512_load_ps(acc));
      _mm512_store_ps(acc, _mm512_fnmadd_ps(_mm512_cvtepi32_ps(im), _mm512_mul_ps(dmin, dy), t1));
    }
  }
}

// ---------------------------------------------------------------- Q6_K
// As Q4_K, with 6-bit weights (ql: low 4 bits, qh: high 2) and 16 signed scales of 16-weight sub-blocks: per 32-weight
// chunk l, sub-block 2 l is groups v = 0..3 and 2 l + 1 groups 4..7; isum = sum_s sc_s (dot_s - 32 bsum16_s), exact
// (|.| < 2^29); one float step per (row, block, 16 columns): acc += isum * (d dy).

// bits 2c..2c+1 of each byte -> bits 4-5 (the rest is masked off by the caller)
inline __m256i high_bits(__m256i h, int c) {
  return c == 0 ? _mm256_slli_epi16(h, 4) : c == 1 ? _mm256_slli_epi16(h, 2) : c == 2 ? h : _mm256_srli_epi16(h, 2);
}
VNNI_TARGET inline __m512i high_bits(__m512i h, int c) {
  return c == 0 ? _mm512_slli_epi16(h, 4) : c == 1 ? _mm512_slli_epi16(h, 2) : c == 2 ? h : _mm512_srli_epi16(h, 2);
}

template <int R>
void q6_avx2(const Rec* a, const Q6W& w, float* accs, int64_t t, int64_t r0) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
  const int64_t B = w.B;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t tb = t * B + b;
    const uint8_t *ql = w.ql + tb * 2048, *qh = w.qh + tb * 1024;
    const int8_t* sc = w.sc + tb * 256;
    const Rec* y[R];
    for (int r = 0; r < R; ++r) y[r] = a + (r0 + r) * B + b;
    for (int half = 0; half < 2; ++half) {
      __m256i isum[R];
      for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
      for (int l = 0; l < 8; ++l) {
        prefetch(qh + 128 * l, 2);
        const __m256i h0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 128 * l + 32 * half));
        const __m256i h1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 128 * l + 64 + 32 * half));
        __m256i wv[8];
        for (int h = 0; h < 4; ++h) {
          const uint8_t* line = ql + 64 * (4 * l + h);
          prefetch(line, 1);
          const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32 * half));
          wv[h] = _mm256_or_si256(_mm256_and_si256(p, m4), _mm256_and_si256(high_bits(h0, h), m30));
          wv[h + 4] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(p, 4), m4),
                                      _mm256_and_si256(high_bits(h1, h), m30));
        }
        const __m256i sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 32 * l + 8 * half)));
        const __m256i sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 32 * l + 16 + 8 * half)));
        for (int r = 0; r < R; ++r) {  // |int16 pair| <= 2*63*128 < 2^15
          const int32_t* yq = reinterpret_cast<const int32_t*>(y[r]->q);
          __m256i s0 = _mm256_set1_epi32(y[r]->nbs[l]), s1 = _mm256_set1_epi32(y[r]->nbs[8 + l]);
          for (int v = 0; v < 4; ++v) {
            s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(wv[v], _mm256_set1_epi32(yq[8 * v + l])), ones));
            s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(wv[v + 4], _mm256_set1_epi32(yq[8 * (v + 4) + l])), ones));
          }
          isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_mullo_epi32(s0, sc0), _mm256_mullo_epi32(s1, sc1)));
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.d + tb * 16 + 8 * half)));
      for (int r = 0; r < R; ++r) {
        float* acc = accs + 16 * r + 8 * half;
        _mm256_store_ps(acc, _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, _mm256_set1_ps(y[r]->d)),
                                             _mm256_load_ps(acc)));
      }
    }
  }
}

template <int R>
VNNI_TARGET void q6_vnni(const Rec* a, const Q6W& w, float* accs, int64_t t, int64_t r0) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  const int64_t B = w.B;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t tb = t * B + b;
    const uint8_t *ql = w.ql + tb * 2048, *qh = w.qh + tb * 1024;
    const int8_t* sc = w.sc + tb * 256;
    const Rec* y[R];
    for (int r = 0; r < R; ++r) y[r] = a + (r0 + r) * B + b;
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int l = 0; l < 8; ++l) {
      prefetch(qh + 128 * l, 2);
      const __m512i h0 = _mm512_loadu_si512(qh + 128 * l), h1 = _mm512_loadu_si512(qh + 128 * l + 64);
      __m512i wv[8];
      for (int h = 0; h < 4; ++h) {
        const uint8_t* line = ql + 64 * (4 * l + h);
        prefetch(line, 1);
        const __m512i p = _mm512_loadu_si512(line);
        wv[h] = _mm512_or_si512(_mm512_and_si512(p, m4), _mm512_and_si512(high_bits(h0, h), m30));
        wv[h + 4] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(p, 4), m4),
                                    _mm512_and_si512(high_bits(h1, h), m30));
      }
      const __m512i sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 32 * l)));
      const __m512i sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 32 * l + 16)));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int32_t* yq = reinterpret_cast<const int32_t*>(y[r]->q);
        __m512i s0 = _mm512_set1_epi32(y[r]->nbs[l]), s1 = _mm512_set1_epi32(y[r]->nbs[8 + l]);
        for (int v = 0; v < 4; ++v) {
          s0 = _mm512_dpbusd_epi32(s0, wv[v], _mm512_set1_epi32(yq[8 * v + l]));
          s1 = _mm512_dpbusd_epi32(s1, wv[v + 4], _mm512_set1_epi32(yq[8 * (v + 4) + l]));
        }
        isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(_mm512_mullo_epi32(s0, sc0), _mm512_mullo_epi32(s1, sc1)));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.d + tb * 16)));
    for (int r = 0; r < R; ++r) {
      float* acc = accs + 16 * r;
      _mm512_store_ps(acc, _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, _mm512_set1_ps(y[r]->d)),
                                           _mm512_load_ps(acc)));
    }
  }
}

// ---------------------------------------------------------------- 32-weight blocks: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1
// Sub-block l of a 256-block is one GGUF block of 32 weights with its own fp16 scale d (Q4_1, Q5_1: and offset m):
// per (row, sub-block, 16 columns) an exact integer dot product of its weights with the row's per-32 quants, then
// one float step per lane (with m: two): acc += isum * (d dy); [acc += s32 * (m dy)], dy the row's per-32 scale.
// Integer sums: Q8_0 sum q y; Q4_0 sum (q - 8) y = sum q y - 8 s32; Q5_0 the same with q 0..31 (its fifth bits
// from a qh plane laid out as Q5_K's) and - 16 s32; Q4_1, Q5_1 sum q y. VNNI multiplies unsigned weights by
// signed activations, so Q8_0's signed weights go in as q + 128 (xor 0x80) and 128 s32 comes off; AVX2's maddubs
// would saturate on those (2 x 255 x 127), so it multiplies |q| by y with q's sign (|pair| <= 2 x 128 x 127).
enum Kind { K_Q8_0 = 0, K_Q4_0 = 1, K_Q4_1 = 2, K_Q5_0 = 3, K_Q5_1 = 4 };

struct B32W {  // per (tile, block): qs (Q8_0: 4096 int8 bytes, 64 lines; others: 2048 nibble bytes), d 128 halves
  const uint8_t* qs;  // (Q4_1, Q5_1: 128 d then 128 m)
  const uint16_t* d;
  int64_t B;
  const uint8_t* qh;  // Q5_0, Q5_1: the fifth bits, 512 bytes (as Q5_K's)
};

template <int KIND>
constexpr int64_t qs_bytes() { return KIND == K_Q8_0 ? 4096 : 2048; }
template <int KIND>
constexpr bool has_m() { return KIND == K_Q4_1 || KIND == K_Q5_1; }
template <int KIND>
constexpr bool five_bits() { return KIND == K_Q5_0 || KIND == K_Q5_1; }
template <int KIND>
constexpr int64_t d_halves() { return has_m<KIND>() ? 256 : 128; }
template <int KIND>
inline int32_t offset32(const Rec* y, int l) {
  return KIND == K_Q4_0 ? -8 * y->s32[l] : KIND == K_Q5_0 ? -16 * y->s32[l] : 0;
}

template <int R, int KIND>
void b32_avx2(const Rec* a, const B32W& w, float* accs, int64_t t, int64_t r0) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m10 = _mm256_set1_epi8(0x10), ones = _mm256_set1_epi16(1);
  const int64_t B = w.B;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t tb = t * B + b;
    const uint8_t* qs = w.qs + tb * qs_bytes<KIND>();
    const uint16_t* wd = w.d + tb * d_halves<KIND>();
    const Rec* y[R];
    for (int r = 0; r < R; ++r) y[r] = a + (r0 + r) * B + b;
    for (int half = 0; half < 2; ++half) {  // columns 8 half .. 8 half + 7
      for (int l = 0; l < 8; ++l) {
        __m256i s[R];
        for (int r = 0; r < R; ++r) s[r] = _mm256_set1_epi32(offset32<KIND>(y[r], l));
        if constexpr (KIND == K_Q8_0) {
          for (int v = 0; v < 8; ++v) {
            const uint8_t* line = qs + 64 * (8 * l + v);
            prefetch(line, 1);
            const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32 * half));
            const __m256i mag = _mm256_abs_epi8(p);  // -128 -> 0x80 = 128 unsigned
            for (int r = 0; r < R; ++r) {
              const __m256i yv = _mm256_set1_epi32(reinterpret_cast<const int32_t*>(y[r]->q32)[8 * v + l]);
              s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, _mm256_sign_epi8(yv, p)), ones));
            }
          }
        } else {
          __m256i hb = _mm256_setzero_si256();
          if constexpr (five_bits<KIND>())
            hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qh + tb * 512 + 64 * l + 32 * half));
          for (int h = 0; h < 4; ++h) {
            const uint8_t* line = qs + 64 * (4 * l + h);
            prefetch(line, 1);
            const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32 * half));
            __m256i lo = _mm256_and_si256(p, m4), hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), m4);
            if constexpr (five_bits<KIND>()) {
              lo = _mm256_or_si256(lo, _mm256_and_si256(bit_to_4(hb, h), m10));
              hi = _mm256_or_si256(hi, _mm256_and_si256(bit_to_4(hb, h + 4), m10));
            }
            for (int r = 0; r < R; ++r) {  // |int16 pair| <= 2*31*127
              const int32_t* yq = reinterpret_cast<const int32_t*>(y[r]->q32);
              s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(yq[8 * h + l])), ones));
              s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_set1_epi32(yq[8 * (h + 4) + l])), ones));
            }
          }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wd + 16 * l + 8 * half)));
        for (int r = 0; r < R; ++r) {
          float* acc = accs + 16 * r + 8 * half;
          const __m256 dy = _mm256_set1_ps(y[r]->d32[l]);
          __m256 sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r]), _mm256_mul_ps(d, dy), _mm256_load_ps(acc));
          if constexpr (has_m<KIND>()) {
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wd + 128 + 16 * l + 8 * half)));
            sum = _mm256_fmadd_ps(_mm256_set1_ps(static_cast<float>(y[r]->s32[l])), _mm256_mul_ps(m, dy), sum);
          }
          _mm256_store_ps(acc, sum);
        }
      }
    }
  }
}

template <int R, int KIND>
VNNI_TARGET void b32_vnni(const Rec* a, const B32W& w, float* accs, int64_t t, int64_t r0) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m10 = _mm512_set1_epi8(0x10), x80 = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t B = w.B;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t tb = t * B + b;
    const uint8_t* qs = w.qs + tb * qs_bytes<KIND>();
    const uint16_t* wd = w.d + tb * d_halves<KIND>();
    const Rec* y[R];
    for (int r = 0; r < R; ++r) y[r] = a + (r0 + r) * B + b;
    for (int l = 0; l < 8; ++l) {
      __m512i wv[8];
      if constexpr (KIND == K_Q8_0) {
        for (int v = 0; v < 8; ++v) {
          const uint8_t* line = qs + 64 * (8 * l + v);
          prefetch(line, 1);
          wv[v] = _mm512_xor_si512(_mm512_loadu_si512(line), x80);  // q + 128
        }
      } else {
        for (int h = 0; h < 4; ++h) {
          const uint8_t* line = qs + 64 * (4 * l + h);
          prefetch(line, 1);
          const __m512i p = _mm512_loadu_si512(line);
          wv[h] = _mm512_and_si512(p, m4);
          wv[h + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), m4);
        }
        if constexpr (five_bits<KIND>()) {
          const __m512i hb = _mm512_loadu_si512(w.qh + tb * 512 + 64 * l);
          for (int v = 0; v < 8; ++v) wv[v] = _mm512_or_si512(wv[v], _mm512_and_si512(bit_to_4(hb, v), m10));
        }
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wd + 16 * l)));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int32_t* yq = reinterpret_cast<const int32_t*>(y[r]->q32);
        const int32_t off = KIND == K_Q8_0 ? -128 * y[r]->s32[l] : offset32<KIND>(y[r], l);
        __m512i s = _mm512_set1_epi32(off);
        for (int v = 0; v < 8; ++v) s = _mm512_dpbusd_epi32(s, wv[v], _mm512_set1_epi32(yq[8 * v + l]));
        float* acc = accs + 16 * r;
        const __m512 dy = _mm512_set1_ps(y[r]->d32[l]);
        __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, dy), _mm512_load_ps(acc));
        if constexpr (has_m<KIND>()) {
          const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wd + 128 + 16 * l)));
          sum = _mm512_fmadd_ps(_mm512_set1_ps(static_cast<float>(y[r]->s32[l])), _mm512_mul_ps(m, dy), sum);
        }
        _mm512_store_ps(acc, sum);
      }
    }
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
using TileFn = void (*)(const Rec*, const W&, float*, int64_t, int64_t);  // (records, weight, accs, tile, first row)
template <bool Q5>
struct Q4Fns {  // Q4_K, Q5_K (Q5 = true)
  static constexpr TileFn<Q4W> avx2[MAX_R] = {q4_avx2<1, Q5>, q4_avx2<2, Q5>, q4_avx2<3, Q5>, q4_avx2<4, Q5>,
                                              q4_avx2<5, Q5>, q4_avx2<6, Q5>, q4_avx2<7, Q5>, q4_avx2<8, Q5>};
  static constexpr TileFn<Q4W> vnni[MAX_R] = {q4_vnni<1, Q5>, q4_vnni<2, Q5>, q4_vnni<3, Q5>, q4_vnni<4, Q5>,
                                              q4_vnni<5, Q5>, q4_vnni<6, Q5>, q4_vnni<7, Q5>, q4_vnni<8, Q5>};
};
constexpr TileFn<Q6W> Q6_AVX2[MAX_R] = {q6_avx2<1>, q6_avx2<2>, q6_avx2<3>, q6_avx2<4>,
                                        q6_avx2<5>, q6_avx2<6>, q6_avx2<7>, q6_avx2<8>};
constexpr TileFn<Q6W> Q6_VNNI[MAX_R] = {q6_vnni<1>, q6_vnni<2>, q6_vnni<3>, q6_vnni<4>,
                                        q6_vnni<5>, q6_vnni<6>, q6_vnni<7>, q6_vnni<8>};

template <int KIND>
struct B32Fns {
  static constexpr TileFn<B32W> avx2[MAX_R] = {b32_avx2<1, KIND>, b32_avx2<2, KIND>, b32_avx2<3, KIND>, b32_avx2<4, KIND>,
                                               b32_avx2<5, KIND>, b32_avx2<6, KIND>, b32_avx2<7, KIND>, b32_avx2<8, KIND>};
  static constexpr TileFn<B32W> vnni[MAX_R] = {b32_vnni<1, KIND>, b32_vnni<2, KIND>, b32_vnni<3, KIND>, b32_vnni<4, KIND>,
                                               b32_vnni<5, KIND>, b32_vnni<6, KIND>, b32_vnni<7, KIND>, b32_vnni<8, KIND>};
};

// Tiles of 16 columns split across threads; within a tile, rows in groups of MAX_R (a row's float sum runs over the
// blocks in the same order whatever group it is in). Lane i of a row's accumulator is column i: written out directly
// (the padding columns of the last tile are dropped).
template <class W>
void run_tiles(const Rec* a, const W& w, float* Y, int64_t M, int64_t N, const TileFn<W>* fns) {
  at::parallel_for(0, (N + TILE - 1) / TILE, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) float accs[TILE * MAX_R];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nt = std::min(TILE, N - t * TILE);
      for (int64_t r0 = 0; r0 < M; r0 += MAX_R) {
        const int64_t R = std::min<int64_t>(MAX_R, M - r0);
        std::fill(accs, accs + TILE * MAX_R, 0.f);
        fns[R - 1](a, w, accs, t, r0);
        for (int64_t r = 0; r < R; ++r) std::memcpy(Y + (r0 + r) * N + t * TILE, accs + TILE * r, nt * sizeof(float));
      }
    }
  });
}

void check_blocks(const torch::Tensor& t, int64_t NB, int64_t last, const char* name, at::ScalarType type) {
  TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.dim() == 2 && t.size(0) == NB && t.size(1) == last,
              "q4_kernel: ", name, " must be a contiguous (", NB, ", ", last, ") tensor of ", type,
              " (blocks in tile order)");
}

const Rec* check_act(const torch::Tensor& acts) {
  TORCH_CHECK(acts.dim() == 3 && acts.size(2) == REC && acts.scalar_type() == at::kByte && acts.is_contiguous() &&
                  acts.size(0) >= 1,
              "q4_kernel: activations must be a contiguous (M >= 1, B, ", REC, ") uint8 tensor from quantize_q8k");
  return reinterpret_cast<const Rec*>(acts.data_ptr<uint8_t>());
}

}  // namespace

// x (M, K) f32 -> (M, K / 256, REC) uint8 records (see Rec)
torch::Tensor quantize_q8k(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "quantize_q8k: x must be (M, K) float32");
  TORCH_CHECK(x.size(1) % QK == 0 && x.size(1) > 0, "quantize_q8k: K must be a positive multiple of 256");
  x = x.contiguous();
  const int64_t M = x.size(0), B = x.size(1) / QK;
  auto acts = torch::empty({M, B, REC}, x.options().dtype(at::kByte));
  const float* X = x.data_ptr<float>();
  Rec* A = reinterpret_cast<Rec*>(acts.data_ptr<uint8_t>());
  at::parallel_for(0, M * B, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) quantize_block(X + i * QK, A + i);
  });
  return acts;
}

torch::Tensor q4k_matmul(torch::Tensor acts, torch::Tensor qs, torch::Tensor sm, torch::Tensor dd, int64_t N,
                         int64_t isa) {
  const Rec* a = check_act(acts);
  const int64_t M = acts.size(0), B = acts.size(1), T = (N + TILE - 1) / TILE;
  check_blocks(qs, T * B, 2048, "qs", at::kByte);
  check_blocks(sm, T * B, 256, "sm", at::kByte);
  check_blocks(dd, T * B, 32, "dd", at::kHalf);
  const Q4W w{qs.data_ptr<uint8_t>(), sm.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(dd.data_ptr()), B,
              nullptr};
  auto y = torch::empty({M, N}, acts.options().dtype(at::kFloat));
  run_tiles(a, w, y.data_ptr<float>(), M, N, use_vnni(isa) ? Q4Fns<false>::vnni : Q4Fns<false>::avx2);
  return y;
}

torch::Tensor q5k_matmul(torch::Tensor acts, torch::Tensor qs, torch::Tensor qh, torch::Tensor sm, torch::Tensor dd,
                         int64_t N, int64_t isa) {
  const Rec* a = check_act(acts);
  const int64_t M = acts.size(0), B = acts.size(1), T = (N + TILE - 1) / TILE;
  check_blocks(qs, T * B, 2048, "qs", at::kByte);
  check_blocks(qh, T * B, 512, "qh", at::kByte);
  check_blocks(sm, T * B, 256, "sm", at::kByte);
  check_blocks(dd, T * B, 32, "dd", at::kHalf);
  const Q4W w{qs.data_ptr<uint8_t>(), sm.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(dd.data_ptr()), B,
              qh.data_ptr<uint8_t>()};
  auto y = torch::empty({M, N}, acts.options().dtype(at::kFloat));
  run_tiles(a, w, y.data_ptr<float>(), M, N, use_vnni(isa) ? Q4Fns<true>::vnni : Q4Fns<true>::avx2);
  return y;
}

torch::Tensor q6k_matmul(torch::Tensor acts, torch::Tensor ql, torch::Tensor qh, torch::Tensor sc, torch::Tensor wd,
                         int64_t N, int64_t isa) {
  const Rec* a = check_act(acts);
  const int64_t M = acts.size(0), B = acts.size(1), T = (N + TILE - 1) / TILE;
  check_blocks(ql, T * B, 2048, "ql", at::kByte);
  check_blocks(qh, T * B, 1024, "qh", at::kByte);
  check_blocks(sc, T * B, 256, "sc", at::kChar);
  check_blocks(wd, T * B, 16, "d", at::kHalf);
  const Q6W w{ql.data_ptr<uint8_t>(), qh.data_ptr<uint8_t>(), sc.data_ptr<int8_t>(),
              reinterpret_cast<const uint16_t*>(wd.data_ptr()), B};
  auto y = torch::empty({M, N}, acts.options().dtype(at::kFloat));
  run_tiles(a, w, y.data_ptr<float>(), M, N, use_vnni(isa) ? Q6_VNNI : Q6_AVX2);
  return y;
}

// the 32-block types: qs (T B, qs bytes) u8, d (T B, 128 or 256) f16
template <int KIND>
torch::Tensor b32_matmul(torch::Tensor acts, torch::Tensor qs, torch::Tensor wd, int64_t N, int64_t isa) {
  const Rec* a = check_act(acts);
  const int64_t M = acts.size(0), B = acts.size(1), T = (N + TILE - 1) / TILE;
  check_blocks(qs, T * B, qs_bytes<KIND>(), "qs", at::kByte);
  check_blocks(wd, T * B, d_halves<KIND>(), "d", at::kHalf);
  const B32W w{qs.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(wd.data_ptr()), B, nullptr};
  auto y = torch::empty({M, N}, acts.options().dtype(at::kFloat));
  run_tiles(a, w, y.data_ptr<float>(), M, N, use_vnni(isa) ? B32Fns<KIND>::vnni : B32Fns<KIND>::avx2);
  return y;
}

// Q5_0, Q5_1: qs (T B, 2048) u8, qh (T B, 512) u8, d (T B, 128 or 256) f16
template <int KIND>
torch::Tensor b32h_matmul(torch::Tensor acts, torch::Tensor qs, torch::Tensor qh, torch::Tensor wd, int64_t N,
                          int64_t isa) {
  const Rec* a = check_act(acts);
  const int64_t M = acts.size(0), B = acts.size(1), T = (N + TILE - 1) / TILE;
  check_blocks(qs, T * B, qs_bytes<KIND>(), "qs", at::kByte);
  check_blocks(qh, T * B, 512, "qh", at::kByte);
  check_blocks(wd, T * B, d_halves<KIND>(), "d", at::kHalf);
  const B32W w{qs.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(wd.data_ptr()), B, qh.data_ptr<uint8_t>()};
  auto y = torch::empty({M, N}, acts.options().dtype(at::kFloat));
  run_tiles(a, w, y.data_ptr<float>(), M, N, use_vnni(isa) ? B32Fns<KIND>::vnni : B32Fns<KIND>::avx2);
  return y;
}

bool has_vnni() { return cpu_has_vnni(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_q8k", &quantize_q8k, "x (M, K) f32 -> activation records (M, K / 256, 704) u8 (Q8_K and per-32 quants)");
  m.def("q4k_matmul", &q4k_matmul, "Q8_K activations x repacked Q4_K weights^T -> (M, N) f32");
  m.def("q6k_matmul", &q6k_matmul, "Q8_K activations x repacked Q6_K weights^T -> (M, N) f32");
  m.def("q8_0_matmul", &b32_matmul<K_Q8_0>, "activations x repacked Q8_0 weights^T -> (M, N) f32");
  m.def("q4_0_matmul", &b32_matmul<K_Q4_0>, "activations x repacked Q4_0 weights^T -> (M, N) f32");
  m.def("q4_1_matmul", &b32_matmul<K_Q4_1>, "activations x repacked Q4_1 weights^T -> (M, N) f32");
  m.def("q5k_matmul", &q5k_matmul, "Q8_K activations x repacked Q5_K weights^T -> (M, N) f32");
  m.def("q5_0_matmul", &b32h_matmul<K_Q5_0>, "activations x repacked Q5_0 weights^T -> (M, N) f32");
  m.def("q5_1_matmul", &b32h_matmul<K_Q5_1>, "activations x repacked Q5_1 weights^T -> (M, N) f32");
  m.def("has_vnni", &has_vnni, "whether this CPU runs the AVX-512 VNNI path");
}
