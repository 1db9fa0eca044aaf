// A Llama-family decoder stack over int8 weights, for the few rows of a draft step, on one thread: the int8
// draft's forward (draft_service/int8_draft.py) without Python between its ~40 small operations per layer, which
// cost as much as the int8 products themselves there (~13 of ~28 ms a token for SmolLM2's 30 layers).
//
// The rows may belong to several sessions (a batched draft step, draft_service/draft_batcher.py): every product
// runs over all rows at once, attention per row against its own session's buffer. In: the rows' embeddings; out:
// the residual stream after the last layer (the final norm and the LM head stay in Python). Row t belongs to
// session row_seq[t] at position row_pos[t]: its key and value go into that session's buffer
// [layers, kv_heads, capacity, head_dim] there, and it attends to positions 0 .. row_pos[t] of that buffer (a
// session's rows come in position order, so its earlier new rows are written before they are read).
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

extern "C" int specdec_int8_gemm(const float* x, const int8_t* w, const float* scale, const float* bias, float* y,
                                 long M, long N, long K);
extern "C" int specdec_int8_gemm_a16(const float* x, const int8_t* w, const float* scale, const float* bias,
                                     float* y, long M, long N, long K);

extern "C" {

struct SpecdecInt8Matrix {
  const int8_t* q;     // [n, k]
  const float* scale;  // [n]
  const float* bias;   // [n] or null
  long n, k;
  long int16_activations;  // 1: activations rounded to int16, integer products (specdec_int8_gemm_a16); 0: float32
};

struct SpecdecLlamaLayer {
  const float* input_norm;      // [hidden]
  const float* post_attn_norm;  // [hidden]
  SpecdecInt8Matrix qkv;        // [(heads + 2 kv_heads) * head_dim, hidden]
  SpecdecInt8Matrix o;          // [hidden, heads * head_dim]
  SpecdecInt8Matrix gate_up;    // [2 intermediate, hidden]
  SpecdecInt8Matrix down;       // [hidden, intermediate]
};

struct SpecdecLlamaDims {
  long hidden, heads, kv_heads, head_dim, intermediate, layers;
  float eps;
};

struct SpecdecKvBuffer {
  float* keys;    // [layers, kv_heads, capacity, head_dim]
  float* values;  // same
  long capacity;
};

}  // extern "C"

