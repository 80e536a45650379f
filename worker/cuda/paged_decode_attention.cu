// Decode attention straight over the paged KV cache: one query token per sequence, its keys and
// values read from the blocks its table names, no gathered copy (worker/src/paged_attention.rs).
// Compiled at run time by NVRTC (no CUDA toolkit where the worker is built), with
//   -DHEAD_DIM=...  the head size (a multiple of 8 that divides THREADS)
//   -DGROUP=...     query heads per KV head (grouped-query attention: query head h reads KV head
//                   h / GROUP, as transformers' repeat_kv)
// bf16 in and out, f32 inside; no headers, so bf16 is handled as its 16 bits.
//
// One thread block per (sequence, KV head) computes that KV head's GROUP query heads. Keys go by
// tiles of THREADS: each thread scores one key against the GROUP queries (its K row read as 16-byte
// loads), the tile's softmax statistics update a running max and sum (the online softmax), then
// each thread accumulates one dimension of the values over its share of the tile's keys.

typedef unsigned short bf16;
typedef long long i64;
struct alignas(16) Words {
  unsigned x, y, z, w;
};

#define THREADS 128
#define PARTS (THREADS / HEAD_DIM)
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf16_to_float(bf16 v) { return __uint_as_float(((unsigned)v) << 16); }

__device__ __forceinline__ bf16 float_to_bf16(float f) {
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40u);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                          // round to nearest even
  return (bf16)(u >> 16);
}

__device__ __forceinline__ float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// queries: row `seq` at seq * query_row_stride, its heads HEAD_DIM apart; key_cache / value_cache:
// [slots, kv_heads, HEAD_DIM]; block_tables: row `seq` at seq * table_row_stride, table_width
// entries; context_lens: keys per sequence (>= 1; never read past the table's blocks, as the
// gathered path clamps them); out: [batch, kv_heads * GROUP, HEAD_DIM].
extern "C" __global__ void __launch_bounds__(THREADS)
    paged_decode_attention(const bf16* __restrict__ queries, i64 query_row_stride, const bf16* __restrict__ key_cache,
                           const bf16* __restrict__ value_cache, const i64* __restrict__ block_tables,
                           i64 table_row_stride, const i64* __restrict__ context_lens, bf16* __restrict__ out,
                           int kv_heads, int block_size, float scale, i64 table_width) {
  const int seq = blockIdx.x, kv_head = blockIdx.y, t = threadIdx.x;
  const int warp = t / 32, lane = t % 32;
  __shared__ float q[GROUP][HEAD_DIM];
  __shared__ float p[GROUP][THREADS];  // a tile's scores, then their weights
  __shared__ i64 slot_of[THREADS];
  __shared__ float running_max[GROUP], running_sum[GROUP], rescale[GROUP];
  __shared__ float partial[PARTS][GROUP][HEAD_DIM];

  for (int i = t; i < GROUP * HEAD_DIM; i += THREADS) {
    const int g = i / HEAD_DIM, d = i % HEAD_DIM;
    q[g][d] = bf16_to_float(queries[seq * query_row_stride + (i64)(kv_head * GROUP + g) * HEAD_DIM + d]);
  }
  for (int g = t; g < GROUP; g += THREADS) {
    running_max[g] = NEG_INF;
    running_sum[g] = 0.f;
  }
  const i64 covered = table_width * block_size;
  const i64 context = context_lens[seq] < covered ? context_lens[seq] : covered;
  const i64* table = block_tables + seq * table_row_stride;
  const int d = t % HEAD_DIM, part = t / HEAD_DIM;
  float acc[GROUP];
  for (int g = 0; g < GROUP; ++g) acc[g] = 0.f;
  __syncthreads();

  for (i64 start = 0; start < context; start += THREADS) {
    // Scores: thread t takes key start + t.
    const i64 key = start + t;
    float score[GROUP];
    if (key < context) {
      const i64 slot = table[key / block_size] * block_size + key % block_size;
      slot_of[t] = slot;
      const Words* row = reinterpret_cast<const Words*>(key_cache + (slot * kv_heads + kv_head) * HEAD_DIM);
      for (int g = 0; g < GROUP; ++g) score[g] = 0.f;
#pragma unroll
      for (int chunk = 0; chunk < HEAD_DIM / 8; ++chunk) {
        const Words packed = row[chunk];
        const unsigned words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          const float lo = __uint_as_float(words[w] << 16), hi = __uint_as_float(words[w] & 0xffff0000u);
          const int e = chunk * 8 + w * 2;
#pragma unroll
          for (int g = 0; g < GROUP; ++g) score[g] += q[g][e] * lo + q[g][e + 1] * hi;
        }
      }
      for (int g = 0; g < GROUP; ++g) p[g][t] = score[g] * scale;
    } else {
      for (int g = 0; g < GROUP; ++g) p[g][t] = NEG_INF;
    }
    __syncthreads();
    // The tile's softmax statistics, one warp per query head.
    for (int g = warp; g < GROUP; g += THREADS / 32) {
      float tile_max = NEG_INF;
      for (int j = lane; j < THREADS; j += 32) tile_max = fmaxf(tile_max, p[g][j]);
      tile_max = warp_max(tile_max);
      const float new_max = fmaxf(running_max[g], tile_max);  // finite: the tile holds a key
      float tile_sum = 0.f;
      for (int j = lane; j < THREADS; j += 32) {
        const float weight = __expf(p[g][j] - new_max);
        p[g][j] = weight;
        tile_sum += weight;
      }
      tile_sum = warp_sum(tile_sum);
      if (lane == 0) {
        const float factor = __expf(running_max[g] - new_max);
        rescale[g] = factor;
        running_sum[g] = running_sum[g] * factor + tile_sum;
        running_max[g] = new_max;
      }
    }
    __syncthreads();
    // Values: thread t accumulates dimension d over keys part, part + PARTS, ... of the tile.
    for (int g = 0; g < GROUP; ++g) acc[g] *= rescale[g];
    const int keys = context - start < THREADS ? (int)(context - start) : THREADS;
    for (int j = part; j < keys; j += PARTS) {
      const float v = bf16_to_float(value_cache[(slot_of[j] * kv_heads + kv_head) * HEAD_DIM + d]);
#pragma unroll
      for (int g = 0; g < GROUP; ++g) acc[g] += p[g][j] * v;
    }
    __syncthreads();  // p and slot_of are rewritten by the next tile
  }

  for (int g = 0; g < GROUP; ++g) partial[part][g][d] = acc[g];
  __syncthreads();
  for (int i = t; i < GROUP * HEAD_DIM; i += THREADS) {
    const int g = i / HEAD_DIM, dim = i % HEAD_DIM;
    float sum = 0.f;
    for (int k = 0; k < PARTS; ++k) sum += partial[k][g][dim];
    out[((i64)seq * kv_heads * GROUP + kv_head * GROUP + g) * HEAD_DIM + dim] = float_to_bf16(sum / running_sum[g]);
  }
}
