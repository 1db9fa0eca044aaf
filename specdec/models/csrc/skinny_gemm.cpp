// y[M,N] = x[M,K] @ w[N,K]^T (+ bias): float32 linear layers for the few rows of a decode step or a verify block,
// on AVX2 + FMA, one thread. Built and loaded by specdec/models/cpu_kernels.py (g++ at first use, cached).
//
// Why: at 1-24 rows a linear layer is bound by streaming its weight from memory. oneDNN's packed GEMM makes the
// FMAs and the weight stream take turns (a 6-row call of a 1536x576 layer took 1.4x a 1-row one); here each
// weight row comes from memory once for all the call's rows (blocks of up to 6 x-rows accumulate in registers),
// and the next weight rows are prefetched while these are multiplied, so a 6-row call costs little more than
// the stream.
//
// Each output y[m][n] is accumulated in its own register over k in the same order whatever M is, so a row's
// result does not depend on which other rows share the call: a verify block's projections equal the decode
// step's bit for bit (FP contraction is off for the scalar tail; the vector FMAs are explicit).
//
// specdec_int8_gemm is the same product with int8 weights and one float scale per output row (weight-only
// quantisation, activations stay float32): a quarter of the bytes to stream, for a draft that is the target's own
// weights rounded to int8 (specdec/models/cpu_kernels.py Int8Linear, draft_service/int8_draft.py). specdec_int8_gemm_a16
// (at the end) rounds the activations to int16 and multiplies in integers, where the CPU has AVX-512 VNNI.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

namespace {

inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 sh = _mm_movehdup_ps(lo);
  lo = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, lo);
  return _mm_cvtss_f32(_mm_add_ss(lo, sh));
}

// Eight weights as floats: float32 as they are, int8 widened (vpmovsxbd + vcvtdq2ps).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

// MR rows of x against NR rows of w (float32 or int8; `scale`, per weight row, null for float32); `prefetch` (may
// be null) is where the stream continues.
template <int MR, int NR, typename W>
void block_of(const float* x, long K, const W* w, const float* scale, float* y, long ldy, const float* bias,
              const W* prefetch) {
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; m++)
    for (int n = 0; n < NR; n++) acc[m][n] = _mm256_setzero_ps();
  long k = 0;
  for (; k + 8 <= K; k += 8) {
    if (prefetch && ((k * (long)sizeof(W)) & 63) == 0)  // one prefetch per 64-byte line of each upcoming row
      for (int n = 0; n < NR; n++) _mm_prefetch((const char*)(prefetch + n * K + k), _MM_HINT_T0);
    __m256 wv[NR];
    for (int n = 0; n < NR; n++) wv[n] = load8(w + n * K + k);
    for (int m = 0; m < MR; m++) {
      __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int n = 0; n < NR; n++) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MR; m++)
    for (int n = 0; n < NR; n++) {
      float s = hsum(acc[m][n]);
      for (long t = k; t < K; t++) s = fmaf(x[m * K + t], (float)w[n * K + t], s);
      if (scale) s *= scale[n];
      if (bias) s += bias[n];
      y[m * ldy + n] = s;
    }
}

template <int MR, int NR>
void block(const float* x, long K, const float* w, float* y, long ldy, const float* bias, const float* prefetch) {
  block_of<MR, NR, float>(x, K, w, nullptr, y, ldy, bias, prefetch);
}

typedef void (*BlockFn)(const float*, long, const float*, float*, long, const float*, const float*);

template <int NR>
BlockFn pick(int mr) {
  switch (mr) {
    case 1: return block<1, NR>;
    case 2: return block<2, NR>;
    case 3: return block<3, NR>;
    case 4: return block<4, NR>;
    case 5: return block<5, NR>;
    default: return block<6, NR>;
  }
}

// Weight rows per block: enough independent accumulators to keep both FMA pipes busy, at most 12 + loads in
// the 16 ymm registers.
int rows_per_block(int mr) { return mr == 1 ? 8 : mr <= 3 ? 4 : 2; }