namespace {

void rms_norm(const float* x, const float* w, float* y, long n, float eps) {
  float ss = 0.f;
  for (long i = 0; i < n; i++) ss += x[i] * x[i];
  float r = 1.f / sqrtf(ss / (float)n + eps);
  for (long i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}

// rotate_half convention (transformers' Llama): (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) per half.
void rotate(float* v, const float* cos, const float* sin, long d) {
  long half = d / 2;
  for (long j = 0; j < half; j++) {
    float a = v[j], b = v[j + half];
    v[j] = a * cos[j] - b * sin[j];
    v[j + half] = b * cos[j + half] + a * sin[j + half];
  }
}

// q . k over one head. Without -ffast-math the compiler keeps a scalar sum's order, so the lanes are explicit.
float dot(const float* a, const float* b, long n) {
  long i = 0;
  float s = 0.f;
  if (n >= 8) {
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
    for (i = 8; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    s = _mm_cvtss_f32(lo);
  }
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

int gemm(const SpecdecInt8Matrix& m, const float* x, float* y, long rows) {
  if (m.int16_activations) return specdec_int8_gemm_a16(x, m.q, m.scale, m.bias, y, rows, m.n, m.k);
  return specdec_int8_gemm(x, m.q, m.scale, m.bias, y, rows, m.n, m.k);
}

}  // namespace

extern "C" {

int specdec_int8_llama_version() { return 3; }

// Returns 0; -1 on bad dimensions or a row outside its session's buffer; -2 when out of memory.
int specdec_int8_llama_forward_rows(const SpecdecLlamaDims* d, const SpecdecLlamaLayer* layers, float* x, long T,
                                    const SpecdecKvBuffer* seqs, long nseq, const long* row_seq,
                                    const long* row_pos, const float* cos, const float* sin) {
  const long H = d->hidden, nh = d->heads, nkv = d->kv_heads, hd = d->head_dim, I = d->intermediate;
  if (T < 1 || nseq < 1 || nkv < 1 || nh % nkv || hd % 2) return -1;
  long longest = 0;
  for (long t = 0; t < T; t++) {
    if (row_seq[t] < 0 || row_seq[t] >= nseq || row_pos[t] < 0 || row_pos[t] >= seqs[row_seq[t]].capacity) return -1;
    longest = row_pos[t] + 1 > longest ? row_pos[t] + 1 : longest;
  }
  const long nq = nh * hd, nk = nkv * hd, width = nq + 2 * nk, group = nh / nkv;
  const float scale = 1.f / sqrtf((float)hd);
  float* h = (float*)malloc(sizeof(float) * T * H);
  float* qkv = (float*)malloc(sizeof(float) * T * width);
  float* att = (float*)malloc(sizeof(float) * T * nq);
  float* gu = (float*)malloc(sizeof(float) * T * 2 * I);
  float* act = (float*)malloc(sizeof(float) * T * I);
  float* out = (float*)malloc(sizeof(float) * T * H);
  float* score = (float*)malloc(sizeof(float) * longest);
  int status = (h && qkv && att && gu && act && out && score) ? 0 : -2;
  for (long l = 0; l < d->layers && status == 0; l++) {
    const SpecdecLlamaLayer& L = layers[l];
    for (long t = 0; t < T; t++) rms_norm(x + t * H, L.input_norm, h + t * H, H, d->eps);
    if ((status = gemm(L.qkv, h, qkv, T))) break;
    for (long t = 0; t < T; t++) {
      const SpecdecKvBuffer& kv = seqs[row_seq[t]];
      const long capacity = kv.capacity, p = row_pos[t];
      float* lk = kv.keys + l * nkv * capacity * hd;
      float* lv = kv.values + l * nkv * capacity * hd;
      float* row = qkv + t * width;
      for (long a = 0; a < nh + nkv; a++) rotate(row + a * hd, cos + t * hd, sin + t * hd, hd);
      for (long g = 0; g < nkv; g++)
        for (long j = 0; j < hd; j++) {
          lk[(g * capacity + p) * hd + j] = row[nq + g * hd + j];
          lv[(g * capacity + p) * hd + j] = row[nq + nk + g * hd + j];
        }
    }
    for (long t = 0; t < T; t++) {
      const SpecdecKvBuffer& kv = seqs[row_seq[t]];
      const long capacity = kv.capacity;
      const float* lk = kv.keys + l * nkv * capacity * hd;
      const float* lv = kv.values + l * nkv * capacity * hd;
      const long n = row_pos[t] + 1;  // causal: this row sees its session's cache and its rows before it
      for (long a = 0; a < nh; a++) {
        const float* q = qkv + t * width + a * hd;
        const float* kh = lk + (a / group) * capacity * hd;
        const float* vh = lv + (a / group) * capacity * hd;
        float mx = -INFINITY;
        for (long j = 0; j < n; j++) {
          score[j] = dot(q, kh + j * hd, hd) * scale;
          mx = score[j] > mx ? score[j] : mx;
        }
        float sum = 0.f;
        for (long j = 0; j < n; j++) sum += (score[j] = expf(score[j] - mx));
        float* o = att + t * nq + a * hd;
        for (long e = 0; e < hd; e++) o[e] = 0.f;
        for (long j = 0; j < n; j++) {
          const float p = score[j] / sum;
          for (long e = 0; e < hd; e++) o[e] += p * vh[j * hd + e];
        }
      }
    }
    if ((status = gemm(L.o, att, out, T))) break;
    for (long i = 0; i < T * H; i++) x[i] += out[i];
    for (long t = 0; t < T; t++) rms_norm(x + t * H, L.post_attn_norm, h + t * H, H, d->eps);
    if ((status = gemm(L.gate_up, h, gu, T))) break;
    for (long t = 0; t < T; t++)
      for (long i = 0; i < I; i++) {
        const float g = gu[t * 2 * I + i];
        act[t * I + i] = g / (1.f + expf(-g)) * gu[t * 2 * I + I + i];
      }
    if ((status = gemm(L.down, act, out, T))) break;
    for (long i = 0; i < T * H; i++) x[i] += out[i];
  }
  free(h);
  free(qkv);
  free(att);
  free(gu);
  free(act);
  free(out);
  free(score);
  return status;
}

}  // extern "C"