// Up to 6 rows run as one chunk; more as chunks of at most 4 against 3 weight rows at a time (measured here on
// 1536x576 and 576x1536 layers at 7-24 rows: 4 x 3 beat 6 x 2, 4 x 2 and 3 x 4 blocks).
const int kSingleChunkRows = 6;
const int kChunkRows = 4;
const int kMultiChunkBlock = 3;
const int kMaxChunks = 8;
const long kPrefetchBlocks = 2;  // how far ahead (in weight blocks) the stream is prefetched

// Int8 weights (block_of with W = int8_t): widened to float 8 at a time for the FMAs; the row's scale multiplies
// the finished sum. (Tried: int16 activations with vpmaddwd, 16 products per instruction; no faster here at
// 1-128 rows, and it rounds the activations.)
template <int MR, int NR>
void block_i8(const float* x, long K, const int8_t* w, const float* scale, float* y, long ldy, const float* bias,
              const int8_t* prefetch) {
  block_of<MR, NR, int8_t>(x, K, w, scale, y, ldy, bias, prefetch);
}

typedef void (*BlockI8Fn)(const float*, long, const int8_t*, const float*, float*, long, const float*,
                          const int8_t*);

template <int NR>
BlockI8Fn pick_i8(int mr) {
  switch (mr) {
    case 1: return block_i8<1, NR>;
    case 2: return block_i8<2, NR>;
    case 3: return block_i8<3, NR>;
    default: return block_i8<4, NR>;
  }
}

const int kI8ChunkRows = 4;

// How both int8 products (float32 and int16 activations) walk the weight: blocks of `nr` weight rows, each against
// every chunk of up to `chunk_rows` x rows while it is in L1, the stream prefetched two blocks ahead (on the first
// chunk); the rows past the last whole block one at a time. block(nr, n, r0, mr, prefetch) multiplies x rows
// r0 .. r0 + mr - 1 by weight rows n .. n + nr - 1 (prefetch: where the stream continues, or null).
template <typename Block>
void int8_walk(const int8_t* w, long M, long N, long K, int nr, int chunk_rows, Block block) {
  auto rows_at = [&](long r0) { return (int)(M - r0 < chunk_rows ? M - r0 : chunk_rows); };
  long n = 0;
  for (; n + nr <= N; n += nr) {
    const int8_t* wn = w + n * K;
    const int8_t* ahead = (n + (kPrefetchBlocks + 1) * nr <= N) ? wn + kPrefetchBlocks * nr * K : nullptr;
    for (long r0 = 0; r0 < M; r0 += chunk_rows) block(nr, n, r0, rows_at(r0), r0 == 0 ? ahead : nullptr);
  }
  for (; n < N; n++)
    for (long r0 = 0; r0 < M; r0 += chunk_rows) block(1, n, r0, rows_at(r0), nullptr);
}

}  // namespace

extern "C" {

int specdec_skinny_gemm_version() { return 3; }
long specdec_skinny_gemm_max_rows() { return (long)kChunkRows * kMaxChunks; }

// Returns 0, or -1 when M is outside 1 .. specdec_skinny_gemm_max_rows(). x, w, y contiguous; bias null or N floats.
int specdec_skinny_gemm(const float* x, const float* w, const float* bias, float* y, long M, long N, long K) {
  if (M < 1 || M > (long)kChunkRows * kMaxChunks) return -1;
  // Rows in chunks, as even as possible; every chunk runs against a weight block while it is in L1.
  int chunks = M <= kSingleChunkRows ? 1 : (int)((M + kChunkRows - 1) / kChunkRows);
  int base = (int)(M / chunks), extra = (int)(M % chunks);
  int nr = chunks == 1 ? rows_per_block((int)M) : kMultiChunkBlock;
  BlockFn main_fn[kMaxChunks], tail_fn[kMaxChunks];
  long first_row[kMaxChunks];
  long row = 0;
  for (int c = 0; c < chunks; c++) {
    int mr = base + (c < extra);
    first_row[c] = row;
    row += mr;
    main_fn[c] = nr == 8 ? pick<8>(mr) : nr == 4 ? pick<4>(mr) : nr == 3 ? pick<3>(mr) : pick<2>(mr);
    tail_fn[c] = pick<1>(mr);
  }
  long n = 0;
  for (; n + nr <= N; n += nr) {
    const float* wn = w + n * K;
    // One row is the pure stream the hardware prefetcher already follows; software prefetch only costs there.
    const float* ahead = (M > 1 && n + (kPrefetchBlocks + 1) * nr <= N) ? wn + kPrefetchBlocks * nr * K : nullptr;
    for (int c = 0; c < chunks; c++)
      main_fn[c](x + first_row[c] * K, K, wn, y + first_row[c] * N + n, N, bias ? bias + n : nullptr,
                 c == 0 ? ahead : nullptr);
  }
  for (; n < N; n++)
    for (int c = 0; c < chunks; c++)
      tail_fn[c](x + first_row[c] * K, K, w + n * K, y + first_row[c] * N + n, N, bias ? bias + n : nullptr, nullptr);
  return 0;
}

// y[M,N] = (x[M,K] @ w[N,K]^T) * scale[N] (+ bias), int8 w. Any M >= 1: chunks of up to 4 rows, each chunk
// against a block of weight rows while it is in L1; the weight stream is prefetched two blocks ahead (at one row
// too: int8 rows are short streams the hardware prefetcher ramps up on too late, 129 -> 89 us on 1536x576).
// Returns 0, or -1 for M < 1.
int specdec_int8_gemm(const float* x, const int8_t* w, const float* scale, const float* bias, float* y, long M,
                      long N, long K) {
  if (M < 1) return -1;
  int8_walk(w, M, N, K, M <= 2 ? 4 : 2, kI8ChunkRows, [&](int nr, long n, long r0, int mr, const int8_t* ahead) {
    BlockI8Fn fn = nr == 4 ? pick_i8<4>(mr) : nr == 2 ? pick_i8<2>(mr) : pick_i8<1>(mr);
    fn(x + r0 * K, K, w + n * K, scale + n, y + r0 * N + n, N, bias ? bias + n : nullptr, ahead);
  });
  return 0;
}

}  // extern "C"

// specdec_int8_gemm_a16: the int8 product with the activations rounded to int16 (one scale per row of x) and
// multiplied in integers on AVX-512 VNNI: vpdpwssd takes 32 products per instruction against 8 per float FMA.
// Why: over several rows (a batched draft step over many sessions, a prefill chunk) the float kernel above is
// bound by its FMAs, not by the weight stream. (Int8 activations, 64 products per instruction, cost SmolLM2's
// int8 draft 2-4 points of acceptance; int16 keeps 13-15 bits.) A row's largest value maps to the largest
// integer that cannot overflow the int32 sums whatever the data (2^31 / (K * 127), at most 32767), so a row's
// result depends on that row alone, never on the other rows of the call.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")

namespace {

const int kAChunkRows = 4;  // x rows per chunk: 4 x 4 int32 accumulators + 4 weight vectors of the 32 zmm
const int kABlock = 4;      // weight rows per block

// A row of x into xq as int16, its scale into xs; the row is padded with zeros to `ldq` entries.
void quantize_row16(const float* x, long K, int16_t* xq, long ldq, float* xs) {
  __m512 amax = _mm512_setzero_ps();
  long k = 0;
  for (; k + 16 <= K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
  float m = _mm512_reduce_max_ps(amax);
  for (; k < K; k++) m = fabsf(x[k]) > m ? fabsf(x[k]) : m;
  const double bound = 2147483647.0 / ((double)K * 127.0);
  const float top = bound < 32767.0 ? (float)(long)bound : 32767.f;
  const float scale = m > 0.f ? m / top : 1.f;
  *xs = scale;
  const float inv = 1.f / scale;
  const __m512 vinv = _mm512_set1_ps(inv);
  for (k = 0; k + 16 <= K; k += 16)
    _mm256_storeu_si256((__m256i*)(xq + k), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(
                                                _mm512_mul_ps(_mm512_loadu_ps(x + k), vinv))));
  for (; k < K; k++) xq[k] = (int16_t)lrintf(x[k] * inv);
  for (; k < ldq; k++) xq[k] = 0;  // no contribution, whatever the weight bytes there
}

template <int MR, int NR>
void ablock(const int16_t* xq, long ldq, const float* xs, long K, const int8_t* w, const float* scale, float* y,
            long ldy, const float* bias, const int8_t* prefetch) {
  __m512i acc[MR][NR];
  for (int m = 0; m < MR; m++)
    for (int n = 0; n < NR; n++) acc[m][n] = _mm512_setzero_si512();
  long k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512i wv[NR];
    for (int n = 0; n < NR; n++) {
      if (prefetch && (k & 63) == 0) _mm_prefetch((const char*)(prefetch + n * K + k), _MM_HINT_T0);
      wv[n] = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(w + n * K + k)));
    }
    for (int m = 0; m < MR; m++) {
      __m512i xv = _mm512_loadu_si512(xq + m * ldq + k);
      for (int n = 0; n < NR; n++) acc[m][n] = _mm512_dpwssd_epi32(acc[m][n], xv, wv[n]);
    }
  }
  if (k < K) {  // the tail: weight bytes past K are masked off (xq is zero there)
    const __mmask32 mask = (__mmask32)(0xffffffffu >> (32 - (K - k)));
    __m512i wv[NR];
    for (int n = 0; n < NR; n++) wv[n] = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(mask, w + n * K + k));
    for (int m = 0; m < MR; m++) {
      __m512i xv = _mm512_loadu_si512(xq + m * ldq + k);
      for (int n = 0; n < NR; n++) acc[m][n] = _mm512_dpwssd_epi32(acc[m][n], xv, wv[n]);
    }
  }
  for (int m = 0; m < MR; m++)
    for (int n = 0; n < NR; n++) {
      float s = (float)_mm512_reduce_add_epi32(acc[m][n]) * xs[m] * scale[n];
      if (bias) s += bias[n];
      y[m * ldy + n] = s;
    }
}

typedef void (*ABlockFn)(const int16_t*, long, const float*, long, const int8_t*, const float*, float*, long,
                         const float*, const int8_t*);

template <int NR>
ABlockFn pick_a(int mr) {
  switch (mr) {
    case 1: return ablock<1, NR>;
    case 2: return ablock<2, NR>;
    case 3: return ablock<3, NR>;
    default: return ablock<4, NR>;
  }
}

}  // namespace

extern "C" {

int specdec_int8_gemm_a16_available() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

// Returns 0; -1 for M < 1; -2 when out of memory. Call only where specdec_int8_gemm_a16_available().
int specdec_int8_gemm_a16(const float* x, const int8_t* w, const float* scale, const float* bias, float* y, long M,
                          long N, long K) {
  if (M < 1) return -1;
  const long ldq = (K + 31) / 32 * 32;
  int16_t* xq = (int16_t*)aligned_alloc(64, (size_t)(M * ldq * 2 + (4 * M + 63) / 64 * 64));
  if (!xq) return -2;
  float* xs = (float*)(xq + M * ldq);
  for (long m = 0; m < M; m++) quantize_row16(x + m * K, K, xq + m * ldq, ldq, xs + m);
  int8_walk(w, M, N, K, kABlock, kAChunkRows, [&](int nr, long n, long r0, int mr, const int8_t* ahead) {
    ABlockFn fn = nr == kABlock ? pick_a<kABlock>(mr) : pick_a<1>(mr);
    fn(xq + r0 * ldq, ldq, xs + r0, K, w + n * K, scale + n, y + r0 * N + n, N, bias ? bias + n : nullptr, ahead);
  });
  free(xq);
  return 0;
}

}  // extern "C"

#pragma GCC pop_options
